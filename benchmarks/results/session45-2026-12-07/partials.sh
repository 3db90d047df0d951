#!/usr/bin/env bash
# (Ran on a tree with the change, uncommitted; the change was refuted and deleted: NOTES, session 45.)
# session 45 (carry .prebuilt .whl .old): issue 16's consumer-sums-partials against main.
#   main: .old = 259b85c (git worktree add .old 259b85c --detach && cp -r .prebuilt .old/)
#   new:  this tree (DFlash 2's kernel projections hand their fp32 split-K partials to the
#         convolutions, which sum them: the GEMM's split-K tail is gone)
# GPU tests of this tree first (the conv kernels with partials, the split-K partials, the
# DFlash 2 drafter, the conv ops' bad inputs), then bench dflash2-step at 1 x 1k and 8 x 1k,
# main and new alternated, then memcheck over the conv kernels' tests with the time left.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_conv_kernels.py \
  "tests/test_triton_context_kv_interp.py::test_kv_proj_split_gpu" tests/test_drafter2_parity.py \
  > $O/tests.log 2>&1; echo "tests rc $?: $(tail -1 $O/tests.log)"
grep -E "^FAILED|^ERROR" $O/tests.log | head
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_bad_inputs.py -k conv \
  > $O/bad.log 2>&1; echo "bad inputs rc $?: $(tail -1 $O/bad.log)"
OUT=$O/cmp COMPARE_TREES="main:.old new:." COMPARE_SUITES=dflash2-step \
  COMPARE_D2_CASES=1x1024,8x1024 ROUND_BUDGET_S=${ROUND_BUDGET_S:-240} \
  bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1
grep -E "^==|dflash2-step\] B=|rror|WRONG" $O/cmp.log | head -40
left=$(( 560 - ($(date +%s) - t0) ))
if [ $left -gt 60 ]; then
  OUT=$O/san SAN_TOOLS=memcheck SAN_TIMEOUT=$left SAN_FILES=tests/test_conv_kernels.py \
    SAN_K="cuda" bash benchmarks/gpu_check.sh sanitize > $O/san.log 2>&1; tail -4 $O/san.log
fi
echo "total: $(( $(date +%s) - t0 )) s"
