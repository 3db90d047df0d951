#!/usr/bin/env bash
# session 36, call 2 (H100 or H200): the weight prefetch before the PDL wait (this tree,
# "prefetch") vs main (6ae75f8 in .old, carrying this tree's bench/dflash2_step.py for
# --cases): the GPU tests of the kernels it touches, then bench dflash2-step at 1 x 1k (DFlash 2
# step and its twin) alternating main / prefetch, two rounds (prediction in NOTES, session 36)
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/t DFLASH_OPS_COMMIT=prefetch SHARDS=4 TEST_TIMEOUT=${TT:-150} \
  TEST_FILES="tests/test_conv_kernels.py tests/test_models_linear.py tests/test_glu_proj.py tests/test_exact_mode.py tests/test_triton_splitk_sm90.py" \
  bash benchmarks/gpu_check.sh tests > $O/tests_call.log 2>&1; grep -E "^shard|^FAILED|^ERROR|^tests:" $O/tests_call.log | head -30
echo "tests: $(( $(date +%s) - t0 )) s"
OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:.old prefetch:." ROUNDS=2 \
  ROUND_BUDGET_S=$(( ${BUDGET:-470} - 110 )) \
  bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1; grep -E "^==|dflash2-step\] B|rror|trees" $O/cmp_call.log | head -40
cd $O && tar czf /tmp/c2.tgz . && find . -mindepth 1 -delete && mv /tmp/c2.tgz call2.tgz
echo "total: $(( $(date +%s) - t0 )) s"
