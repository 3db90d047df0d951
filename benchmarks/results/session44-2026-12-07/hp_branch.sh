#!/usr/bin/env bash
# session 44 (carry .prebuilt .whl .old .hp): branch hp-branch against main, three trees:
#   main: .old = 258c724 (git worktree add .old 258c724 --detach && cp -r .prebuilt .old/)
#   hp:   .hp  = 63c0267 (the selector's hidden projection on a graph branch beside the LM head)
#   walk: this tree (hp + the walk with its operands one row ahead)
# GPU tests of this tree first (the branch under graph replay, DFlash 2 parity, the select
# kernels, the sampled loop with a DFlash 2 drafter), then bench dflash2-step at 1 x 1k and
# 8 x 1k, the three trees alternated twice, then this tree's bench dflash2 --quick (the walk
# and top-k alone) with the time left.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter2_parity.py \
  tests/test_select_kernels.py "tests/test_speculator.py::test_sampling_matches_target_distribution" \
  > $O/tests.log 2>&1; echo "tests rc $?: $(tail -1 $O/tests.log)"
grep -E "^FAILED|^ERROR" $O/tests.log | head
OUT=$O/cmp COMPARE_TREES="main:.old hp:.hp walk:." COMPARE_SUITES=dflash2-step \
  COMPARE_D2_CASES=1x1024,8x1024 ROUND_BUDGET_S=300 bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1
grep -E "^==|dflash2-step\] B=|rror|WRONG" $O/cmp.log | head -40
left=$(( 540 - ($(date +%s) - t0) ))
if [ $left -gt 60 ]; then
  timeout $left dflash-ops bench dflash2 --quick --no-plot --out $O/dflash2 > $O/dflash2.log 2>&1
  echo "bench dflash2 rc $?"; grep -iE "walk|topk|select" $O/dflash2/dflash2.md | head -20
fi
echo "total: $(( $(date +%s) - t0 )) s"
