#!/usr/bin/env bash
# session 40's calls (kind nvidia-h200 without needs_h200: either card; carry .prebuilt, .whl):
# - an H200: issue 18's grid, the cases in $CASES (default the five small ones), each in its
#   own process under what is left of the call's ~570 s (policy-<case>.json each);
# - an H100: issue 16's projection taken apart (proj_probe at M 8: the table config's tile
#   loads alone, main loop alone, whole launch with PDL off, beside the read-only kernel).
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
case "$gpu" in
  *H200*)
    OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
    for c in ${CASES:-1x1k 8x1k 32x1k 1x8k 8x8k}; do
      [ "$(left)" -lt 60 ] && { echo "policy $c: skipped, $(left) s left"; continue; }
      OUT=$O/p POLICY_EACH=$c POLICY_TIMEOUT=$(( $(left) - 15 )) \
        bash benchmarks/gpu_check.sh policy >> $O/policy_call.log 2>&1
      grep -E "^policy $c|verdict" $O/policy_call.log $O/p/bench_policy_$c.log | tail -2 | cut -c1-220
    done ;;
  *)
    OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
    timeout $(( $(left) - 10 )) python3 benchmarks/proj_probe.py > $O/proj_probe_m8.log 2>&1
    grep -E "^\||floor|rror" $O/proj_probe_m8.log ;;
esac
cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz call.tgz
echo "total: $(( $(date +%s) - t0 )) s"
