#!/usr/bin/env bash
# (for the next session, plan items 2 and 3) the step profiles on main, graph replay, then the
# never_probe (never vs plain: tokens between host reads 4 / 8 / 16, GPU gaps), then the
# racecheck over the attention tests with the PDL triggers while time is left
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/p BENCH_ARGS="--graph --cases decode:1x1024,verify:1x1024,drafter:1x1024,verify:32x8192" \
  bash benchmarks/gpu_check.sh profile > $O/profile_call.log 2>&1; tail -5 $O/profile_call.log
echo "profile: $(( $(date +%s) - t0 )) s"
timeout 240 python3 benchmarks/never_probe.py --cases 32x1024,8x8192 --steps 4,8,16 > $O/never_probe.log 2>&1
grep -E "tok/s|gaps" $O/never_probe.log; echo "never_probe: $(( $(date +%s) - t0 )) s"
left=$(( ${BUDGET:-570} - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then
  OUT=$O/s SAN_FILES=tests/test_block_attention_gpu.py SAN_TOOLS=racecheck SAN_TIMEOUT=$left \
    bash benchmarks/gpu_check.sh sanitize
fi
cd $O && tar czf /tmp/np.tgz . && find . -mindepth 1 -delete && mv /tmp/np.tgz next-profile.tgz
echo "total: $(( $(date +%s) - t0 )) s"
