#!/usr/bin/env bash
# H200 (needs_h200: 32x8k and 8x32k do not fit 80 GB): issue 18's two big policy cases on main + token-meta
# (this tree), one process a case; the second only if time is left.
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# the merged tree (main with token-meta)
OP_CHECK=0 OUT=$O/p POLICY_EACH=32x8k POLICY_TIMEOUT=${T1:-470} DFLASH_OPS_COMMIT=main-tm \
  bash benchmarks/gpu_check.sh policy
left=$(( ${BUDGET:-575} - ($(date +%s) - t0) ))
echo "left for 8x32k: $left s"
if [ $left -gt 200 ]; then
  OP_CHECK=0 OUT=$O/q POLICY_EACH=8x32k POLICY_TIMEOUT=$left DFLASH_OPS_COMMIT=main-tm \
    bash benchmarks/gpu_check.sh policy
fi
cd $O && find . -type f | sort && tar czf /tmp/c1.tgz . && find . -mindepth 1 -delete && mv /tmp/c1.tgz call1.tgz
echo "total: $(( $(date +%s) - t0 )) s"
