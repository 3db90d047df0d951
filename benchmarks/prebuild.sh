#!/usr/bin/env bash
# Builds dflash_ops._C for the GPU machine on a CPU machine, so a fresh device machine skips the
# ~100-160 s build (gpu_check.sh uses .prebuilt/ when it is carried and matches the tree).
# The device's image: Python 3.12, torch 2.11.0+cu130, nvcc 13.0. This script needs python3.12
# (PYENV_VERSION=3.12.1 here), nvcc and network access to PyPI for the torch wheel (~530 MB, kept
# in PREBUILD_CACHE). The wheel's torch is not imported (its CUDA libraries are absent on a CPU
# machine): the compile and link lines are the ones torch.utils.cpp_extension writes for setup.py
# (COMMON_NVCC_FLAGS, -DTORCH_API_INCLUDE_EXTENSION_H, the cxx11 ABI, setup.py's own flags).
# Output: .prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz and .prebuilt/stamp (the sources' hash, the
# torch version): gpu_check.sh takes the library only where both match the device copy.
# Usage: bash benchmarks/prebuild.sh     (JOBS parallel compiles; 95 s on 2 cores)
# PREBUILD_CHECK=1 also loads the library into that torch on this machine (a Python 3.12 venv in
# PREBUILD_CACHE with the wheel and its CUDA packages, ~3 GB once; no GPU needed) and checks that
# every op of torch.ops.dflash has its CUDA kernel registered.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
CACHE=${PREBUILD_CACHE:-/tmp/dflash-prebuild}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$CACHE" .prebuilt
py=${PYTHON312:-}
if [ -z "$py" ]; then
  if PYENV_VERSION=3.12.1 python3.12 -V >/dev/null 2>&1; then py="env PYENV_VERSION=3.12.1 python3.12"
  else py=python3.12; fi
fi
pyinc=$($py -c "import sysconfig; print(sysconfig.get_paths()['include'])")
[ -f "$pyinc/Python.h" ] || { echo "prebuild: no Python.h under $pyinc"; exit 2; }
site="$CACHE/site"
if [ ! -f "$site/torch/version.py" ]; then
  whl=$(ls "$CACHE"/torch-$TORCH_VERSION-cp312-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    $py -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
      "torch==$TORCH_VERSION" -d "$CACHE"
    whl=$(ls "$CACHE"/torch-$TORCH_VERSION-cp312-*.whl | head -1)
  fi
  rm -rf "$site" && mkdir -p "$site"
  # only the headers, the link libraries and version.py are needed
  (cd "$site" && unzip -q "$whl" 'torch/include/*' 'torch/lib/libc10*.so' 'torch/lib/libtorch*.so' \
    'torch/version.py')
fi
tv=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$site/torch/version.py")
T="$site/torch"
inc=(-Icsrc -I"$T/include" -I"$T/include/torch/csrc/api/include" -I"$pyinc")
defs=(-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -DDFLASH_OPS_PYTHON_MODULE=1
      -D_GLIBCXX_USE_CXX11_ABI=1)
nvflags=(-O3 -std=c++20 --expt-relaxed-constexpr -lineinfo -gencode=arch=compute_90a,code=sm_90a
         -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
         -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
         --compiler-options=-fPIC)
obj="$CACHE/obj"
rm -rf "$obj" && mkdir -p "$obj"
t0=$(date +%s)
compile() {  # one source -> one object
  local src=$1 o="$obj/$(basename "$1").o"
  case "$src" in
    *.cu) nvcc "${nvflags[@]}" "${defs[@]}" "${inc[@]}" -c "$src" -o "$o" ;;
    *) g++ -O3 -std=c++20 -fPIC "${defs[@]}" "${inc[@]}" -c "$src" -o "$o" ;;
  esac && echo "  $src: $(( $(date +%s) - t0 )) s"
}
export -f compile
export obj t0
export nvflags_s="${nvflags[*]}" defs_s="${defs[*]}" inc_s="${inc[*]}"
# bash arrays do not cross xargs: rebuild them from the exported strings in each child
ls csrc/*.cu csrc/*.cpp | xargs -P "$JOBS" -I{} bash -c \
  'read -ra nvflags <<<"$nvflags_s"; read -ra defs <<<"$defs_s"; read -ra inc <<<"$inc_s"; compile {}'
cuda_lib=$(dirname "$(dirname "$(command -v nvcc)")")/lib64
[ -d "$cuda_lib" ] || cuda_lib=/usr/local/cuda/lib64
out="$CACHE/_C.cpython-312-x86_64-linux-gnu.so"
rm -f .prebuilt/_C.*
g++ -shared "$obj"/*.o -L"$T/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda \
  -ltorch_cuda -L"$cuda_lib" -lcudart -Wl,--exclude-libs,ALL -o "$out"
{ echo "sources $(bash benchmarks/prebuild_hash.sh)"; echo "torch $tv"; } >.prebuilt/stamp
if [ "${PREBUILD_CHECK:-0}" = 1 ]; then
  venv="$CACHE/venv"
  if [ ! -x "$venv/bin/python" ]; then
    $py -m venv "$venv"
    req=$(unzip -p "$(ls "$CACHE"/torch-$TORCH_VERSION-cp312-*.whl | head -1)" \
      "torch-$TORCH_VERSION.dist-info/METADATA" | sed -n 's/^Requires-Dist: \([^;]*\); platform_system == "Linux"$/\1/p')
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q "$(ls "$CACHE"/torch-$TORCH_VERSION-cp312-*.whl | head -1)" \
      numpy safetensors $(echo "$req" | tr '\n' ' ')
  fi
  tree=$(mktemp -d)
  cp -r dflash_ops pyproject.toml "$tree"/ && cp "$out" "$tree/dflash_ops/"
  grep -rho 'm.impl("[a-z_0-9]*"' csrc | sed 's/m.impl("//; s/"//' | sort -u >"$tree/impls"
  (cd "$tree" && "$venv/bin/python" - <<'PY')
import torch
import dflash_ops  # noqa: F401  (defines the schemas)
from dflash_ops import _ext
st = _ext.load()
assert st["how"] == "built", st
ops = open("impls").read().split()  # the ops csrc/ registers (m.impl)
missing = [o for o in ops for ns in ("dflash", "dflash_cuda")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{o}", "CUDA")]
assert ops and not missing, f"no CUDA kernel for {missing}"
print(f"prebuild check: torch {torch.__version__} loads it; the {len(ops)} ops csrc/ "
      "registers have their CUDA kernels")
PY
  rm -rf "$tree"
fi
# carried xz-compressed (19 MB -> ~2 MB: the carry limit is 64 MiB with the vLLM bundle's 33)
$py -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.compress(open(sys.argv[1], 'rb').read()))" \
  "$out" ".prebuilt/$(basename "$out").xz"
echo "prebuild: .prebuilt/$(basename "$out").xz ($(du -h ".prebuilt/$(basename "$out").xz" | cut -f1), $(( $(date +%s) - t0 )) s); stamp:"
cat .prebuilt/stamp
