#!/usr/bin/env bash
# the whole GPU suite (pytest -m gpu, every test file that has GPU tests) on main with the racecheck
# fix: its last full run predates PDL (session 23's note); six shards, each cut at TEST_TIMEOUT
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/t DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-main} SHARDS=${SHARDS:-6} TEST_TIMEOUT=${TT:-470} \
  bash benchmarks/gpu_check.sh tests > $O/tests_call.log 2>&1; grep -E "^shard|^FAILED|^ERROR|^tests:" $O/tests_call.log | head -40
grep -E "passed|failed" $O/t/pytest_gpu.log | tail -8
cd $O && tar czf /tmp/c3.tgz . && find . -mindepth 1 -delete && mv /tmp/c3.tgz call3.tgz
echo "total: $(( $(date +%s) - t0 )) s"
