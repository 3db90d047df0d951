#!/usr/bin/env bash
# racecheck-fix (the Hopper attention's stage mask read by lane 0 alone, this tree) on an H100:
# its attention GPU tests, racecheck over test_block_attention_gpu.py (session 35 call 1: 2 WAR
# reports on the mask at attention_hopper.cuh:347 / :267), attn_probe main (.old, a49889d) vs
# this tree alternating, then the DFlash 2 step profile (dflash2:1x1024 and its twin), synccheck
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/t DFLASH_OPS_COMMIT=racefix TEST_TIMEOUT=200 \
  TEST_FILES="tests/test_block_attention_gpu.py tests/test_attention_split_keys.py" \
  bash benchmarks/gpu_check.sh tests > $O/tests_call.log 2>&1; tail -6 $O/tests_call.log
echo "tests: $(( $(date +%s) - t0 )) s"
OUT=$O/s SAN_FILES=tests/test_block_attention_gpu.py SAN_TOOLS=racecheck SAN_TIMEOUT=200 \
  bash benchmarks/gpu_check.sh sanitize > $O/race_call.log 2>&1; grep -E "SUMMARY|Race|passed|failed" $O/race_call.log | head
echo "racecheck: $(( $(date +%s) - t0 )) s"
OUT=$O/c COMPARE_SUITES=attn COMPARE_TREES="main:.old racefix:." ROUNDS=2 ROUND_BUDGET_S=400 \
  bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1; grep -E "^==|^\| (1|8|32) x" $O/cmp_call.log | head -40
echo "compare: $(( $(date +%s) - t0 )) s"
timeout 150 python3 benchmarks/profile_step.py --graph --rows 24 --cases dflash2:1x1024 > $O/profile_d2.log 2>&1
grep -E "^==" $O/profile_d2.log; echo "profile dflash2: $(( $(date +%s) - t0 )) s"
left=$(( ${BUDGET:-570} - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then
  OUT=$O/y SAN_FILES=tests/test_block_attention_gpu.py SAN_TOOLS=synccheck SAN_TIMEOUT=$left \
    bash benchmarks/gpu_check.sh sanitize > $O/sync_call.log 2>&1; grep -E "SUMMARY|rror|passed|failed" $O/sync_call.log | head
fi
cd $O && tar czf /tmp/c2.tgz . && find . -mindepth 1 -delete && mv /tmp/c2.tgz call2.tgz
echo "total: $(( $(date +%s) - t0 )) s"
