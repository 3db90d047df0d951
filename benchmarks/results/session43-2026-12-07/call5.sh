#!/usr/bin/env bash
# session 43, call 5 (carry .prebuilt, .whl, .old = main at d2c2005): bench dflash2-step at
# 8 x 1k and 64 x 8k, main (.old) and this tree (the new walk and row_topk) alternated, to see
# whether the walk's table launch (slower at R 64 in bench dflash2: 15.5 -> 29.4 us) costs the
# step anything where row_topk gains (R 64: 239.6 -> 165.0 us).
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0 DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-sel}
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
OUT=$O/cmp OLD_COMMIT=main-d2c2005 COMPARE_SUITES=dflash2-step COMPARE_D2_CASES=8x1024,64x8192 \
  ROUND_BUDGET_S=250 bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1
grep -E "^==|dflash2-step\] B=" $O/cmp.log
echo "total: $(( $(date +%s) - t0 )) s"
