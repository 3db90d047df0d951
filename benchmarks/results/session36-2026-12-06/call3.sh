#!/usr/bin/env bash
# session 36, call 3: call 2 measured the prefetch tree 22-23 us slower than main on the DFlash 2
# step at 1 x 1k (H100). Which half: main (.old) / both (this tree) / trigger only (.trig: this
# tree with prefetch_bytes returning 0) / prefetch only (.pf: main with this tree's
# triton/context.py), bench dflash2-step 1 x 1k, two rounds
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -2 $O/build.log
OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:.old both:. trig:.trig pf:.pf" ROUNDS=2 \
  ROUND_BUDGET_S=${RB:-200} \
  bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1; grep -E "^==|dflash2-step\] B|rror|trees" $O/cmp_call.log | head -40
cd $O && tar czf /tmp/c3.tgz . && find . -mindepth 1 -delete && mv /tmp/c3.tgz call3.tgz
echo "total: $(( $(date +%s) - t0 )) s"
