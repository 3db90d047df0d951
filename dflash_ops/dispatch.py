"""Backend registry and dispatch for ``torch.ops.dflash.*``.

Every op has a schema (defined here, in Python, so the package works without the CUDA
extension), a fake kernel, and up to three backends:

* ``torch``  - the PyTorch reference: every op, any device; the CPU kernel and the oracle.
* ``triton`` - Triton kernels; CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1``.
* ``cuda``   - the C++ kernels of ``dflash_ops._C`` (csrc/), registered by C++ through
  ``TORCH_LIBRARY_IMPL(dflash, CUDA, m)``.

On CUDA the default backend of an op is the fastest one measured (``DEFAULT_CUDA`` below,
from benchmarks/results). When the chosen backend is ``cuda`` the C++ kernel serves the call
directly (no Python on the hot path). Otherwise a Python kernel is registered over the CUDA
dispatch key for that op and routes the call; it is removed again when ``cuda`` is chosen,
which restores the C++ registration.

``DFLASH_OPS_BACKEND=torch|triton|cuda`` (read at import) or ``use_backend(...)`` forces a
backend; a forced backend that lacks an op raises at call time instead of falling back.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Callable, Dict, Iterable, Optional

import torch

BACKENDS = ("torch", "triton", "cuda")
NAMESPACE = "dflash"

# Default backend per op on CUDA tensors, from benchmarks/results (H200, 2026-11-29). Two
# regimes, because the Triton kernels are the faster kernels while an eager Triton call costs
# 65-120 us of host time (Python router + launcher) against 8-16 us for a C++ kernel that the
# dispatcher calls directly (results/norm.md, context_kv-Qwen3-8B.md, "host overhead" tables):
# * DEFAULT_CUDA (eager): the fastest per call including the host, i.e. the C++ kernels;
# * GRAPH_CUDA: the fastest kernel under CUDA-graph replay, where host time is gone; used inside
#   ``graph_backends()`` (wrap CUDA-graph capture in it). K-norm rms_norm [T,40,128]: triton
#   1.36 vs 1.61 us at T=1, 80.5 vs 82.7 us at T=16384; knorm_rope_ / qk_norm_rope_: triton 1.6
#   vs 3.0 us at T=1, 95.8 vs 119.8 us at T=16384; store_kv_: a tie at T >= 4096, cuda 1.8 vs
#   2.0 us at T=1. rope_ shares the qk_norm_rope_ kernels (not benchmarked alone).
# Ops absent from a table prefer cuda, then triton, then torch.
DEFAULT_CUDA: Dict[str, str] = {
    "rms_norm": "cuda", "fused_add_rms_norm_": "cuda", "rope_": "cuda", "qk_norm_rope_": "cuda",
    "knorm_rope_": "cuda", "store_kv_": "cuda",
    # cuBLAS (+ the C++ epilogue): host cost of one C++ call; Triton's kv_proj is at best even
    "kv_proj": "cuda", "context_kv_": "cuda",
    # the CUDA kernel: 1.5-1.6x faster than the Triton one at every benchmarked shape
    # (results/attention-*-paged.md); the torch reference gathers K/V per query row
    "block_attention": "cuda", "block_attention_out_": "cuda",
    # not benchmarked yet: memory-bound elementwise, the same choice as rms_norm
    "silu_mul": "cuda"}
GRAPH_CUDA: Dict[str, str] = {
    "rms_norm": "triton", "fused_add_rms_norm_": "triton", "rope_": "triton",
    "qk_norm_rope_": "triton", "knorm_rope_": "triton", "store_kv_": "cuda",
    # kv_proj: cuBLAS ties or beats the Triton GEMM at every T but 4096 (sweep_context.py)
    "kv_proj": "cuda", "context_kv_": "cuda",
    "block_attention": "cuda", "block_attention_out_": "cuda",
    "silu_mul": "triton"}  # not benchmarked yet: rms_norm's choice
_PREFERENCE = ("cuda", "triton", "torch")

_lib = torch.library.Library(NAMESPACE, "DEF")
_OPS: Dict[str, "OpInfo"] = {}
_force_stack: list = []  # use_backend() blocks, innermost last
_global_force: Dict[Optional[str], str] = {}  # op name (None = all ops) -> backend
_override_libs: Dict[str, torch.library.Library] = {}
_cuda_cpp_ops: set = set()  # ops whose CUDA key holds a C++ kernel from dflash_ops._C
_sync_lock = threading.RLock()
_graph_mode: list = []  # one entry per open graph_backends() block


class BackendUnavailableError(RuntimeError):
    """A forced backend has no kernel for the op or cannot run on the given device."""


class OpInfo:
    def __init__(self, name: str, validate: Callable, debug_check: Optional[Callable]):
        self.name = name
        self.validate = validate
        self.debug_check = debug_check
        self.impls: Dict[str, Callable] = {}

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


def define_op(schema: str, *, validate: Callable, reference: Callable, fake: Callable,
              debug_check: Optional[Callable] = None) -> OpInfo:
    """Define ``torch.ops.dflash.<name>`` from its schema with its reference and fake kernel.

    ``validate(*args)`` raises ValueError/RuntimeError naming the bad argument; it runs before
    every Python backend and inside the fake kernel. ``debug_check(*args)`` checks values that
    live on the device (slots, positions) and runs only with ``DFLASH_OPS_DEBUG=1``.
    """
    name = schema.split("(", 1)[0].strip()
    _lib.define(schema)
    info = OpInfo(name, validate, debug_check)
    info.impls["torch"] = reference
    _OPS[name] = info

    def fake_kernel(*args, **kwargs):
        validate(*args, **kwargs)
        return fake(*args, **kwargs)

    torch.library.register_fake(info.qualname, fake_kernel, lib=_lib)
    _lib.impl(name, _make_router(info, "cpu"), "CPU")
    return info


def register_backend(op: str, backend: str, fn: Callable) -> None:
    """Add a Python kernel (``triton``) for an op; ``fn`` takes the op's arguments."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"register_backend: backend must be 'torch' or 'triton', got {backend!r}"
                         " (cuda kernels register from C++ through TORCH_LIBRARY_IMPL)")
    _OPS[op].impls[backend] = fn


def ops() -> Dict[str, OpInfo]:
    return dict(_OPS)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _debug() -> bool:
    return os.environ.get("DFLASH_OPS_DEBUG", "0") == "1"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _CudaOnly(dict):
    """A force that applies to CUDA tensors only (graph_backends)."""


def _forced(op: str, device: str = "cuda") -> Optional[str]:
    if _force_stack:
        for forced in reversed(_force_stack):
            if device != "cuda" and isinstance(forced, _CudaOnly):
                continue
            if op in forced:
                return forced[op]
            if None in forced:
                return forced[None]
    if op in _global_force:
        return _global_force[op]
    return _global_force.get(None)


def has_backend(op: str, backend: str) -> bool:
    if backend == "cuda":
        return op in _cuda_cpp_ops
    return backend in _OPS[op].impls


def available_backends(op: str) -> list:
    return [b for b in BACKENDS if has_backend(op, b)]


def resolve(op: str, device: str = "cuda") -> str:
    """The backend a call of ``op`` on ``device`` (a device or its type) runs with."""
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; ops are {sorted(_OPS)}")
    return _resolve(op, torch.device(device).type)


def _resolve(op: str, device: str) -> str:
    forced = _forced(op, device)
    if forced is not None:
        return forced
    if device != "cuda":
        return "torch"
    preferred = DEFAULT_CUDA.get(op)
    order = ((preferred,) if preferred else ()) + _PREFERENCE
    for b in order:
        if has_backend(op, b):
            return b
    return "torch"


def _make_router(info: OpInfo, device: str) -> Callable:
    """The Python kernel registered for a dispatch key: validate, then run the chosen backend."""
    name = info.name

    def router(*args, **kwargs):
        backend = _resolve(name, device)
        fn = info.impls.get(backend)
        if fn is None or (backend == "triton" and device == "cpu" and not _interpret()):
            if backend == "cuda" and device == "cuda" and name in _cuda_cpp_ops:
                raise BackendUnavailableError(  # should not happen: sync() removes the router
                    f"dflash.{name}: the cuda kernel is shadowed; call dflash_ops.dispatch.sync()")
            where = "CPU tensors (set TRITON_INTERPRET=1 before importing triton)" \
                if backend == "triton" else f"{device.upper()} tensors"
            raise BackendUnavailableError(
                f"dflash.{name}: backend {backend!r} was forced but has no kernel for this op on "
                f"{where}; available: {available_backends(name)}")
        info.validate(*args, **kwargs)
        if info.debug_check is not None and _debug() and not _capturing():
            info.debug_check(*args, **kwargs)  # reads values back: not during graph capture
        return fn(*args, **kwargs)

    router.__name__ = f"{name}_{device}_router"
    return router


def sync() -> None:
    """Make each op's CUDA dispatch-key registration match its resolved backend."""
    with _sync_lock:
        for name, info in _OPS.items():
            want_cpp = _resolve(name, "cuda") == "cuda" and name in _cuda_cpp_ops
            lib = _override_libs.get(name)
            if want_cpp and lib is not None:
                lib._destroy()
                del _override_libs[name]
            elif not want_cpp and lib is None:
                lib = torch.library.Library(NAMESPACE, "IMPL")
                with warnings.catch_warnings():
                    # "Overriding a previously registered kernel" when a C++ kernel is shadowed.
                    warnings.simplefilter("ignore")
                    lib.impl(name, _make_router(info, "cuda"), "CUDA")
                _override_libs[name] = lib


def note_cuda_extension_loaded() -> None:
    """Record which ops the C++ extension registered for CUDA (before Python shadows any)."""
    with _sync_lock:
        for name in _OPS:
            if name in _override_libs:
                continue
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CUDA"):
                _cuda_cpp_ops.add(name)
        sync()


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _check_ops(op_names: Optional[Iterable[str]]):
    if op_names is None:
        return [None]
    names = [op_names] if isinstance(op_names, str) else list(op_names)
    for n in names:
        if n not in _OPS:
            raise ValueError(f"unknown op {n!r}; ops are {sorted(_OPS)}")
    return names


@contextlib.contextmanager
def use_backend(backend: str, ops: Optional[Iterable[str]] = None):
    """Force ``backend`` for ``ops`` (default: every op) inside the block.

    The force is process-wide (the dispatcher's CUDA registration is), so do not open
    blocks from several threads at once.
    """
    with _pushed({n: _check_backend(backend) for n in _check_ops(ops)}):
        yield


@contextlib.contextmanager
def _pushed(forced: dict):
    with _sync_lock:
        _force_stack.append(forced)
        sync()
    try:
        yield
    finally:
        with _sync_lock:
            for i in range(len(_force_stack) - 1, -1, -1):  # this block's entry, by identity
                if _force_stack[i] is forced:
                    del _force_stack[i]
                    break
            sync()


@contextlib.contextmanager
def graph_backends():
    """Inside the block each op runs its fastest backend under CUDA-graph replay (GRAPH_CUDA),
    where one is available; wrap CUDA-graph warm-up and capture in it. Process-wide like
    use_backend; an explicit use_backend/set_backend opened inside it still wins."""
    with _pushed(_CudaOnly((op, b) for op, b in GRAPH_CUDA.items()
                           if op in _OPS and has_backend(op, b))):
        _graph_mode.append(True)
        try:
            yield
        finally:
            _graph_mode.pop()


def capture_graph(fn: Callable, device=None):
    """(graph, fn's outputs): ``fn()`` run once on a side stream (compiles, autotunes, fills
    caches), then recorded in a CUDA graph, both inside ``graph_backends()`` on ``device``
    (default: the current one). The warm-up runs for real: its writes are the ones a replay
    repeats."""
    with graph_backends(), torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
    return g, out


def in_graph_backends() -> bool:
    """Whether a ``graph_backends()`` block is open (code choosing kernels outside the op
    tables, e.g. ``models.linear``, follows it)."""
    return bool(_graph_mode)


def set_backend(backend: Optional[str], ops: Optional[Iterable[str]] = None) -> None:
    """Force ``backend`` process-wide for ``ops`` (default all); ``None`` clears the force."""
    names = _check_ops(ops)
    for n in names:
        if backend is None:
            _global_force.pop(n, None)
        else:
            _global_force[n] = _check_backend(backend)
    sync()


def _init_from_env() -> None:
    env = os.environ.get("DFLASH_OPS_BACKEND", "").strip().lower()
    if env:
        if env not in BACKENDS:
            raise ValueError(f"DFLASH_OPS_BACKEND must be one of {BACKENDS}, got {env!r}")
        _global_force[None] = env
