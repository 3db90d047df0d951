#!/usr/bin/env bash
# session 44: the DFlash 2 selector's hidden projection on a graph branch beside the LM head
# (this tree) vs main (258c724 in .old: git worktree add .old 258c724 && cp -r .prebuilt .old/).
# GPU tests first (the branch under graph replay, DFlash 2 parity, the select kernels, the
# sampled loop with a DFlash 2 drafter), then bench dflash2-step at 1 x 1k and 8 x 1k, the two
# trees alternated twice. carry .prebuilt .whl .old
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter2_parity.py \
  tests/test_select_kernels.py "tests/test_speculator.py::test_sampling_matches_target_distribution" \
  > $O/tests.log 2>&1; echo "tests rc $?: $(tail -1 $O/tests.log)"
grep -E "^FAILED|^ERROR" $O/tests.log | head
OUT=$O/cmp OLD_COMMIT=main COMPARE_SUITES=dflash2-step COMPARE_D2_CASES=1x1024,8x1024 \
  DFLASH_OPS_COMMIT=hp-branch ROUND_BUDGET_S=360 bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1
grep -E "^==|dflash2-step\] B=|rror|WRONG" $O/cmp.log | head -30
echo "total: $(( $(date +%s) - t0 )) s"
