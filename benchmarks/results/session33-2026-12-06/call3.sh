#!/usr/bin/env bash
# argmax-vec (.argmax, its own prebuild): issue19's GPU tests + argmax_probe; then on this tree
# (main's kernels) compute-sanitizer over the argmax and glu_proj tests
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
(cd .argmax && OUT=$O/a bash benchmarks/gpu_check.sh issue19)
echo "argmax-vec: $(( $(date +%s) - t0 )) s"
OUT=$O/s SAN_FILES="tests/test_select_kernels.py tests/test_glu_proj.py" SAN_K="argmax or glu_proj" SAN_TIMEOUT=200 \
  bash benchmarks/gpu_check.sh sanitize
cd $O && tar czf /tmp/c3.tgz . && find . -mindepth 1 -delete && mv /tmp/c3.tgz call3.tgz
echo "total: $(( $(date +%s) - t0 )) s"
