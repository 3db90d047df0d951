#!/usr/bin/env bash
# session 38 (kind nvidia-h200 without needs_h200; carry .prebuilt .whl .walk .cpre .prev):
# - an H200: session 35's call1.sh (gpu_check models: issue 19's table; attn: issue 17's seven
#   shapes), the gates no session since 26 has measured;
# - an H100: issue 16's branches against main (bench dflash2-step 1 x 1k, main / walk-table /
#   conv-preload, two rounds; their GPU tests), then issue 18's shared-cache check (bench policy
#   B 32 x 8k, p 0 and 0.8, blocks of their own vs --share 2: the rates should agree within the
#   runs' spread), then conv_probe main vs conv-preload if time is left.
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
    (cd .walk && PYTHONPATH="$PWD:/tmp/site" timeout 90 python3 -m pytest -q -m gpu \
      tests/test_select_kernels.py > $O/pytest_walk.log 2>&1)
    tail -2 $O/pytest_walk.log; echo "walk tests: $(( $(date +%s) - t0 )) s"
    (cd .cpre && PYTHONPATH="$PWD:/tmp/site" timeout 90 python3 -m pytest -q -m gpu \
      tests/test_conv_kernels.py > $O/pytest_cpre.log 2>&1)
    tail -2 $O/pytest_cpre.log; echo "cpre tests: $(( $(date +%s) - t0 )) s"
    for sh in 0 2; do
      [ "$(left)" -gt 150 ] || break
      OUT=$O/p$sh POLICY_EACH="32x8k" POLICY_TIMEOUT=$(( $(left) > 300 ? 150 : $(left) - 10 )) \
        DFLASH_OPS_BENCH_POLICY_PS=0,0.8 BENCH_ARGS="--share $sh" \
        bash benchmarks/gpu_check.sh policy > $O/policy_share$sh.log 2>&1
      grep -E "policy 32x8k|share|\| *(0|0.8) *\|" $O/policy_share$sh.log $O/p$sh/results/*.md 2>/dev/null | head -12
      echo "policy share $sh: $(( $(date +%s) - t0 )) s"
    done
    [ "$(left)" -gt 100 ] && OUT=$O/v COMPARE_SUITES=conv COMPARE_TREES="main:. cpre:.cpre" \
      ROUNDS=2 ROUND_BUDGET_S=$(( $(left) / 2 - 10 )) timeout $(( $(left) - 5 )) \
      bash benchmarks/gpu_check.sh compare > $O/cmp_conv_call.log 2>&1
    grep -E "^## |^\| [0-9]+ \| ours \(cuda\)" $O/v/cmp_conv_*.log 2>/dev/null \
      | sed 's|.*/cmp_conv_||' | cut -c1-140 | head -40
    echo "conv compare: $(( $(date +%s) - t0 )) s" ;;
esac
cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz
echo "total: $(( $(date +%s) - t0 )) s"
