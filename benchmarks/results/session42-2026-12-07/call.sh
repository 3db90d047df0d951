#!/usr/bin/env bash
# session 42's call for the next session (kind nvidia-h200 without needs_h200: either card;
# carry .prebuilt, .whl): first the GPU checks of this session's bench changes (~2 min: the
# e2e suite's tiny GPU test, whose graphs are now checked against their eager steps before
# timing; bench dflash2 --quick, whose columns are timed only where their check passes), then
# session 40's call.sh with what is left of BUDGET (an H200: issue 18's grid, $CASES; an H100:
# proj_probe again, ~30 s). Everything under $OUT ends in call.tgz.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
OUT=$O/b42 bash benchmarks/gpu_check.sh build > $O/build42.log 2>&1; grep install $O/build42.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_bench_e2e.py \
  -k tiny_on_gpu > $O/tests42.log 2>&1
echo "e2e tiny test rc $?: $(tail -1 $O/tests42.log)"
timeout 120 dflash-ops bench dflash2 --quick --out $O/dflash2 > $O/dflash2.log 2>&1
echo "bench dflash2 rc $?: $(grep -c 'WRONG' $O/dflash2.log) WRONG rows"
OUT=$O BUDGET=$(left) bash benchmarks/results/session40-2026-12-07/call.sh
