#!/usr/bin/env bash
# whichever card comes: an H200 runs the gates (call1.sh's H200 branch: models + issue 17's
# attention shapes), an H100 runs call3.sh (the L2 prefetch probe, then the GPU suite)
set -u
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *) bash benchmarks/results/session35-2026-12-06/call3.sh ;;
esac
