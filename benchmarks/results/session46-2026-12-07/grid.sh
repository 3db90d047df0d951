#!/usr/bin/env bash
# session 46 (carry .prebuilt .whl): issue 16's whole dflash2-step grid, rounds alternating
# the build and timing order (ROUNDS, default 2), whichever card comes.
set -u
O=$OUT; t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
PYTHONUNBUFFERED=1 timeout ${T1:-420} python3 -m dflash_ops bench dflash2-step ${CASES:+--cases $CASES} \
  --rounds ${ROUNDS:-2} --no-plot --out $O/results > $O/grid.log 2>&1; echo "rc $?"
grep -A12 "^summary" $O/grid.log | cut -c1-160
grep "round [0-9]" $O/grid.log | cut -c1-160
echo "total: $(( $(date +%s) - t0 )) s"
