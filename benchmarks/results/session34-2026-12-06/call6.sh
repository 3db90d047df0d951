#!/usr/bin/env bash
# plain decode less its own prefill (it subtracted the loop's, which adds the drafter's context
# for every prompt row): never vs plain at p 0, 32 x 1k, 8 x 8k, 32 x 8k (this tree)
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OP_CHECK=0 OUT=$O/q POLICY_EACH="32x1k 8x8k 32x8k" POLICY_TIMEOUT=${T1:-150} DFLASH_OPS_BENCH_POLICY_PS=0 \
  DFLASH_OPS_COMMIT=main-34-plain bash benchmarks/gpu_check.sh policy
cd $O && find . -type f | sort && tar czf /tmp/c6.tgz . && find . -mindepth 1 -delete && mv /tmp/c6.tgz call6.tgz
echo "total: $(( $(date +%s) - t0 )) s"
