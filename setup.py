"""Builds the CUDA extension dflash_ops._C when a CUDA toolkit and a CUDA build of torch exist.

Without them (CPU-only torch, no nvcc) the package installs with the Triton and torch backends
only. TORCH_CUDA_ARCH_LIST is honoured; by default the extension targets sm_90a (Hopper).
Set DFLASH_OPS_NO_CUDA=1 to skip the extension.
"""
import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}


def _want_cuda() -> bool:
    if os.environ.get("DFLASH_OPS_NO_CUDA", "0") == "1":
        return False
    # An isolated build env has torch (pyproject.toml's build requirements), but a fresh one from
    # the index, maybe not the torch the extension will run with: hence --no-build-isolation.
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # torch not importable (--no-build-isolation without torch): pure Python
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


# Keep a static libstdc++ to ourselves. A compiler whose libstdc++ is linked statically into _C
# (e.g. a GCC installed apart from the system's) exports its symbols from _C; the process's
# libstdc++.so.6 (loaded by torch, another GCC version) then interposes some of them: _C's copy
# of the locale code takes num_put<char>::id from libstdc++.so.6, indexes its own facet table
# with it, and every ostream << number (each TORCH_CHECK message with a number) segfaults.
# --exclude-libs,ALL makes the archive's symbols local to _C, so its copy binds only to itself; a
# build against the shared libstdc++ has no archive and is unchanged.
LINK_ARGS = ["-Wl,--exclude-libs,ALL"]

if _want_cuda():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.cpp"))
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # sm_90a: Hopper with wgmma/setmaxnreg. Other GPUs: set TORCH_CUDA_ARCH_LIST.
        nvcc.append("-gencode=arch=compute_90a,code=sm_90a")
    ext_modules.append(CUDAExtension(
        name="dflash_ops._C", sources=sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": nvcc},
        define_macros=[("DFLASH_OPS_PYTHON_MODULE", "1")],
        extra_link_args=LINK_ARGS))
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
