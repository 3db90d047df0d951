#!/usr/bin/env bash
# (1) l2_prefetch_probe: o_proj's weight prefetched into L2 on a side stream while the layer's
# attention runs (prediction in NOTES, session 35); (2) the whole GPU suite (pytest -m gpu, every
# file with GPU tests; its last full run predates PDL), six shards, cut at what time is left
# (benchmarks/l2_prefetch_probe.py left the tree after this ran, 6642e36: git show b0a7319:benchmarks/l2_prefetch_probe.py)
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -2 $O/build.log
echo "build: $(( $(date +%s) - t0 )) s"
timeout ${PT:-220} python3 benchmarks/l2_prefetch_probe.py ${PROBE_ARGS:-} > $O/l2_prefetch_probe.log 2>&1
grep -vE "Warn|warn" $O/l2_prefetch_probe.log | tail -25; echo "probe: $(( $(date +%s) - t0 )) s"
left=$(( ${BUDGET:-330} - ($(date +%s) - t0) ))
if [ $left -gt 120 ]; then
  OUT=$O/t DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-main} SHARDS=${SHARDS:-6} TEST_TIMEOUT=$(( left - 40 )) \
    bash benchmarks/gpu_check.sh tests > $O/tests_call.log 2>&1; grep -E "^shard|^FAILED|^ERROR|^tests:" $O/tests_call.log | head -40
fi
cd $O && tar czf /tmp/c3.tgz . && find . -mindepth 1 -delete && mv /tmp/c3.tgz call3.tgz
echo "total: $(( $(date +%s) - t0 )) s"
