#!/usr/bin/env bash
# for session 40's first call (kind nvidia-h200 without needs_h200; carry .prebuilt, .whl):
# - an H200: session 35's call1.sh (issue 19's table, issue 17's seven attention shapes);
# - an H100: issue 16's projection (NOTES, session 39: proj_probe's prediction): proj_probe at
#   M 8 writes the fastest variant into a copy of the tree's linear table (.var) where it beats
#   the table's config by >= 0.5 us a launch; then bench dflash2-step 1 x 1k on main vs .var,
#   two rounds (the whole step: the prediction is -10 to -20 us if the probe gains 1-2 us a
#   launch); then proj_probe at M 1 and 16 for the record.
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -3 $O/build.log
    mkdir -p .var && tar --exclude=./benchmarks/results --exclude=./.var --exclude=./.whl \
      --exclude=./.git -cf - . | tar -xf - -C .var
    python3 benchmarks/proj_probe.py --write-table .var/dflash_ops/models/linear_table.json \
      > $O/proj_probe_m8.log 2>&1; grep -E "^\||floor|write-table|rror" $O/proj_probe_m8.log
    echo "proj_probe: $(( $(date +%s) - t0 )) s"
    if ! cmp -s dflash_ops/models/linear_table.json .var/dflash_ops/models/linear_table.json; then
      OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:. var:.var" ROUNDS=2 \
        bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
      grep -E "^==|dflash2-step\] B|rror" $O/cmp_call.log | head -16
      echo "compare: $(( $(date +%s) - t0 )) s"
    fi
    for m in 1 16; do
      timeout 90 python3 benchmarks/proj_probe.py --m $m --nw 8 --reps 30 > $O/proj_probe_m$m.log 2>&1
      grep -E "^\|" $O/proj_probe_m$m.log
    done ;;
esac
cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz
echo "total: $(( $(date +%s) - t0 )) s"
