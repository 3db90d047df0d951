#!/usr/bin/env bash
# for session 39's first call (kind nvidia-h200 without needs_h200; carry .prebuilt, .whl):
# - an H200: session 35's call1.sh (gpu_check models: issue 19's table; attn: issue 17's seven
#   shapes), the gates no session since 26 has measured;
# - an H100: issue 18's B 32 x 32k, never measured anywhere (bench policy's caches shared in
#   threes or fours: session 38), p 0 / 0.2 / 0.4 (the next call: P39B="0.6,0.8,0.95").
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/p POLICY_EACH="32x32k" POLICY_TIMEOUT=$(( ${BUDGET:-560} - 30 )) \
      DFLASH_OPS_BENCH_POLICY_PS=${P39B:-0,0.2,0.4} bash benchmarks/gpu_check.sh policy \
      > $O/policy_call.log 2>&1
    grep -E "policy 32x32k|share|peak|\| B=32" $O/policy_call.log $O/p/results/*.md 2>/dev/null \
      | cut -c1-200 | head -30 ;;
esac
cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz
echo "total: $(( $(date +%s) - t0 )) s"
