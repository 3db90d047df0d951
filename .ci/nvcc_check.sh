#!/usr/bin/env bash
# Compiles every csrc/*.cu (nvcc, sm_90a) and csrc/*.cpp (g++) to object files against the
# installed torch's headers, then links them into one shared library as setup.py links
# dflash_ops._C; no GPU and no CUDA build of torch needed. Exits non-zero on the first failure
# or compiler warning (ptxas spills included); prints one line per file with its compile time.
#   PYTHON=python3 NVCC=/usr/local/cuda/bin/nvcc CXX=g++ .ci/nvcc_check.sh
#   PTXAS_VERBOSE=1 adds ptxas's per-kernel register / spill report.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
NVCC="${NVCC:-/usr/local/cuda/bin/nvcc}"
CXX="${CXX:-g++}"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# Torch's include dirs; Python's for registration.cpp's PyInit__C (setup.py builds).
mapfile -t TORCH_INC < <("$PYTHON" -c 'import torch.utils.cpp_extension as c; print("\n".join(c.include_paths()))')
PY_INC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"

# A CPU wheel lacks the header CMake generates for a CUDA build of c10 (c10/cuda/CUDAMacros.h
# includes it); it only defines C10_CUDA_BUILD_SHARED_LIBS.
mkdir -p "$TMP/shim/c10/cuda/impl"
echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$TMP/shim/c10/cuda/impl/cuda_cmake_macros.h"

INC=(-I"$ROOT/csrc")
for d in "${TORCH_INC[@]}"; do INC+=(-I"$d"); done
INC+=(-I"$TMP/shim")

# The flags torch.utils.cpp_extension adds for nvcc, plus ours (setup.py).
NVCC_FLAGS=(-c -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
  --expt-relaxed-constexpr -lineinfo -Xcompiler -fPIC -Xptxas --warn-on-spills)
if [[ "${PTXAS_VERBOSE:-0}" == "1" ]]; then NVCC_FLAGS+=(-Xptxas -v); fi
CXX_FLAGS=(-c -O3 -std=c++20 -fPIC)

shopt -s nullglob
cu=("$ROOT"/csrc/*.cu)
cpp=("$ROOT"/csrc/*.cpp)
if (( ${#cu[@]} + ${#cpp[@]} == 0 )); then echo "no sources under $ROOT/csrc" >&2; exit 1; fi
"$NVCC" --version | tail -1

compile() {  # compile <label> <file> <command...>
  local label="$1" f="$2"; shift 2
  local t0=$SECONDS
  if ! "$@" > "$TMP/log" 2>&1; then
    cat "$TMP/log" >&2; echo "FAIL $label ${f#"$ROOT"/}" >&2; exit 1
  fi
  cat "$TMP/log"
  if grep -qi "warning" "$TMP/log"; then echo "FAIL $label ${f#"$ROOT"/}: warnings" >&2; exit 1; fi
  echo "ok   $label ${f#"$ROOT"/} ($((SECONDS - t0)) s)"
}
for f in "${cu[@]}"; do
  compile nvcc "$f" "$NVCC" "${NVCC_FLAGS[@]}" "${INC[@]}" "$f" -o "$TMP/$(basename "$f").o"
done
# .cpp files twice: as the JIT build / CMake library sees them, and as setup.py's Python module.
for f in "${cpp[@]}"; do
  compile g++ "$f" "$CXX" "${CXX_FLAGS[@]}" "${INC[@]}" "$f" -o "$TMP/$(basename "$f").o"
  compile "g++ -DDFLASH_OPS_PYTHON_MODULE" "$f" "$CXX" "${CXX_FLAGS[@]}" -DDFLASH_OPS_PYTHON_MODULE=1 \
    -I"$PY_INC" "${INC[@]}" "$f" -o "$TMP/$(basename "$f").py.o"
done

# The link: every .cu object and the .cpp objects of the Python module into one library (the
# CUDA runtime and torch stay unresolved: a CPU wheel has no libtorch_cuda). It fails on a symbol
# defined twice; a dflash_ops function declared but defined nowhere, and the module init, are
# checked by name.
lib="$TMP/_C.so"
objs=("$TMP"/*.cu.o "$TMP"/*.cpp.py.o)
if ! "$CXX" -shared -o "$lib" "${objs[@]}" -Wl,--exclude-libs,ALL; then
  echo "FAIL link" >&2; exit 1
fi
undefined="$(nm -uC "$lib" | grep "dflash_ops::" || true)"
if [[ -n "$undefined" ]]; then echo "FAIL link: undefined $undefined" >&2; exit 1; fi
exported="$(nm -D --defined-only "$lib")"  # whole, then searched: grep -q on a pipe can
if ! grep -q " PyInit__C$" <<<"$exported"; then  # close it early and fail nm under pipefail
  echo "FAIL link: no PyInit__C in the module" >&2; exit 1
fi
echo "ok   link ${#objs[@]} objects into one library"
