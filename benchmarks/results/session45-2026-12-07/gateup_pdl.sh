#!/usr/bin/env bash
# session 45 (carry .prebuilt .whl): the DFlash 2 step's gate_up GEMM (cuBLAS nvjet 384x8, five
# launches, the same weight tensor as the twin's) takes 8-14 us a step more than its twin's in
# every H100 profile (sessions 35, 43, 44, 45). Its predecessor differs (the twin's fused add +
# RMSNorm, Triton, triggers its dependents early; DFlash 2's grouped_dyn_conv, CUDA, does not),
# and the twin always ran second. profile_step at 1 x 1k: PDL on; PDL on with the twin first;
# PDL off. The trigger story predicts the gap closes with PDL off only; the order story, with
# the twin first only.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for run in "1 --" "1 --twin-first" "0 --"; do
  set -- $run; pdl=$1; flag=$2; [ "$flag" = -- ] && flag=
  log=$O/prof_pdl${pdl}${flag:+_twin_first}.log
  DFLASH_OPS_PDL=$pdl timeout 70 python3 benchmarks/profile_step.py --graph \
    --cases dflash2:1x1024 --rows 45 $flag > $log 2>&1; echo "pdl $pdl $flag rc $?"
  grep -E "^== |384x8|conv_add" $log | cut -c1-100
  [ $(( $(date +%s) - t0 )) -gt 200 ] && break
done
echo "total: $(( $(date +%s) - t0 )) s"
