"""Backend dispatch: defaults, forcing (context manager, set_backend, DFLASH_OPS_BACKEND), no
silent fallback, and the op table and schemas.

``torch`` serves every op on any device (the CPU kernel); ``triton`` runs on CUDA, and on CPU
only with ``TRITON_INTERPRET=1``; ``cuda`` is the C++ extension. Each op has one default backend
for CUDA tensors, eager or captured in a CUDA graph. A forced backend that lacks an op raises at
call time instead of falling back. Every op is called on its first sample case.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_ops
from dflash_ops import dispatch
from dflash_ops.ops import samples

REPO = Path(__file__).resolve().parent.parent

@pytest.fixture(autouse=True)
def clean_dispatch_state(monkeypatch):
    """Each test starts with no forced backend (even if DFLASH_OPS_BACKEND was set for the run)
    and leaves the dispatcher as it found it."""
    saved_global = dict(dispatch._global_force)
    saved_stack = list(dispatch._force_stack)
    dispatch._global_force.clear()
    dispatch._force_stack.clear()
    dispatch.sync()
    monkeypatch.delenv("DFLASH_OPS_DEBUG", raising=False)
    yield
    leaked_stack = list(dispatch._force_stack)
    dispatch._global_force.clear()
    dispatch._global_force.update(saved_global)
    dispatch._force_stack[:] = saved_stack
    dispatch.sync()
    assert not leaked_stack, f"use_backend blocks leaked: {leaked_stack}"


# --------------------------------------------------------------------------------------------
# A valid CPU call per op: the first case of its sample table
# --------------------------------------------------------------------------------------------
def valid_call(op):
    return dict(next(iter(samples("cpu", torch.float32)[op].values())))


def _call(op, kw):
    return getattr(torch.ops.dflash, op).default(**kw)


def _written_tensors(op, kw):
    out = []
    for name in dispatch.ops()[op].written:
        v = kw[name]
        out.extend(v if isinstance(v, list) else [v])
    return out


ALL_OPS = sorted(dispatch.ops())


def test_every_op_has_samples():
    table = samples("cpu", torch.float32)
    assert set(table) == set(dispatch.ops())
    assert all(table[op] for op in table), [op for op in table if not table[op]]


# --------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ALL_OPS)
def test_cpu_backend_is_torch(op):
    assert dflash_ops.backend_for(op, "cpu") == "torch"
    assert "torch" in dispatch.available_backends(op)
    _call(op, valid_call(op))  # and it runs


def test_backend_for_rejects_unknown_op():
    """A misspelt op name must not get a confident answer."""
    with pytest.raises((ValueError, KeyError), match="not_an_op"):
        dflash_ops.backend_for("not_an_op", "cpu")


def test_backend_for_accepts_indexed_cuda_device(monkeypatch):
    """``backend_for(op, "cuda:0")`` (or a torch.device) reports what a call on cuda:0 tensors
    runs, i.e. the same as ``"cuda"``; the router for every CUDA device is the same."""
    info = dispatch.ops()["rms_norm"]
    monkeypatch.setitem(info.impls, "triton", lambda *a, **k: None)
    want = dflash_ops.backend_for("rms_norm", "cuda")
    assert want in ("cuda", "triton")
    assert dflash_ops.backend_for("rms_norm", "cuda:0") == want
    assert dflash_ops.backend_for("rms_norm", torch.device("cuda", 0)) == want


# --------------------------------------------------------------------------------------------
# Forcing a backend that cannot serve CPU tensors raises; no fallback
# --------------------------------------------------------------------------------------------
def _expect_unavailable(op, backend):
    kw = valid_call(op)
    written = _written_tensors(op, kw)
    before = [t.clone() for t in written]
    with pytest.raises(dflash_ops.BackendUnavailableError) as info:
        _call(op, kw)
    msg = str(info.value)
    assert op in msg, f"error does not name the op: {msg}"
    assert repr(backend) in msg or f" {backend} " in msg, f"error does not name {backend}: {msg}"
    for t, b in zip(written, before):
        assert torch.equal(t, b), f"{op}: an argument was written although the call raised"


def test_backend_unavailable_error_is_a_runtime_error():
    assert issubclass(dflash_ops.BackendUnavailableError, RuntimeError)


@pytest.mark.parametrize("op", ALL_OPS)
def test_forced_cuda_on_cpu_raises(op):
    with dflash_ops.use_backend("cuda"):
        assert dflash_ops.backend_for(op, "cpu") == "cuda"
        _expect_unavailable(op, "cuda")
    assert dflash_ops.backend_for(op, "cpu") == "torch"
    _call(op, valid_call(op))


@pytest.mark.parametrize("op", ALL_OPS)
def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch, op):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with dflash_ops.use_backend("triton"):
        _expect_unavailable(op, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with dflash_ops.use_backend("triton", ops=[op]):
        _expect_unavailable(op, "triton")


def test_triton_on_cpu_runs_only_under_the_interpreter(monkeypatch):
    """The router runs a registered triton kernel on CPU tensors iff TRITON_INTERPRET=1."""
    info = dispatch.ops()["rms_norm"]
    calls = []

    def fake_triton(x, weight, eps):
        calls.append(x.shape)
        return torch.full_like(x, 7.0)

    monkeypatch.setitem(info.impls, "triton", fake_triton)
    kw = valid_call("rms_norm")
    with dflash_ops.use_backend("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        _expect_unavailable("rms_norm", "triton")
        monkeypatch.delenv("TRITON_INTERPRET")
        _expect_unavailable("rms_norm", "triton")
        assert not calls
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        out = _call("rms_norm", kw)
        assert calls == [kw["x"].shape] and torch.equal(out, torch.full_like(kw["x"], 7.0))
        # validation still runs before the triton kernel
        with pytest.raises(ValueError, match="weight"):
            _call("rms_norm", dict(kw, weight=torch.randn(32)))
        assert len(calls) == 1
    # outside the block the CPU default (torch) serves the call even under the interpreter
    out = _call("rms_norm", kw)
    assert len(calls) == 1 and not torch.equal(out, torch.full_like(kw["x"], 7.0))


def test_forced_triton_without_kernel_raises_even_under_interpreter(monkeypatch):
    info = dispatch.ops()["kv_proj"]
    monkeypatch.delitem(info.impls, "triton", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with dflash_ops.use_backend("triton"):
        _expect_unavailable("kv_proj", "triton")


def test_use_backend_ops_subset():
    with dflash_ops.use_backend("cuda", ops=["rms_norm", "store_kv_"]):
        assert dflash_ops.backend_for("rms_norm", "cpu") == "cuda"
        assert dflash_ops.backend_for("store_kv_", "cpu") == "cuda"
        assert dflash_ops.backend_for("kv_proj", "cpu") == "torch"
        _expect_unavailable("rms_norm", "cuda")
        _expect_unavailable("store_kv_", "cuda")
        _call("kv_proj", valid_call("kv_proj"))
    with dflash_ops.use_backend("cuda", ops="rope_"):  # a single name
        assert dflash_ops.backend_for("rope_", "cpu") == "cuda"
        assert dflash_ops.backend_for("rms_norm", "cpu") == "torch"


# --------------------------------------------------------------------------------------------
# Nesting, errors and set_backend
# --------------------------------------------------------------------------------------------
def test_nested_use_backend_restores_previous_state():
    op = "rms_norm"
    assert dflash_ops.backend_for(op, "cpu") == "torch"
    with dflash_ops.use_backend("cuda"):
        assert dflash_ops.backend_for(op, "cpu") == "cuda"
        with dflash_ops.use_backend("triton"):
            assert dflash_ops.backend_for(op, "cpu") == "triton"
            with dflash_ops.use_backend("torch", ops=[op]):
                assert dflash_ops.backend_for(op, "cpu") == "torch"
                assert dflash_ops.backend_for("kv_proj", "cpu") == "triton"
            assert dflash_ops.backend_for(op, "cpu") == "triton"
        assert dflash_ops.backend_for(op, "cpu") == "cuda"
        _expect_unavailable(op, "cuda")
    assert dflash_ops.backend_for(op, "cpu") == "torch"
    assert dispatch._force_stack == []


def test_nested_use_backend_same_backend_twice_restores_middle_block():
    """torch > cuda > torch: leaving the inner torch block must bring back the middle block's
    cuda, whatever blocks with equal settings exist further out."""
    op = "rms_norm"
    with dflash_ops.use_backend("torch"):
        with dflash_ops.use_backend("cuda"):
            with dflash_ops.use_backend("torch"):
                assert dflash_ops.backend_for(op, "cpu") == "torch"
            assert dflash_ops.backend_for(op, "cpu") == "cuda", \
                "leaving an inner use_backend block did not restore the enclosing block"
        assert dflash_ops.backend_for(op, "cpu") == "torch"
    assert dflash_ops.backend_for(op, "cpu") == "torch"


def test_use_backend_restores_on_exception():
    with pytest.raises(dflash_ops.BackendUnavailableError):
        with dflash_ops.use_backend("cuda"):
            _call("rms_norm", valid_call("rms_norm"))
    assert dflash_ops.backend_for("rms_norm", "cpu") == "torch"
    assert dispatch._force_stack == []


def test_use_backend_bad_backend():
    with pytest.raises(ValueError, match="bogus"):
        with dflash_ops.use_backend("bogus"):
            pass
    assert dispatch._force_stack == []
    assert dflash_ops.backend_for("rms_norm", "cpu") == "torch"


def test_use_backend_unknown_op():
    with pytest.raises(ValueError, match="not_an_op"):
        with dflash_ops.use_backend("torch", ops=["not_an_op"]):
            pass
    with pytest.raises(ValueError, match="not_an_op"):
        with dflash_ops.use_backend("cuda", ops=["rms_norm", "not_an_op"]):
            pass
    assert dispatch._force_stack == []
    assert dflash_ops.backend_for("rms_norm", "cpu") == "torch"


def test_set_backend_and_clear():
    dflash_ops.set_backend("cuda")
    assert all(dflash_ops.backend_for(op, "cpu") == "cuda" for op in ALL_OPS)
    _expect_unavailable("kv_proj", "cuda")
    # a use_backend block overrides the process-wide force, and leaving it restores it
    with dflash_ops.use_backend("torch"):
        assert dflash_ops.backend_for("kv_proj", "cpu") == "torch"
        _call("kv_proj", valid_call("kv_proj"))
    assert dflash_ops.backend_for("kv_proj", "cpu") == "cuda"
    dflash_ops.set_backend(None)
    assert all(dflash_ops.backend_for(op, "cpu") == "torch" for op in ALL_OPS)
    _call("kv_proj", valid_call("kv_proj"))


def test_set_backend_per_op():
    dflash_ops.set_backend("cuda", ops=["rope_"])
    assert dflash_ops.backend_for("rope_", "cpu") == "cuda"
    assert dflash_ops.backend_for("rms_norm", "cpu") == "torch"
    _expect_unavailable("rope_", "cuda")
    dflash_ops.set_backend(None, ops=["rope_"])
    assert dflash_ops.backend_for("rope_", "cpu") == "torch"
    _call("rope_", valid_call("rope_"))


def test_set_backend_bad_arguments():
    with pytest.raises(ValueError, match="bogus"):
        dflash_ops.set_backend("bogus")
    with pytest.raises(ValueError, match="not_an_op"):
        dflash_ops.set_backend("torch", ops=["not_an_op"])
    with pytest.raises(ValueError, match="not_an_op"):
        dflash_ops.set_backend(None, ops=["not_an_op"])
    assert dispatch._global_force == {}
    assert all(dflash_ops.backend_for(op, "cpu") == "torch" for op in ALL_OPS)


# --------------------------------------------------------------------------------------------
# DFLASH_OPS_BACKEND at import (fresh interpreters)
# --------------------------------------------------------------------------------------------
def _python(code, backend_env):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DFLASH_OPS_BACKEND", "DFLASH_OPS_DEBUG", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]]
                                                       if env.get("PYTHONPATH") else []))
    if backend_env is not None:
        env["DFLASH_OPS_BACKEND"] = backend_env
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)


def test_env_backend_bogus_fails_import():
    r = _python("import dflash_ops", "bogus")
    assert r.returncode != 0, f"import succeeded with DFLASH_OPS_BACKEND=bogus: {r.stdout}"
    assert "ValueError" in r.stderr, r.stderr
    assert "DFLASH_OPS_BACKEND" in r.stderr and "bogus" in r.stderr, r.stderr


def test_env_backend_forces_backend():
    code = ("import torch, dflash_ops\n"
            "print(dflash_ops.backend_for('rms_norm', 'cpu'), "
            "dflash_ops.backend_for('block_attention', 'cuda'))\n"
            "try:\n"
            "    torch.ops.dflash.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-6)\n"
            "    print('ran')\n"
            "except dflash_ops.BackendUnavailableError as e:\n"
            "    print('unavailable')\n")
    r = _python(code, "torch")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["torch", "torch", "ran"], r.stdout
    r = _python(code, "cuda")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cuda", "cuda", "unavailable"], r.stdout


# --------------------------------------------------------------------------------------------
# The op table and schemas
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ALL_OPS)
def test_op_exists_with_a_top_level_wrapper(op):
    """dflash_ops.<op>, or for an op that fills outputs the caller would otherwise allocate,
    the wrapper that allocates them: <op> without the underscore (greedy_commit) or without
    ``_out_`` (block_attention)."""
    packet = getattr(torch.ops.dflash, op)
    assert packet.default._schema.name == f"dflash::{op}"
    names = [op, op.rstrip("_"), op.removesuffix("_out_")]
    assert any(callable(getattr(dflash_ops, n, None)) for n in names), \
        f"none of dflash_ops.{names} exists"


def test_schema_arguments_as_parsed_by_dispatch():
    """OpInfo.args (what samples are split into positional / keyword arguments by, and what
    check compares) agrees with the schema torch parsed."""
    for op, info in dispatch.ops().items():
        schema = getattr(torch.ops.dflash, op).default._schema
        want = [(a.name, a.kwarg_only, a.alias_info is not None and a.alias_info.is_write)
                for a in schema.arguments]
        assert info.args == want, op


@pytest.mark.parametrize("op", ALL_OPS)
def test_schema_alias_annotations(op):
    schema = getattr(torch.ops.dflash, op).default._schema
    written = set()
    for a in schema.arguments:
        if a.alias_info is not None:
            assert a.alias_info.is_write, f"{op}: {a.name} has a read-only alias annotation"
            written.add(a.name)
    assert written == set(dispatch.ops()[op].written), f"{op}: {schema}"
    # each written argument in its own alias set: Tensor(a!) x, Tensor(b!) residual, ...
    # (the Python binding hides the set of a Tensor(a!)[] list, so read the schema text)
    annotated = {m.group(4): (m.group(1), m.group(2))
                 for m in re.finditer(r"Tensor\((\w+)(!?)\)(\[\])?\??\s+(\w+)", str(schema))}
    assert set(annotated) == written, f"{op}: {schema}"
    assert all(bang == "!" for _, bang in annotated.values()), f"{op}: {schema}"
    sets = [name for name, _ in annotated.values()]
    assert len(set(sets)) == len(sets), f"{op}: written args share an alias set: {schema}"
    # functional ops return fresh tensors; mutating ops return nothing
    for r in schema.returns:
        assert r.alias_info is None, f"{op}: a return aliases an input: {schema}"
    if written:
        assert len(schema.returns) == 0, f"{op}: in-place op returns something: {schema}"
    # naming rule: a trailing underscore marks exactly the ops that write their arguments
    assert op.endswith("_") == bool(written), f"{op}: name and schema disagree on mutation"


# --------------------------------------------------------------------------- defaults
def _expected(op, first):
    if not dispatch.has_backend(op, first):
        other = "cuda" if first == "triton" else "triton"
        return other if dispatch.has_backend(op, other) else "torch"
    return first


@pytest.mark.parametrize("op", ALL_OPS)
def test_default_backend(op):
    """A call recorded into a CUDA graph runs the declared default, an eager call the declared
    eager backend where there is one; a missing kernel falls back to the other compiled
    backend, then torch."""
    info = dispatch.ops()[op]
    assert info.default in ("triton", "cuda") and info.eager in (None, "triton", "cuda")
    assert info.eager != info.default
    assert dflash_ops.backend_for(op, "cuda", graph=True) == _expected(op, info.default)
    assert dflash_ops.backend_for(op, "cuda") == _expected(op, info.eager or info.default)


def test_define_op_rejects_a_bad_eager_backend():
    with pytest.raises(ValueError, match="eager must be"):
        dispatch.define_op("never_defined_eager(Tensor x) -> Tensor", validate=lambda x: None,
                           reference=lambda x: x, fake=lambda x: x, default="cuda",
                           eager="torch")
    assert "never_defined_eager" not in dispatch.ops()


def test_define_op_rejects_a_default_that_is_not_a_gpu_backend():
    with pytest.raises(ValueError, match="default must be"):
        dispatch.define_op("never_defined(Tensor x) -> Tensor", validate=lambda x: None,
                           reference=lambda x: x, fake=lambda x: x, default="torch")
    assert "never_defined" not in dispatch.ops()


def test_dropping_a_library_restores_the_kernel_it_shadowed():
    """What sync() relies on to bring a C++ kernel back: a kernel registered through a
    torch.library.Library lives as long as that object, and the one it overrode serves again."""
    import warnings
    ns = "dflash_test_shadow"
    base = torch.library.Library(ns, "DEF")
    base.define("f(Tensor x) -> Tensor")
    base.impl("f", lambda x: x + 1, "CPU")
    op = getattr(torch.ops, ns).f.default
    x = torch.zeros(1)
    assert op(x).item() == 1 and op.has_kernel_for_dispatch_key("CPU")
    assert not op.has_kernel_for_dispatch_key("CUDA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        over = torch.library.Library(ns, "IMPL")
        over.impl("f", lambda x: x + 100, "CPU")
    assert op(x).item() == 100
    del over
    assert op(x).item() == 1
    del base


def _counting_triton(op):
    """(calls list, restore fn): the op's Triton kernel wrapped to count its calls."""
    info = dispatch.ops()[op]
    triton_fn = info.impls["triton"]
    calls = []
    info.impls["triton"] = lambda *a, **k: calls.append(1) or triton_fn(*a, **k)
    return calls, lambda: info.impls.__setitem__("triton", triton_fn)


@pytest.mark.gpu
def test_eager_calls_run_cpp_and_captured_calls_run_triton():
    """rms_norm (default triton, eager cuda): an eager call runs the C++ kernel through the
    router, capture_graph's warm-up and capture run the Triton kernel, a user's own
    torch.cuda.graph capture too (its eager warm-up the C++ one); forcing cuda drops the router
    (the C++ kernel is called with no Python), leaving the block restores it."""
    op = "rms_norm"
    if not dispatch.has_backend(op, "cuda"):
        pytest.skip("no CUDA extension here")
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in valid_call(op).items()}
    want = dispatch.ops()[op].impls["torch"](**kw)
    calls, restore = _counting_triton(op)
    try:
        assert op in dispatch._override_libs
        torch.testing.assert_close(_call(op, kw), want, atol=1e-5, rtol=1e-5)
        assert calls == []
        g, out = dispatch.capture_graph(lambda: _call(op, kw))
        assert calls == [1, 1]
        g.replay()
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _call(op, kw)  # the user's warm-up: eager, the C++ kernel
        torch.cuda.current_stream().wait_stream(side)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            out2 = _call(op, kw)
        assert calls == [1, 1, 1]
        g2.replay()
        torch.testing.assert_close(out2, want, atol=1e-5, rtol=1e-5)
        with dflash_ops.use_backend("cuda", ops=[op]):
            assert op not in dispatch._override_libs
            torch.testing.assert_close(_call(op, kw), want, atol=1e-5, rtol=1e-5)
        assert op in dispatch._override_libs and calls == [1, 1, 1]
    finally:
        restore()


@pytest.mark.gpu
def test_a_users_capture_compiles_the_triton_kernel_it_needs():
    """In a fresh process, a graph captured with torch.cuda.graph whose warm-up ran eagerly
    (the C++ kernel) compiles the Triton kernel during the capture, and replays right."""
    script = (
        "import torch, dflash_ops\n"
        "x = torch.randn(5, 4, 128, device='cuda', dtype=torch.float16)\n"
        "w = torch.rand(128, device='cuda', dtype=torch.float16) + 0.5\n"
        "side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(side):\n"
        "    torch.ops.dflash.rms_norm(x, w, 1e-6)\n"
        "torch.cuda.current_stream().wait_stream(side)\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    y = torch.ops.dflash.rms_norm(x, w, 1e-6)\n"
        "x.copy_(torch.randn_like(x)); g.replay(); torch.cuda.synchronize()\n"
        "ref = dflash_ops.ops.norm.rms_norm_ref(x, w, 1e-6)\n"
        "torch.testing.assert_close(y, ref, atol=2e-3, rtol=2e-3)\n"
        "print('ok', dflash_ops.backend_for('rms_norm', graph=True))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["ok", dispatch.resolve("rms_norm", "cuda", graph=True)]


@pytest.mark.gpu
def test_cuda_extension_loaded_on_a_gpu_machine_with_nvcc():
    """The CUDA tests run only the backends present: a broken build must not turn them into a
    silent Triton/torch-only pass."""
    from torch.utils.cpp_extension import CUDA_HOME

    from dflash_ops import _ext

    if CUDA_HOME is None or os.environ.get("DFLASH_OPS_NO_CUDA") == "1":
        pytest.skip("no CUDA toolkit here (or DFLASH_OPS_NO_CUDA=1): the extension is optional")
    status = _ext.load()
    assert status["how"] in ("built", "jit"), f"dflash_ops._C not loaded: {status['detail']}"


def test_csrc_object_names_are_unique():
    """setup.py/JIT build one object per source, named by its stem: foo.cpp and foo.cu collide."""
    from dflash_ops import _ext

    stems = [p.stem for p in _ext.csrc_dir().glob("*") if p.suffix in (".cu", ".cpp")]
    assert stems, "no csrc sources found"
    dup = sorted({s for s in stems if stems.count(s) > 1})
    assert not dup, f"csrc sources sharing an object name: {dup}"
