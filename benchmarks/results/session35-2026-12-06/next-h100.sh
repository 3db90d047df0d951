#!/usr/bin/env bash
# (for the next session, plan item 2, on an H100) the twelve GPU test files that session 35's
# whole-suite run (call 3) cut by its timeout, then memcheck and racecheck over the Triton
# kernels that trigger their dependents early (norm, q/k norm + RoPE + store, the GEMM
# epilogues), graph tests left out as gpu_check.sh sanitize does
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/t DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-main} SHARDS=4 TEST_TIMEOUT=${TT:-330} \
  TEST_FILES="tests/test_attention_split_keys.py tests/test_block_attention_gpu.py tests/test_draft_step.py tests/test_kv_kernels.py tests/test_policy.py tests/test_triton_splitk_sm90.py tests/test_bench_dflash2_step.py tests/test_context_kernels.py tests/test_drafter_gpu.py tests/test_models_linear.py tests/test_rope_kernels.py tests/test_vllm_plugin.py" \
  bash benchmarks/gpu_check.sh tests > $O/tests_call.log 2>&1; grep -E "^shard|^FAILED|^ERROR|^tests:" $O/tests_call.log | head -40
left=$(( ${BUDGET:-570} - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then
  OUT=$O/s SAN_FILES="tests/test_norm_kernels.py tests/test_qk_norm_rope_store_kernels.py tests/test_glu_proj.py" \
    SAN_TOOLS="memcheck racecheck" SAN_TIMEOUT=$(( left / 2 )) \
    bash benchmarks/gpu_check.sh sanitize > $O/san_call.log 2>&1; grep -E "rc|Race|Invalid|SUMMARY" $O/san_call.log | head -20
fi
cd $O && tar czf /tmp/nh.tgz . && find . -mindepth 1 -delete && mv /tmp/nh.tgz next-h100.tgz
echo "total: $(( $(date +%s) - t0 )) s"
