#!/usr/bin/env bash
# session 39's first call (kind nvidia-h200, either card; carry .prebuilt, .whl): an H200 runs
# session 35's call1.sh (issue 19's table, issue 17's shapes); an H100 the projection's ncu.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
case "$gpu" in
  *H200*) echo "$gpu"; OP_CHECK=0 bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *) bash benchmarks/results/session39-2026-12-06/ncu_proj.sh ;;
esac
