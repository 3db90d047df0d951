#!/usr/bin/env bash
# session 41's call (kind nvidia-h200 without needs_h200: either card; carry .prebuilt, .whl):
# first the GPU tests of this session's hostile-input fixes (odd GQA groups and split partials
# past 2^31 in block_attention, NaN scores in the selector walk, ~2 min), then
# - an H200: issue 18's grid, the cases in $CASES (session 40's call.sh, what is left of BUDGET);
# - an H100: issue 16's projection taken apart (proj_probe, session 40's plan).
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
timeout $(( $(left) - 60 < 200 ? $(left) - 60 : 200 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_block_attention_gpu.py tests/test_select_kernels.py \
  -k "odd_gqa or split_partials or test_kernels_gpu" > $O/tests41.log 2>&1
echo "tests41 rc $?: $(tail -1 $O/tests41.log)"
case "$gpu" in
  *H200*)
    for c in ${CASES:-1x1k 8x1k 32x1k 1x8k 8x8k}; do
      [ "$(left)" -lt 60 ] && { echo "policy $c: skipped, $(left) s left"; continue; }
      OUT=$O/p POLICY_EACH=$c POLICY_TIMEOUT=$(( $(left) - 15 )) \
        bash benchmarks/gpu_check.sh policy >> $O/policy_call.log 2>&1
      grep -E "^policy $c|verdict" $O/policy_call.log $O/p/bench_policy_$c.log | tail -2 | cut -c1-220
    done ;;
  *)
    timeout $(( $(left) - 10 )) python3 benchmarks/proj_probe.py > $O/proj_probe_m8.log 2>&1
    grep -E "^\||floor|rror" $O/proj_probe_m8.log ;;
esac
cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz call.tgz
echo "total: $(( $(date +%s) - t0 )) s"
