#!/usr/bin/env bash
# session 41's call (kind nvidia-h200 without needs_h200: either card; carry .prebuilt, .whl):
# the GPU tests of this session's hostile-input fixes (odd GQA groups and split partials past
# 2^31 in block_attention, NaN scores in the selector walk; ~2 min), then session 40's call.sh
# with what is left of BUDGET (an H200: issue 18's grid, the cases in $CASES; an H100: issue
# 16's projection taken apart by proj_probe). Everything under $OUT ends in call.tgz.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
OUT=$O/b41 bash benchmarks/gpu_check.sh build > $O/build41.log 2>&1; grep install $O/build41.log
t=$(( $(left) - 60 < 200 ? $(left) - 60 : 200 ))
timeout $t python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_block_attention_gpu.py \
  tests/test_select_kernels.py -k "odd_gqa or split_partials or test_kernels_gpu" \
  > $O/tests41.log 2>&1
echo "tests41 rc $?: $(tail -1 $O/tests41.log)"
OUT=$O BUDGET=$(left) bash benchmarks/results/session40-2026-12-07/call.sh
