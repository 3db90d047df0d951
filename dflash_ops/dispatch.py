"""Backend registry and dispatch for ``torch.ops.dflash.*``.

Every op has a schema (defined in Python, in ``dflash_ops/ops/<family>.py``, so the package
works without the CUDA extension), a fake kernel, and up to three backends:

* ``torch``  - the PyTorch reference: every op, any device; the CPU kernel and the oracle.
* ``triton`` - Triton kernels (``dflash_ops/triton/<family>.py``); CUDA tensors, or CPU tensors
  when ``TRITON_INTERPRET=1``.
* ``cuda``   - the C++ kernels of ``dflash_ops._C`` (``csrc/<family>.cu``), registered by C++
  through ``TORCH_LIBRARY_IMPL(dflash, CUDA, m)``.

Which kernel runs
-----------------
On CPU tensors: the torch reference. On CUDA tensors, each op declares where it is defined
(``define_op(..., default=..., eager=...)``, with the measurement behind it next to it):

* ``default``: the fastest kernel on the GPU (kernel time under CUDA-graph replay). It runs in
  every call recorded into a CUDA graph -- ours (``capture_graph``) and a user's own
  ``torch.cuda.graph`` alike: the router sees ``torch.cuda.is_current_stream_capturing()``.
* ``eager`` (where given): the backend for calls that are not captured, when a lower host cost
  beats a faster kernel there. An eager Triton call costs 65-120 us of host time (Python router,
  argument checks, Triton's launcher) against 8-16 us for a C++ kernel; the norm, RoPE and SwiGLU
  kernels take 1-3 us on the GPU, so eager calls of those ops run the C++ kernel.

Where the chosen kernel is absent (no CUDA extension built, or triton not installed), the other
compiled backend runs, then torch. ``resolve(op, device, graph=)`` answers for either kind of call.

``models.linear`` picks cuBLAS or the Triton GEMM per shape from its measured table
(``models/linear_table.json``): the same rule, for the linears of the models.

``DFLASH_OPS_BACKEND=torch|triton|cuda`` (read at import), ``set_backend(...)`` (process-wide)
or ``use_backend(...)`` (a block) forces a backend; a forced backend that lacks an op raises
``BackendUnavailableError`` at call time instead of falling back.

How: the C++ extension registers each kernel twice (csrc/register.h): on the CUDA key of
``torch.ops.dflash.<op>`` and as ``torch.ops.dflash_cuda.<op>``, the same kernel under its own
name. When an op runs C++ in both kinds of call, that kernel sits on the CUDA key and the
dispatcher calls it with no Python in between. Otherwise a Python router is registered over it
(in its own ``torch.library.Library``); it picks the backend per call and reaches the C++ kernel
through ``dflash_cuda``. Dropping the router's Library brings the C++ kernel back.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from typing import Callable, Dict, Iterable, Optional

import torch

BACKENDS = ("torch", "triton", "cuda")
NAMESPACE = "dflash"
CUDA_NAMESPACE = "dflash_cuda"  # the C++ kernels under their own names (module docstring)

_lib = torch.library.Library(NAMESPACE, "DEF")
_cuda_lib = torch.library.Library(CUDA_NAMESPACE, "DEF")
_OPS: Dict[str, "OpInfo"] = {}
_force_stack: list = []  # use_backend() blocks, innermost last
_global_force: Dict[Optional[str], str] = {}  # op name (None = all ops) -> backend
_override_libs: Dict[str, torch.library.Library] = {}  # op -> the Library of its CUDA router
_cuda_cpp_ops: set = set()  # ops with a C++ kernel from dflash_ops._C
_sync_lock = threading.RLock()
_local = threading.local()  # .warmups: this thread's capture_graph warm-ups in progress


class BackendUnavailableError(RuntimeError):
    """A forced backend has no kernel for the op or cannot run on the given device."""


class OpInfo:
    """An op: its schema's arguments, checks, default backend and Python kernels."""

    def __init__(self, schema: str, validate: Callable, debug_check: Optional[Callable],
                 default: str, eager: Optional[str] = None):
        self.schema = schema
        self.name = schema.split("(", 1)[0].strip()
        self.validate = validate
        self.debug_check = debug_check
        self.default = default
        self.eager = eager
        self.impls: Dict[str, Callable] = {}
        # "Tensor(a!)[] k_caches", "*", "bool causal=False": (name, keyword-only, written)
        self.args = []
        kw_only = False
        for decl in schema[len(self.name) + 1:schema.rindex(") ->")].split(","):
            decl = decl.strip()
            if decl == "*":
                kw_only = True
                continue
            typ, name = decl.split("=", 1)[0].rsplit(None, 1)
            self.args.append((name, kw_only, "!" in typ))

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def written(self) -> list:
        """The arguments the op writes (``(a!)`` in the schema)."""
        return [n for n, _, w in self.args if w]

    def call_args(self, case: dict) -> tuple:
        """(args, kwargs) for the op from {argument name: value}: positional arguments in
        schema order, keyword-only ones by name."""
        return (tuple(case[n] for n, kw, _ in self.args if not kw and n in case),
                {n: case[n] for n, kw, _ in self.args if kw and n in case})


def define_op(schema: str, *, validate: Callable, reference: Callable, fake: Callable,
              default: str, eager: Optional[str] = None,
              debug_check: Optional[Callable] = None) -> OpInfo:
    """Define ``torch.ops.dflash.<name>`` from its schema with its reference and fake kernel.

    ``default`` (``"triton"`` or ``"cuda"``) is the backend CUDA tensors run with, the fastest
    kernel; ``eager`` (optional, the same choices) the one for calls outside CUDA-graph capture
    where it differs (module docstring). ``validate(
    *args)`` raises ValueError/RuntimeError naming the bad argument; it runs before every
    Python backend and inside the fake kernel. ``debug_check(*args)`` checks values that live
    on the device (slots, positions) and runs only with ``DFLASH_OPS_DEBUG=1``.
    """
    if default not in ("triton", "cuda"):
        raise ValueError(f"define_op: default must be 'triton' or 'cuda', got {default!r}")
    if eager not in (None, "triton", "cuda"):
        raise ValueError(f"define_op: eager must be None, 'triton' or 'cuda', got {eager!r}")
    info = OpInfo(schema, validate, debug_check, default, None if eager == default else eager)
    name = info.name
    _lib.define(schema)
    _cuda_lib.define(schema)  # the C++ kernel's own name, if csrc/ has one
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
    return (os.environ.get("DFLASH_OPS_DEBUG", "0") == "1"
            and not getattr(_local, "no_debug", 0))


@contextlib.contextmanager
def without_debug_checks():
    """Inside: no ``DFLASH_OPS_DEBUG`` value checks, for a caller that passes values outside
    the checked range on purpose, as the ops' contract allows (the loop's decode iteration
    passes rows of -1: padding that prepare_step_ pads and the commits skip)."""
    _local.no_debug = getattr(_local, "no_debug", 0) + 1
    try:
        yield
    finally:
        _local.no_debug -= 1


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _warming() -> int:
    """How many capture_graph warm-ups this thread is inside (other threads' eager calls are
    not affected by one)."""
    return getattr(_local, "warmups", 0)


def in_graph_call() -> bool:
    """Whether calls made now are recorded into a CUDA graph (or are ``capture_graph``'s
    warm-up of one): code choosing kernels outside the op table (``models.linear``) follows
    the same rule as the ops."""
    return _warming() or _capturing()


def _forced(op: str) -> Optional[str]:
    for forced in reversed(_force_stack):
        if op in forced:
            return forced[op]
        if None in forced:
            return forced[None]
    if op in _global_force:
        return _global_force[op]
    return _global_force.get(None)


def forced_backend(op: str) -> Optional[str]:
    """The backend forced for ``op`` right now (``use_backend`` / ``set_backend`` /
    ``DFLASH_OPS_BACKEND``), or None: code that fuses an op into something else (the models'
    GEMM epilogues) leaves it unfused while one is forced."""
    return _forced(op)


def has_backend(op: str, backend: str) -> bool:
    if backend == "cuda":
        return op in _cuda_cpp_ops
    return backend in _OPS[op].impls


def available_backends(op: str) -> list:
    return [b for b in BACKENDS if has_backend(op, b)]


def runnable_backends(op: str, device: str) -> list:
    """The backends that can run ``op`` on tensors of this device type now: torch always; on
    CPU triton only under TRITON_INTERPRET=1; on CUDA every registered one."""
    return [b for b in available_backends(op)
            if b == "torch" or device == "cuda" or (b == "triton" and _interpret())]


def resolve(op: str, device: str = "cuda", graph: bool = False) -> str:
    """The backend a call of ``op`` on ``device`` (a device or its type) runs with: an eager
    call, or (``graph=True``) one recorded into a CUDA graph."""
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; ops are {sorted(_OPS)}")
    return _resolve(op, torch.device(device).type, graph)


def _resolve(op: str, device: str, graph: bool = False) -> str:
    forced = _forced(op)
    if forced is not None:
        return forced
    if device != "cuda":
        return "torch"
    info = _OPS[op]
    first = info.default if graph or info.eager is None else info.eager
    for b in (first, "cuda" if first == "triton" else "triton"):
        if has_backend(op, b):
            return b
    return "torch"


def _make_router(info: OpInfo, device: str) -> Callable:
    """The Python kernel registered for a dispatch key: validate, then run the chosen backend."""
    name = info.name

    cpp = []  # torch.ops.dflash_cuda.<name>, looked up on first use

    def router(*args, **kwargs):
        backend = _resolve(name, device, device == "cuda" and in_graph_call())
        if backend == "cuda" and device == "cuda" and name in _cuda_cpp_ops:
            if info.debug_check is not None and _debug() and not _capturing():
                info.debug_check(*args, **kwargs)
            if not cpp:
                cpp.append(getattr(getattr(torch.ops, CUDA_NAMESPACE), name).default)
            return cpp[0](*args, **kwargs)  # the C++ launcher checks its arguments
        fn = info.impls.get(backend)
        if fn is None or (backend == "triton" and device == "cpu" and not _interpret()):
            where = "CPU tensors (set TRITON_INTERPRET=1 before importing triton)" \
                if backend == "triton" else f"{device.upper()} tensors"
            raise BackendUnavailableError(
                f"dflash.{name}: backend {backend!r} was forced but has no kernel for this op on "
                f"{where}; available on {device.upper()} tensors: "
                f"{runnable_backends(name, device)}")
        info.validate(*args, **kwargs)
        if info.debug_check is not None and _debug() and not _capturing():
            info.debug_check(*args, **kwargs)  # reads values back: not during graph capture
        return fn(*args, **kwargs)

    router.__name__ = f"{name}_{device}_router"
    return router


def sync() -> None:
    """Make each op's CUDA dispatch-key registration match its resolved backends: the C++
    kernel when eager and captured calls both run it, else the Python router."""
    with _sync_lock:
        for name, info in _OPS.items():
            want_cpp = (name in _cuda_cpp_ops and _resolve(name, "cuda", False) == "cuda"
                        and _resolve(name, "cuda", True) == "cuda")
            if want_cpp and name in _override_libs:
                # a Library's registrations end with it: the C++ kernel serves the key again
                del _override_libs[name]
            elif not want_cpp and name not in _override_libs:
                lib = torch.library.Library(NAMESPACE, "IMPL")
                with warnings.catch_warnings():
                    # "Overriding a previously registered kernel" when a C++ kernel is shadowed.
                    warnings.simplefilter("ignore")
                    lib.impl(name, _make_router(info, "cuda"), "CUDA")
                _override_libs[name] = lib


def note_cuda_extension_loaded() -> None:
    """Record which ops the C++ extension registered a CUDA kernel for."""
    with _sync_lock:
        cuda_ops = getattr(torch.ops, CUDA_NAMESPACE)
        for name in _OPS:
            if getattr(cuda_ops, name).default.has_kernel_for_dispatch_key("CUDA"):
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
    with _forcing({n: _check_backend(backend) for n in _check_ops(ops)}):
        yield


@contextlib.contextmanager
def _forcing(forced: dict):
    """Push ``forced`` (op -> backend) onto the force stack for the block."""
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
    """Inside the block, eager calls of every op run the backend its captured calls run (its
    default, as resolved now on CUDA), so eager and graphed code paths run the same kernels
    (exact mode: a C++ and a Triton norm round differently). Process-wide, as ``use_backend``."""
    with _forcing({n: _resolve(n, "cuda", True) for n in _OPS}):
        yield


def set_backend(backend: Optional[str], ops: Optional[Iterable[str]] = None) -> None:
    """Force ``backend`` process-wide for ``ops`` (default all); ``None`` clears the force."""
    names = _check_ops(ops)
    if backend is not None:
        _check_backend(backend)
    with _sync_lock:
        for n in names:
            if backend is None:
                _global_force.pop(n, None)
            else:
                _global_force[n] = backend
        sync()


def capture_graph(fn: Callable, device=None):
    """(graph, fn's outputs): ``fn()`` run once on a side stream with the kernels a captured
    call runs (compiles, autotunes, fills caches), then recorded in a CUDA graph, on ``device``
    (default: the current one). The warm-up runs for real: its writes are the ones a replay
    repeats. A graph captured without this helper gets the same kernels; its warm-up then
    compiles the eager ones, and the first capture compiles and loads the graph ones (seen to
    work on the H200, torch 2.11 / triton 3.6, in tests/test_dispatch.py; warming up through
    this helper keeps compilation out of the capture)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        _local.warmups = _warming() + 1
        try:
            with torch.cuda.stream(side):
                fn()
        finally:
            _local.warmups -= 1
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
    return g, out


def backend_env_error() -> Optional[str]:
    """What is wrong with ``DFLASH_OPS_BACKEND`` (one line naming it, the allowed values and the
    value given), or None when it is unset, empty or one of ``BACKENDS``."""
    raw = os.environ.get("DFLASH_OPS_BACKEND", "")
    if not raw.strip() or raw.strip().lower() in BACKENDS:
        return None
    return (f"DFLASH_OPS_BACKEND: got {raw!r}; allowed: {', '.join(BACKENDS)} (or unset: no "
            f"backend forced)")


def _running_cli() -> bool:
    """Whether this process is the ``dflash-ops`` command (its console script, or ``python -m
    dflash_ops`` / ``python -m dflash_ops.cli``): its import of the package is the first thing
    it does, before ``cli.main`` could catch anything."""
    if os.path.basename(sys.argv[0] if sys.argv else "").removesuffix(".exe") == "dflash-ops":
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and argv[i + 1:i + 2] in (["dflash_ops"], ["dflash_ops.cli"])
               for i, a in enumerate(argv))


def _init_from_env() -> None:
    """Force ``DFLASH_OPS_BACKEND``'s backend (at import). A bad value raises ValueError for a
    library user; the ``dflash-ops`` command prints it as its one-line error and exits 2."""
    bad = backend_env_error()
    if bad:
        if _running_cli():
            print(f"dflash-ops: error: {bad}", file=sys.stderr)
            raise SystemExit(2)
        raise ValueError(bad)
    env = os.environ.get("DFLASH_OPS_BACKEND", "").strip().lower()
    if env:
        _global_force[None] = env
