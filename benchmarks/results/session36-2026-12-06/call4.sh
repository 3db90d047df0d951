#!/usr/bin/env bash
# session 36, call 4: call 3 found the bulk prefetch (cp.async.bulk.prefetch.L2, through the
# TMA unit, 4x repeated by the thread layout) costs +41 us alone, +23 us with the trigger, and
# the trigger alone nothing. This tree: one prefetch.global.L2 a 128-byte line (the LSU path,
# no repeats) with the trigger (run from a checkout of branch prefetch-line, prebuilt: its
# csrc/conv.cu differs); main (.old, with this tree's bench/dflash2_step.py) / line + trigger
# (this tree), bench dflash2-step 1 x 1k, two rounds (TREES adds others, e.g. session 36's
# bulk tree .both, no longer kept); then the split-K GPU tests on this tree. Not run in
# session 36 (no machine could be started).
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -1 $O/build.log
OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="${TREES:-main:.old line:.}" ROUNDS=2 \
  ROUND_BUDGET_S=${RB:-200} \
  bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1; grep -E "^==|dflash2-step\] B|rror|trees" $O/cmp_call.log | head -40
timeout ${TT:-60} python3 -m pytest -q -m gpu tests/test_models_linear.py -k split_k > $O/pytest_splitk.log 2>&1; tail -2 $O/pytest_splitk.log
cd $O && tar czf /tmp/c4.tgz . && find . -mindepth 1 -delete && mv /tmp/c4.tgz call4.tgz
echo "total: $(( $(date +%s) - t0 )) s"
