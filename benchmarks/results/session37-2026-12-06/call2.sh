#!/usr/bin/env bash
# session 37, call 2 (carry .prebuilt .whl .prev): main with branch prefetch-line merged.
# Its GPU tests (split-K GEMM, conv kernels, the DFlash 2 drafter and the paths over them),
# bench dflash2-step 1 x 1k vs .prev (b4d298b, main before the merge), then memcheck and
# racecheck (cuBLAS's nvjet kernels skipped) over the conv and split-K tests.
# On an H200 instead: session 35's call1.sh H200 branch (issue 19's table, issue 17's shapes).
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh; exit ;; esac
OUT=$O/t SHARDS=4 TEST_FILES="tests/test_triton_splitk_sm90.py tests/test_conv_kernels.py \
  tests/test_drafter2_parity.py tests/test_models_linear.py tests/test_context_kernels.py \
  tests/test_bench_dflash2_step.py tests/test_speculator.py" \
  bash benchmarks/gpu_check.sh tests > $O/tests_call.log 2>&1
grep -E "^shard|^(FAILED|ERROR)|^tests:" $O/tests_call.log | head -30
OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="prev:.prev main:." ROUNDS=2 \
  bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
grep -E "^==|dflash2-step\] B|rror" $O/cmp_call.log | head -20
echo "compare: $(( $(date +%s) - t0 )) s"
left=$(( ${BUDGET:-570} - ($(date +%s) - t0) ))
[ $left -gt 120 ] && OUT=$O/s SAN_TIMEOUT=$(( (left - 30) / 2 )) \
  SAN_FILES="tests/test_conv_kernels.py tests/test_triton_splitk_sm90.py" \
  bash benchmarks/gpu_check.sh sanitize > $O/san_call.log 2>&1
grep -E "rc|SUMMARY|Race|Invalid" $O/san_call.log | head
echo "total: $(( $(date +%s) - t0 )) s"
