#!/usr/bin/env bash
# For session 47's first call (kind nvidia-h100-x1, or nvidia-h200 where one is wanted; carry
# [".prebuilt", ".whl", ".cnt"], ~5 MB). .cnt holds branch convnorm-threads
# (`git archive convnorm-threads | tar -x -C .cnt`, without benchmarks/results and
# dflash_ops/data) with its own .prebuilt (csrc/conv.cu changed: `cd .cnt && bash
# benchmarks/prebuild.sh`). NOTES, session 46: the prediction.
# 1. its GPU tests in its tree (conv kernels, DFlash 2 parity);
# 2. conv_probe main vs cnt (T 8 / 64 fixed cost; T >= 4096: issue 16's 70% gate) and bench
#    dflash2-step 1 x 1k, 8 x 1k, two rounds of the trees.
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader
export OP_CHECK=0
OUT=$O/c COMPARE_SUITES="conv dflash2-step" COMPARE_TREES="main:. cnt:.cnt" ROUNDS=0 \
  bash benchmarks/gpu_check.sh compare > $O/prep.log 2>&1; grep -E "install|ready" $O/prep.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
(cd .cnt && PYTHONPATH="$PWD:$PYTHONPATH" python3 -c \
  "import dflash_ops, dflash_ops._C; print('cnt tree imports', dflash_ops.__file__)")
(cd .cnt && PYTHONPATH="$PWD:$PYTHONPATH" timeout 150 python3 -m pytest -q -m gpu \
  tests/test_conv_kernels.py tests/test_drafter2_parity.py > $O/pytest_cnt.log 2>&1)
tail -2 $O/pytest_cnt.log; echo "cnt tests: $(( $(date +%s) - t0 )) s"
OUT=$O/c COMPARE_SUITES="conv dflash2-step" COMPARE_TREES="main:. cnt:.cnt" ROUNDS=2 \
  COMPARE_D2_CASES=1x1024,8x1024 COMPARE_D2_ROUNDS=1 ROUND_BUDGET_S=330 \
  bash benchmarks/gpu_check.sh compare > $O/cmp.log 2>&1
grep -E "^==|^## conv_add|^\| (8|64|4096) \| ours \(cuda\)|dflash2-step\] B=|rror" $O/cmp.log | cut -c1-140
echo "total: $(( $(date +%s) - t0 )) s"
