#!/usr/bin/env bash
# session 43's branch check (H100 or H200; carry .prebuilt, .whl, .old): .old is a worktree of
# branch proj-branch (2fe208b: the DFlash 2 projection's finish half on a graph branch) with a
# copy of main's .prebuilt (csrc unchanged):
#   git worktree add .old proj-branch && cp -r .prebuilt .old/
# Runs fork_probe first (does a branch pay at all?), then bench dflash2-step at 1 x 1k and
# 8 x 1k, the branch ("old" in the compare's names; the compare unpacks its _C) and main
# ("new") alternated twice (its graphs checked against their eager steps first), then the
# branch's GPU tests in its tree (DFlash 2 parity on CUDA, the sampled loop with a DFlash 2
# drafter).
set -u
O=$OUT; t0=$(date +%s); export OP_CHECK=0 DFLASH_OPS_COMMIT=${DFLASH_OPS_COMMIT:-main}
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the carried wheels (dflash)
timeout 120 python3 benchmarks/results/session43-2026-12-07/fork_probe.py > $O/fork_probe.log 2>&1; tail -8 $O/fork_probe.log
OUT=$O/cmp OLD_COMMIT=proj-branch COMPARE_SUITES=dflash2-step COMPARE_D2_CASES=1x1024,8x1024 \
  ROUND_BUDGET_S=420 bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1
grep -E "^==|dflash2-step\] B=|rror|WRONG" $O/cmp.log | head -30
(cd .old && PYTHONPATH=$PWD:$PYTHONPATH timeout 240 python3 -m pytest -q -m gpu \
   -p no:cacheprovider tests/test_drafter2_parity.py \
   tests/test_models_linear.py::test_half_linear_under_graph_gpu \
   "tests/test_speculator.py::test_sampling_matches_target_distribution" \
   > $O/branch_tests.log 2>&1; echo "branch tests rc $?: $(tail -1 $O/branch_tests.log)")
echo "total: $(( $(date +%s) - t0 )) s"
