#!/usr/bin/env bash
# (for the next session, first call, kind nvidia-h200 without needs_h200; carry .prebuilt,
# .whl, .walk, .cpre, .prev) whichever card comes:
# - an H200: session 35's call1.sh H200 branch (gpu_check models: issue 19's table; attn:
#   issue 17's seven shapes), the gates no session since 26 has measured;
# - an H100, issue 16's two branches against main (NOTES, session 37: predictions):
#   walk-table (.walk: main's .prebuilt) and conv-preload (.cpre: its own .prebuilt, csrc
#   changed), each `git archive BRANCH | tar -x -C .X` without benchmarks/results and
#   dflash_ops/data. bench dflash2-step 1 x 1k, three trees, two rounds; the branches' GPU
#   tests in their trees; conv_probe main vs .cpre (the 70%-of-copy gate at T >= 4096); then,
#   time left, topk_probe, Nsight Compute of the projection and its neighbours alone, and e2e
#   1 x 1k of .prev (b4d298b, main before prefetch-line) vs main.
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - t0) )); }
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:. walk:.walk cpre:.cpre" ROUNDS=2 \
      bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
    grep -E "^==|dflash2-step\] B|rror" $O/cmp_call.log | head -16
    echo "compare: $(( $(date +%s) - t0 )) s"
    (cd .walk && PYTHONPATH="$PWD:/tmp/site" timeout 120 python3 -m pytest -q -m gpu \
      tests/test_select_kernels.py tests/test_drafter2_parity.py > $O/pytest_walk.log 2>&1)
    tail -2 $O/pytest_walk.log; echo "walk tests: $(( $(date +%s) - t0 )) s"
    (cd .cpre && PYTHONPATH="$PWD:/tmp/site" timeout 120 python3 -m pytest -q -m gpu \
      tests/test_conv_kernels.py tests/test_drafter2_parity.py > $O/pytest_cpre.log 2>&1)
    tail -2 $O/pytest_cpre.log; echo "cpre tests: $(( $(date +%s) - t0 )) s"
    [ "$(left)" -gt 120 ] && OUT=$O/v COMPARE_SUITES=conv COMPARE_TREES="main:. cpre:.cpre" \
      ROUNDS=2 ROUND_BUDGET_S=$(( $(left) / 2 )) bash benchmarks/gpu_check.sh compare \
      > $O/cmp_conv_call.log 2>&1
    grep -E "^## |^\| [0-9]+ \| ours \(cuda\)" $O/v/cmp_conv_*.log 2>/dev/null \
      | sed 's|.*/cmp_conv_||' | cut -c1-140 | head -40
    echo "conv compare: $(( $(date +%s) - t0 )) s"
    [ "$(left)" -gt 60 ] && timeout 60 python3 benchmarks/topk_probe.py > $O/topk_probe.log 2>&1
    grep -E "^\|" $O/topk_probe.log | head -30; echo "topk_probe: $(( $(date +%s) - t0 )) s"
    [ "$(left)" -gt 120 ] && OUT=$O/n NCU_CASES="proj_splitk convnorm_t8 conv_t8 topk_b1 proj_triton" \
      NCU_TIMEOUT=$(( $(left) / 5 )) bash benchmarks/gpu_check.sh ncu-cases > $O/ncu_call.log 2>&1
    grep -E "^== ncu|Duration|DRAM Throughput|Grid Size|Waves" $O/ncu_call.log | head -24
    [ "$(left)" -gt 150 ] && OUT=$O/e COMPARE_SUITES=e2e \
      COMPARE_E2E_ARGS="--quick --cases 1x1024 --no-loop" COMPARE_TREES="prev:.prev main:." \
      ROUNDS=2 ROUND_BUDGET_S=$(( $(left) / 2 )) timeout $(( $(left) - 10 )) \
      bash benchmarks/gpu_check.sh compare > $O/cmp_e2e_call.log 2>&1
    grep -E "^==|iteration|decode|rror" $O/cmp_e2e_call.log | head -24
    cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
