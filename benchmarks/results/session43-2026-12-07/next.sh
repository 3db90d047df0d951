#!/usr/bin/env bash
# session 43's first call for the next session (kind nvidia-h200 without needs_h200: either
# card; carry .prebuilt, .whl): the select / top-k GPU tests with session 43's new cases (walks
# at k 40 and 64, top-k at k 33 and 64 over a full vocabulary: interpreter-checked only), then
# - an H200: session 40's call.sh with what is left of BUDGET (issue 18's grid for the record);
# - an H100: the DFlash 2 step's whole kernel profile at 1 x 1k (40 rows: the selector and the
#   top-k launches beside the projections and convs), then fork_probe.py (does a graph branch
#   for the projection's finish half pay?), the inputs of issue 16's next change.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
OUT=$O/b43 bash benchmarks/gpu_check.sh build > $O/build43.log 2>&1; grep install $O/build43.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the carried wheels, as gpu_check has them
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_select_kernels.py \
  tests/test_drafter2_parity.py > $O/tests43.log 2>&1
echo "select tests rc $?: $(tail -1 $O/tests43.log)"
case "$gpu" in
  *H200*) OUT=$O BUDGET=$(left) bash benchmarks/results/session40-2026-12-07/call.sh ;;
  *) timeout $(( $(left) - 10 )) python3 benchmarks/profile_step.py --graph --rows 40 \
       --cases dflash2:1x1024 > $O/profile_d2.log 2>&1
     grep -E "GPU time|_kernel|nvjet" $O/profile_d2.log | head -60
     timeout 120 python3 benchmarks/results/session43-2026-12-07/fork_probe.py > $O/fork_probe.log 2>&1; tail -8 $O/fork_probe.log ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
