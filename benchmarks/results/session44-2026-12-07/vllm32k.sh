#!/usr/bin/env bash
# session 44: issue 15's last grid point, vLLM 32 x 32k (stock vs plugin, 8B-width pair,
# 256 new tokens, no profile) on an 80 GB card (--gpu-memory 0.85: ~48 GB of K/V for the
# 6-layer target and the 5-layer drafter plus ~7 GB of weights). The machine stays warm between
# calls, so the variants may run in two calls: VLLM_VARIANTS picks them. TESTS=1 first runs
# the select / top-k GPU tests (session 44's test fix: the CUDA walk's k limit).
# carry .prebuilt .whl .vllm
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ "${TESTS:-0}" = 1 ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_select_kernels.py \
    > $O/tests.log 2>&1; echo "select tests rc $?: $(tail -1 $O/tests.log)"
fi
OUT=$O VLLM_TIMEOUT=${VLLM_TIMEOUT:-330} VLLM_VARIANTS="${VLLM_VARIANTS:-stock plugin}" \
  BENCH_ARGS="--batch 32 --context 32768 --new 256 --profile 0 --gpu-memory 0.85" \
  bash benchmarks/gpu_check.sh vllm-bench > $O/vllm.log 2>&1
cat $O/vllm.log | tail -15; cat $O/vllm_bench.md 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
