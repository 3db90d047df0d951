#!/usr/bin/env bash
# (for the next session, first call, kind nvidia-h200 without needs_h200; carry .prebuilt,
# .whl, .walk, .prev) whichever card comes:
# - an H200: session 35's call1.sh H200 branch (gpu_check models: issue 19's table; attn:
#   issue 17's seven shapes), the gates no session since 26 has measured;
# - an H100: branch walk-table (.walk: `git archive walk-table | tar -x -C .walk`, without
#   benchmarks/results and dflash_ops/data, main's .prebuilt: no csrc change) vs main, bench
#   dflash2-step 1 x 1k, two rounds (predicted -4 to -9 us), its GPU tests in its tree;
#   topk_probe (row_topk's warp counts); then
#   Nsight Compute of the DFlash 2 kernel projection and its neighbours alone (issue 16:
#   profile before the next change); then, time left, e2e at 1 x 1k of .prev (b4d298b, main
#   before prefetch-line) vs main (predicted 0 to -50 us on the 5.9 ms decode)
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:. walk:.walk" ROUNDS=2 \
      bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
    grep -E "^==|dflash2-step\] B|rror" $O/cmp_call.log | head -12
    echo "compare: $(( $(date +%s) - t0 )) s"
    (cd .walk && PYTHONPATH="$PWD:/tmp/site" timeout 150 python3 -m pytest -q -m gpu \
      tests/test_select_kernels.py tests/test_drafter2_parity.py tests/test_bench_dflash2_step.py \
      > $O/pytest_walk.log 2>&1)
    tail -3 $O/pytest_walk.log; echo "walk tests: $(( $(date +%s) - t0 )) s"
    timeout 120 python3 benchmarks/topk_probe.py > $O/topk_probe.log 2>&1
    grep -E "^\|" $O/topk_probe.log | head -30; echo "topk_probe: $(( $(date +%s) - t0 )) s"
    OUT=$O/n NCU_CASES="proj_splitk proj_triton convnorm_t8 topk_b1" \
      bash benchmarks/gpu_check.sh ncu-cases > $O/ncu_call.log 2>&1
    grep -E "^== ncu|Duration|DRAM Throughput|Grid Size|Waves" $O/ncu_call.log | head -24
    echo "ncu: $(( $(date +%s) - t0 )) s"
    left=$(( ${BUDGET:-560} - ($(date +%s) - t0) ))
    [ $left -gt 150 ] && OUT=$O/e COMPARE_SUITES=e2e \
      COMPARE_E2E_ARGS="--quick --cases 1x1024 --no-loop" COMPARE_TREES="prev:.prev main:." \
      ROUNDS=2 ROUND_BUDGET_S=$(( left / 2 )) timeout $(( left - 10 )) \
      bash benchmarks/gpu_check.sh compare > $O/cmp_e2e_call.log 2>&1
    grep -E "^==|iteration|decode|rror" $O/cmp_e2e_call.log | head -24
    cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
