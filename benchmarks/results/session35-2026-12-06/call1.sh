#!/usr/bin/env bash
# session 35, first call (no kind named): on an H200, plan item 1a (gpu_check models: issue 19's
# table; attn: issue 17's seven shapes, graph replay); on an H100, plan items 2, 2b, 3
# (next-profile.sh of session 34: step profiles, never_probe, racecheck over the attention tests)
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0 DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-main}
case "$gpu" in
  *H200*)
    OUT=$O/m bash benchmarks/gpu_check.sh models > $O/models_call.log 2>&1; tail -40 $O/models_call.log
    echo "models: $(( $(date +%s) - t0 )) s"
    left=$(( ${BUDGET:-570} - ($(date +%s) - t0) )); [ $left -gt 280 ] && \
    OUT=$O/a BENCH_ARGS="--cases 1x1024,1x32768,1x131072,8x4096,32x4096,64x1024,128x8192 --tables paged --no-flex" \
      timeout $left bash benchmarks/gpu_check.sh attn > $O/attn_call.log 2>&1; grep -E "^\|" $O/attn_call.log | tail -20
    echo "attn: $(( $(date +%s) - t0 )) s"
    cd $O && tar czf /tmp/c1.tgz . && find . -mindepth 1 -delete && mv /tmp/c1.tgz call1-h200.tgz ;;
  *)
    OUT=$O bash benchmarks/results/session34-2026-12-06/next-profile.sh ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
