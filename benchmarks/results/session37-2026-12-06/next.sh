#!/usr/bin/env bash
# (for the next session, first call, kind nvidia-h200 without needs_h200; carry .prebuilt,
# .whl, .prev: b4d298b's tree, main before prefetch-line, with its own .prebuilt) whichever
# card comes:
# - an H200: session 35's call1.sh H200 branch (gpu_check models: issue 19's table; attn:
#   issue 17's seven shapes), the gates no session since 26 has measured;
# - an H100: Nsight Compute of the DFlash 2 step's kernel projection and its neighbours alone
#   (issue 16: profile before the next change), then e2e at 1 x 1k of .prev vs main, two rounds
#   (does the prefetch move plain decode's split-K o_proj / down? predicted 0 to -50 us on the
#   5.9 ms decode)
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/n NCU_CASES="proj_splitk proj_triton convnorm_t8 topk_b1" \
      bash benchmarks/gpu_check.sh ncu-cases > $O/ncu_call.log 2>&1
    grep -E "^== ncu|Duration|DRAM Throughput|Grid Size|Waves" $O/ncu_call.log | head -24
    echo "ncu: $(( $(date +%s) - t0 )) s"
    OUT=$O/c COMPARE_SUITES=e2e COMPARE_E2E_ARGS="--quick --cases 1x1024 --no-loop" \
      COMPARE_TREES="prev:.prev main:." ROUNDS=2 ROUND_BUDGET_S=$(( ${BUDGET:-560} - 150 )) \
      bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
    grep -E "^==|iteration|decode|rror" $O/cmp_call.log | head -24
    echo "compare: $(( $(date +%s) - t0 )) s"
    cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
