#!/usr/bin/env bash
# issue 16 (session 39): Nsight Compute of DFlash 2's kernel projection (x[8, 5120] @ w[1280, 5120]^T)
# with each path the model could take: split-K Triton (the table's), one-tile Triton, cuBLAS,
# the skinny CUDA kernel; then the headline metrics side by side. Carry .prebuilt.
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$O/n NCU_CASES="${CASES:-proj_splitk proj_triton proj_linear skinny_proj2}" NCU_TIMEOUT=90 \
  bash benchmarks/gpu_check.sh ncu-cases > $O/ncu_call.log 2>&1
grep -E "^== ncu|Duration|DRAM Throughput|Memory Throughput|Grid Size|Waves|Achieved Occ|Registers|Theoretical Occ" \
  $O/ncu_call.log | head -60
for f in $O/n/ncu_*_details.txt; do
  echo "== $f"; grep -E "^ +(OPT|WRN) " -A3 "$f" | cut -c1-300 | head -30
done
echo "total: $(( $(date +%s) - t0 )) s"
