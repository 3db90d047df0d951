#!/usr/bin/env bash
# (for the next session, first call, kind nvidia-h200 without needs_h200; carry .prebuilt,
# .whl, .line, .pconv, .topk) whichever card comes:
# - an H200: session 35's call1.sh H200 branch (gpu_check models: issue 19's table; attn:
#   issue 17's seven shapes), the gates no session since 26 has measured;
# - an H100: branch prefetch-line (.line: `git archive prefetch-line | tar -x -C .line`, its
#   .prebuilt from `cd .line && bash benchmarks/prebuild.sh`, benchmarks/results removed) and
#   branches proj-conv and topk-fused (.pconv, .topk the same way; main's .prebuilt fits
#   both: no csrc change) vs main (this tree), bench dflash2-step 1 x 1k, two rounds (session
#   36's plan item 2), the two branches' GPU tests in their trees, then memcheck alone over
#   the early-trigger Triton kernels' tests (plan item 3)
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -1 $O/build.log
    OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:. line:.line pconv:.pconv topk:.topk" ROUNDS=2 \
      ROUND_BUDGET_S=250 bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
    grep -E "^==|dflash2-step\] B|rror|trees" $O/cmp_call.log | head -20
    echo "compare: $(( $(date +%s) - t0 )) s"
    (cd .pconv && PYTHONPATH="$PWD" timeout 150 python3 -m pytest -q -m gpu tests/test_proj_conv.py \
      tests/test_drafter2_parity.py > $O/pytest_pconv.log 2>&1)
    tail -3 $O/pytest_pconv.log; echo "pconv tests: $(( $(date +%s) - t0 )) s"
    (cd .topk && PYTHONPATH="$PWD" timeout 120 python3 -m pytest -q -m gpu \
      tests/test_select_kernels.py -k topk > $O/pytest_topk.log 2>&1)
    tail -3 $O/pytest_topk.log; echo "topk tests: $(( $(date +%s) - t0 )) s"
    left=$(( ${BUDGET:-560} - ($(date +%s) - t0) ))
    [ $left -gt 100 ] && OUT=$O/s SAN_TOOLS=memcheck SAN_TIMEOUT=$(( left - 20 )) \
      SAN_FILES="tests/test_norm_kernels.py tests/test_qk_norm_rope_store_kernels.py tests/test_glu_proj.py" \
      bash benchmarks/gpu_check.sh sanitize > $O/san_call.log 2>&1
    grep -E "rc|SUMMARY" $O/san_call.log | head
    cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
