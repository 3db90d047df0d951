#!/usr/bin/env bash
# session 43, call 3 (H100 or H200; carry .prebuilt, .whl, .old = main at d2c2005 with its
# .prebuilt): the selector's new walk and row_topk (Triton) on the GPU: their tests, the
# drafter2 parity tests, topk_probe, bench dflash2 --quick, then bench dflash2-step 1 x 1k of
# main (.old) and this tree alternated twice, and the step's kernel profile in this tree.
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0 DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-sel}
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the carried wheels (dflash), as gpu_check installs them
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_select_kernels.py \
  tests/test_drafter2_parity.py > $O/tests.log 2>&1
echo "tests rc $?: $(tail -1 $O/tests.log) ($(( $(date +%s) - t0 )) s)"
timeout 100 python3 benchmarks/topk_probe.py > $O/topk_probe.log 2>&1; tail -24 $O/topk_probe.log
timeout 150 dflash-ops bench dflash2 --quick --no-plot --out $O/dflash2 > $O/dflash2.log 2>&1
echo "bench dflash2 rc $? ($(( $(date +%s) - t0 )) s)"
grep -E "^\| (1|8|64) \| (ours|torch)" $O/dflash2/dflash2.md | grep -iE "walk|topk|triton|cuda" | tail -12
OUT=$O/cmp OLD_COMMIT=main-d2c2005 COMPARE_SUITES=dflash2-step ROUND_BUDGET_S=400 \
  bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1; tail -12 $O/cmp.log
echo "compare done: $(( $(date +%s) - t0 )) s"
timeout 120 python3 benchmarks/profile_step.py --graph --cases dflash2:1x1024 > $O/profile.log 2>&1
grep -E "GPU time|select|topk|walk|table|argmax|chunk" $O/profile.log | head -30
echo "total: $(( $(date +%s) - t0 )) s"
