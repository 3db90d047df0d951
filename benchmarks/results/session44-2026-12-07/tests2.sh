#!/usr/bin/env bash
# session 44: the GPU tests of hp-branch after the test fixes (carry .prebuilt .whl)
set -u
O=$OUT; export OP_CHECK=0
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter2_parity.py \
  tests/test_select_kernels.py tests/test_models_linear.py > $O/tests.log 2>&1
echo "tests rc $?: $(tail -1 $O/tests.log)"; grep -E "^FAILED|^ERROR|^E  " $O/tests.log | head -20
