"""Loading the CUDA extension ``dflash_ops._C`` (built by setup.py), or a JIT build of csrc/.

The extension registers its kernels with the dispatcher from C++ (TORCH_LIBRARY_IMPL(dflash,
CUDA, ...)); loading it is all that is needed. Without it the Triton and torch backends serve
CUDA tensors, and one log line says so.
"""
from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("dflash_ops")

# how: "built" (dflash_ops._C), "jit" (compiled at import from csrc/), or "absent"
STATUS = {"how": "absent", "detail": "not loaded yet", "path": None}


def csrc_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "csrc"


def _jit_build():
    from torch.utils.cpp_extension import load

    src = csrc_dir()
    sources = sorted(glob.glob(str(src / "*.cu")) + glob.glob(str(src / "*.cpp")))
    if not sources:
        raise RuntimeError(f"no CUDA sources under {src} (a wheel install has no csrc/)")
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    major, minor = torch.cuda.get_device_capability()
    cuda_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    if not arch:
        suffix = "a" if major == 9 else ""
        cuda_flags.append(f"-gencode=arch=compute_{major}{minor}{suffix},"
                          f"code=sm_{major}{minor}{suffix}")
    load(name="dflash_ops_C_jit", sources=sources, extra_cflags=["-O3", "-std=c++20"],
         extra_cuda_cflags=cuda_flags, extra_include_paths=[str(src)],
         extra_ldflags=["-Wl,--exclude-libs,ALL"],  # see setup.py: LINK_ARGS
         is_python_module=False, verbose=os.environ.get("DFLASH_OPS_VERBOSE") == "1")


def load() -> dict:
    """Load the extension once; returns STATUS. Never raises."""
    if STATUS["detail"] != "not loaded yet":
        return STATUS
    try:
        from . import _C  # noqa: F401

        STATUS.update(how="built", detail="dflash_ops._C", path=getattr(_C, "__file__", None))
        return STATUS
    except ImportError as e:
        missing = str(e)
    if torch.version.cuda is None or not torch.cuda.is_available():
        STATUS.update(how="absent", detail="no CUDA device or CPU-only torch: triton/torch "
                                           "backends only")
        return STATUS
    if os.environ.get("DFLASH_OPS_JIT", "1") == "0":
        STATUS.update(how="absent", detail=f"not built ({missing}); JIT disabled by DFLASH_OPS_JIT=0")
        log.warning("dflash_ops: CUDA extension not built and DFLASH_OPS_JIT=0; the Triton "
                    "backend serves CUDA tensors")
        return STATUS
    try:
        _jit_build()
        STATUS.update(how="jit", detail=f"JIT-compiled from {csrc_dir()}")
        log.warning("dflash_ops: CUDA extension dflash_ops._C was not built; JIT-compiled csrc/ "
                    "(cached by torch.utils.cpp_extension)")
    except Exception as e:  # noqa: BLE001 - any build failure means: fall back, say why
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        STATUS.update(how="absent", detail=f"JIT build failed: {first}")
        log.warning("dflash_ops: CUDA extension unavailable (JIT build of csrc/ failed: %s); "
                    "the Triton backend serves CUDA tensors", first)
    return STATUS
