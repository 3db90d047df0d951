#!/usr/bin/env bash
# session 36, first call (kind nvidia-h200 named, no needs_h200): an H200 runs session 35's
# call1.sh H200 branch (gpu_check models: issue 19's table; attn: issue 17's seven shapes);
# an H100 runs session 35's next-h100.sh (the twelve GPU test files the last suite run cut,
# then memcheck + racecheck over the early-trigger Triton kernels)
set -u
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *) bash benchmarks/results/session35-2026-12-06/next-h100.sh ;;
esac
