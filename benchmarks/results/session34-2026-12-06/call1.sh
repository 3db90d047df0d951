#!/usr/bin/env bash
# attn-trig (this tree: pdl-triggers + attn-pending-a, attn-pending-a's prebuild): its GPU tests,
# then compute-sanitizer memcheck over the attention and token-meta tests while time is left
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; export OP_CHECK=0
OUT=$O/t DFLASH_OPS_COMMIT=attn-trig TEST_TIMEOUT=${TT:-300} TEST_FILES="tests/test_block_attention_gpu.py tests/test_attention_split_keys.py tests/test_exact_mode.py tests/test_glu_proj.py tests/test_norm_kernels.py tests/test_qk_norm_rope_store_kernels.py tests/test_target.py tests/test_speculator.py tests/test_models_linear.py" \
  bash benchmarks/gpu_check.sh tests
echo "tests: $(( $(date +%s) - t0 )) s"
left=$(( ${BUDGET:-570} - ($(date +%s) - t0) ))
if [ $left -gt 90 ]; then
  OUT=$O/s SAN_FILES="tests/test_block_attention_gpu.py tests/test_token_meta.py" SAN_TOOLS=memcheck SAN_TIMEOUT=$left \
    bash benchmarks/gpu_check.sh sanitize
fi
cd $O && tar czf /tmp/c1.tgz . && find . -mindepth 1 -delete && mv /tmp/c1.tgz call1.tgz
echo "total: $(( $(date +%s) - t0 )) s"
