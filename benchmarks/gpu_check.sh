#!/usr/bin/env bash
# The one script run on the H200 (device tool): install (builds dflash_ops._C), info, check, the
# GPU tests, the benchmarks. Logs and result tables go under $OUT (at most 8 files come back:
# more are packed into $OUT/all.tgz at the end).
# Usage: bash benchmarks/gpu_check.sh [build|probe|tests|bench|ctx|attn|sweep|linear|drafter|e2e|layout|models|attnprobe|profile|cmake|all]
#   (all: tests + bench + ctx; build: install and info only)
#   probe: every bad-input case through the C++ checks, one subprocess each (segfault hunt)
#   attn:  the attention suite (BENCH_ARGS: --quick, --cases, --tables, --no-flex)
#   attnprobe: benchmarks/attn_probe.py under stages 2/3 x carveout default/100 (BENCH_ARGS)
#   models: bench_drafter (DRAFTER_ARGS, default --no-ref), bench_e2e (E2E_ARGS, default --quick)
#          and profile_step (PROFILE_ARGS) in one call
#   layout: the paged attention table (with the head-major cache column), then the drafter and
#          e2e quick suites with DFLASH_OPS_KV_LAYOUT=head (into $OUT/results-head)
# Set DFLASH_OPS_COMMIT (the device copy has no .git) so result files name the commit.
set -uo pipefail
OUT=${OUT:-/tmp/dflash-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (liger-kernel for the baselines)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if ! python3 -c "import dflash_ops._C" 2>/dev/null; then
  python3 -m pip install -e . --no-build-isolation --no-deps >"$OUT/install.log" 2>&1 \
    || { tail -40 "$OUT/install.log"; exit 1; }
fi
echo "install: $(( $(date +%s) - t0 )) s"
{ python3 -m dflash_ops info; python3 -m dflash_ops check; } 2>&1 | tee "$OUT/info_check.log"
rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 460 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 tests 2>&1 \
    | tee "$OUT/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
if [ "$what" = probe ]; then
  timeout 200 python3 tests/probe_bad_inputs_gpu.py 2>&1 | tee "$OUT/probe.log" | grep -v "names-arg"
fi
if [ "$what" = attn ]; then
  timeout 500 python3 benchmarks/bench_attention.py ${BENCH_ARGS:-} --out "$OUT/results" 2>&1 \
    | tee "$OUT/bench_attn.log"
fi
if [ "$what" = sweep ]; then
  { python3 benchmarks/sweep_norm.py
    for nv in 1 4; do DFLASH_OPS_NORM_LANE_VECS=$nv python3 benchmarks/sweep_norm.py --cuda-only; done
  } 2>&1 | tee "$OUT/sweep.log"
  echo "sweep: $(( $(date +%s) - t0 )) s"
fi
if [ "$what" = linear ]; then  # the models.linear table: cuBLAS vs the Triton GEMM per shape
  timeout 400 python3 benchmarks/sweep_linear.py ${BENCH_ARGS:-} --write-table \
    --out "$OUT/sweep_linear.json" 2>&1 | tee "$OUT/sweep_linear.log"
  cp dflash_ops/models/linear_table.json "$OUT/" 2>/dev/null
fi
if [ "$what" = drafter ]; then
  timeout 500 python3 benchmarks/bench_drafter.py ${BENCH_ARGS:-} --out "$OUT/results" 2>&1 \
    | tee "$OUT/bench_drafter.log"
fi
if [ "$what" = e2e ]; then
  timeout 500 python3 benchmarks/bench_e2e.py ${BENCH_ARGS:-} --out "$OUT/results" 2>&1 \
    | tee "$OUT/bench_e2e.log"
fi
if [ "$what" = layout ]; then  # the head-major cache experiment (benchmarks/NOTES.md)
  timeout 200 python3 benchmarks/bench_attention.py --tables paged --no-flex \
    --out "$OUT/results" 2>&1 | tee "$OUT/bench_attn_layout.log" | grep -E "ours cuda"
  for suite in drafter e2e; do
    DFLASH_OPS_KV_LAYOUT=head timeout 150 python3 "benchmarks/bench_$suite.py" --quick \
      --out "$OUT/results-head" > "$OUT/bench_${suite}_head.log" 2>&1
    grep -A8 "^summary" "$OUT/bench_${suite}_head.log"
  done
fi
if [ "$what" = models ]; then  # drafter + e2e suites and the step profiles in one call (~5 min)
  timeout 240 python3 benchmarks/bench_drafter.py ${DRAFTER_ARGS:---no-ref} --out "$OUT/results" \
    > "$OUT/bench_drafter.log" 2>&1; grep -A14 "^summary" "$OUT/bench_drafter.log"
  timeout 150 python3 benchmarks/bench_e2e.py ${E2E_ARGS:---quick} --out "$OUT/results" \
    > "$OUT/bench_e2e.log" 2>&1; grep -A8 "^summary" "$OUT/bench_e2e.log"
  timeout 120 python3 benchmarks/profile_step.py ${PROFILE_ARGS:---graph --cases drafter:64x4096,drafter:1x1024,decode:1x1024} \
    > "$OUT/profile.log" 2>&1; grep -A12 "graph" "$OUT/profile.log" | head -60
fi
if [ "$what" = attnprobe ]; then  # attention launch settings: stages x carveout (NOTES.md)
  for st in 2 3; do for cv in "" 100; do
    DFLASH_OPS_ATTN_STAGES=$st DFLASH_OPS_ATTN_CARVEOUT=$cv DFLASH_OPS_ATTN_DEBUG=1 \
      timeout 60 python3 benchmarks/attn_probe.py ${BENCH_ARGS:-} 2>&1 | grep -v "^floors"
  done; done | tee "$OUT/attn_probe.log"
fi
if [ "$what" = profile ]; then  # kernel tables of the drafter / verify / decode steps
  timeout 400 python3 benchmarks/profile_step.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/profile.log"
fi
if [ "$what" = cmake ]; then  # the C++ library build of README's CMake section
  { cmake -S . -B /tmp/dflash-cmake \
      -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
    && cmake --build /tmp/dflash-cmake -j 8; echo "cmake rc=$?"; } >"$OUT/cmake.log" 2>&1
  tail -3 "$OUT/cmake.log"
fi
if [ "$what" = all ] || [ "$what" = ctx ]; then
  timeout 300 python3 benchmarks/bench_context_kv.py ${BENCH_ARGS:-} --out "$OUT/results" 2>&1 \
    | tee "$OUT/bench_ctx.log"
  echo "bench ctx: $(( $(date +%s) - t0 )) s"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  python3 benchmarks/bench_norm.py --out "$OUT/results" 2>&1 | tee "$OUT/bench_norm.log"
  echo "bench: $(( $(date +%s) - t0 )) s"
fi
# The device tool brings back at most 8 files: pack more into one archive.
n_files=$(find "$OUT" -type f | wc -l)
if [ "$n_files" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/dflash-gpu-pack.tgz . && find . -mindepth 1 -delete \
    && mv /tmp/dflash-gpu-pack.tgz all.tgz) && echo "packed $n_files files into \$OUT/all.tgz"
fi
exit $rc
