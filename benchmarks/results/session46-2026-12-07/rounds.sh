#!/usr/bin/env bash
# session 46 (carry .prebuilt .whl): bench dflash2-step with the variants timed in alternating
# rounds (both built first). Session 45's profiles had the model run first 15-20 us a step
# slower either way round; the bench always ran DFlash 2 first.
set -u
O=$OUT; t0=$(date +%s)
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout ${T1:-240} python3 -m dflash_ops bench dflash2-step --cases ${CASES:-1x1024,8x1024} \
  --rounds ${ROUNDS:-4} --no-plot --out $O/results > $O/rounds.log 2>&1; echo "rc $?"
grep -E "^\[dflash2-step\]|^summary" -A0 $O/rounds.log | cut -c1-150
grep -B2 -A8 "^summary" $O/rounds.log | cut -c1-160
grep "round [0-9]" $O/rounds.log
echo "total: $(( $(date +%s) - t0 )) s"
