#!/usr/bin/env bash
# (Ran on a tree with the change, uncommitted; the change was refuted and deleted: NOTES, session 45.)
# session 45 (carry .prebuilt .whl .old): why consumer-sums-partials lost (+16.5 us at 1 x 1k):
# profile_step's DFlash 2 kernel table (graph replay, 1 x 1k) in main (.old) and this tree.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
OUT=$O/c COMPARE_TREES="main:.old" ROUNDS=0 bash benchmarks/gpu_check.sh compare > $O/prep.log 2>&1
tail -2 $O/prep.log
for side in main:.old new:.; do
  (cd ${side#*:} && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 150 python3 \
    benchmarks/profile_step.py --graph --cases dflash2:1x1024 --rows 45 > $O/prof_${side%%:*}.log 2>&1)
  echo "${side%%:*} rc $?"
done
for s in main new; do echo "== $s"; grep -iE "splitk|conv|GPU time" $O/prof_$s.log | head -24; done
echo "total: $(( $(date +%s) - t0 )) s"
