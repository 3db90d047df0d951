#!/usr/bin/env bash
# H100: the 8 x 32k policy case on main (attn-trig merged) with the pre-check's headroom at 4 GiB
# (was 16: skipped with 65 GB free for 50 GB of caches); each case prints its peak memory
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OP_CHECK=0 OUT=$O/q POLICY_EACH=8x32k POLICY_TIMEOUT=${T1:-470} DFLASH_OPS_COMMIT=main-34 \
  bash benchmarks/gpu_check.sh policy
grep -E "peak memory|out of memory|skipped" $O/q/bench_policy_8x32k.log
cd $O && find . -type f | sort && tar czf /tmp/c5.tgz . && find . -mindepth 1 -delete && mv /tmp/c5.tgz call5.tgz
echo "total: $(( $(date +%s) - t0 )) s"
