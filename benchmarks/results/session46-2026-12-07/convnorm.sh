#!/usr/bin/env bash
# session 46 (carry .prebuilt .whl): conv_add_rms_norm_ against the twin's add + norm alone
# (conv_probe's new columns, graph replay), then ncu of the op at T 8 if time is left.
set -u
O=$OUT; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout 120 python3 benchmarks/conv_probe.py > $O/conv_probe.log 2>&1; echo "probe rc $?"
grep -A14 "^## conv_add_rms_norm" $O/conv_probe.log | cut -c1-130
if [ $(( $(date +%s) - t0 )) -lt 200 ]; then
  OUT=$O/n NCU_CASES=convnorm_t8 NCU_TIMEOUT=90 bash benchmarks/gpu_check.sh ncu-cases 2>&1 | head -40
fi
echo "total: $(( $(date +%s) - t0 )) s"
