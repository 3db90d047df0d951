"""Backend dispatch: defaults, forcing (context manager, set_backend, DFLASH_OPS_BACKEND), no
silent fallback, and the op table and schemas DESIGN.md promises.

DESIGN.md, "Backends and dispatch": ``torch`` serves every op on any device (the CPU kernel);
``triton`` runs on CUDA, and on CPU only with ``TRITON_INTERPRET=1``; ``cuda`` is the C++
extension. A forced backend that lacks an op raises at call time instead of falling back.
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
from dflash_ops.ops.rope import make_cos_sin_cache

REPO = Path(__file__).resolve().parent.parent

# DESIGN.md's op table (plus the out= variant of block_attention) -> the arguments each writes.
DESIGN_OPS = ["rms_norm", "fused_add_rms_norm_", "rope_", "qk_norm_rope_", "knorm_rope_",
              "store_kv_", "kv_proj", "context_kv_", "block_attention"]
WRITES = {
    "rms_norm": set(),
    "silu_mul": set(),
    "fused_add_rms_norm_": {"x", "residual"},
    "rope_": {"x"},
    "qk_norm_rope_": {"q", "k"},
    "knorm_rope_": {"k"},
    "store_kv_": {"k_caches", "v_caches"},
    "kv_proj": set(),
    "context_kv_": {"k_caches", "v_caches"},
    "block_attention": set(),
    "block_attention_out_": {"out"},
}


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
# Small valid CPU calls, one per op: name -> () -> kwargs
# --------------------------------------------------------------------------------------------
def _caches(n=2):
    return [torch.randn(4, 4, 2, 64) for _ in range(n)]


def _attn():
    return dict(q=torch.randn(4, 4, 64), k_cache=torch.randn(4, 4, 2, 64),
                v_cache=torch.randn(4, 4, 2, 64),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 3], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32), scale=0.125,
                causal=True, window=-1, sinks=None)


CALLS = {
    "silu_mul": lambda: dict(x=torch.randn(3, 2 * 64)),
    "rms_norm": lambda: dict(x=torch.randn(3, 64), weight=torch.randn(64), eps=1e-6),
    "fused_add_rms_norm_": lambda: dict(x=torch.randn(3, 64), residual=torch.randn(3, 64),
                                        weight=torch.randn(64), eps=1e-6),
    "rope_": lambda: dict(x=torch.randn(3, 2, 64), positions=torch.tensor([0, 4, 9]),
                          cos_sin_cache=make_cos_sin_cache(16, 64), is_neox=True),
    "qk_norm_rope_": lambda: dict(q=torch.randn(3, 4, 64), k=torch.randn(3, 2, 64),
                                  q_weight=torch.randn(64), k_weight=torch.randn(64),
                                  positions=torch.tensor([0, 4, 9]),
                                  cos_sin_cache=make_cos_sin_cache(16, 64), eps=1e-6,
                                  is_neox=False),
    "knorm_rope_": lambda: dict(k=torch.randn(3, 2, 2, 64), k_weight=torch.randn(2, 64),
                                positions=torch.tensor([0, 4, 9]),
                                cos_sin_cache=make_cos_sin_cache(16, 32), eps=1e-6, is_neox=True),
    "store_kv_": lambda: dict(k=torch.randn(3, 2, 2, 64), v=torch.randn(3, 2, 2, 64),
                              k_caches=_caches(), v_caches=_caches(),
                              slot_mapping=torch.tensor([1, -1, 7])),
    "kv_proj": lambda: dict(x=torch.randn(3, 32), w_kv=torch.randn(48, 32), bias=None),
    "context_kv_": lambda: dict(x=torch.randn(3, 32), w_kv=torch.randn(2 * 2 * 2 * 64, 32),
                                bias=None, k_weight=torch.randn(2, 64),
                                positions=torch.tensor([0, 4, 9]),
                                cos_sin_cache=make_cos_sin_cache(16, 64),
                                slot_mapping=torch.tensor([1, -1, 7]), k_caches=_caches(),
                                v_caches=_caches(), eps=1e-6, is_neox=True,
                                hidden_norm_weight=None),
    "block_attention": _attn,
    "block_attention_out_": lambda: dict(_attn(), out=torch.zeros(4, 4, 64)),
}


def _call(op, kw):
    return getattr(torch.ops.dflash, op).default(**kw)


def _written_tensors(op, kw):
    out = []
    for name in WRITES[op]:
        v = kw[name]
        out.extend(v if isinstance(v, list) else [v])
    return out


ALL_OPS = sorted(dispatch.ops())


def test_call_table_covers_every_op():
    assert set(CALLS) == set(dispatch.ops())


# --------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ALL_OPS)
def test_cpu_backend_is_torch(op):
    assert dflash_ops.backend_for(op, "cpu") == "torch"
    assert "torch" in dispatch.available_backends(op)
    _call(op, CALLS[op]())  # and it runs


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
    kw = CALLS[op]()
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
    _call(op, CALLS[op]())


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
    kw = CALLS["rms_norm"]()
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
        _call("kv_proj", CALLS["kv_proj"]())
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
            _call("rms_norm", CALLS["rms_norm"]())
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
        _call("kv_proj", CALLS["kv_proj"]())
    assert dflash_ops.backend_for("kv_proj", "cpu") == "cuda"
    dflash_ops.set_backend(None)
    assert all(dflash_ops.backend_for(op, "cpu") == "torch" for op in ALL_OPS)
    _call("kv_proj", CALLS["kv_proj"]())


def test_set_backend_per_op():
    dflash_ops.set_backend("cuda", ops=["rope_"])
    assert dflash_ops.backend_for("rope_", "cpu") == "cuda"
    assert dflash_ops.backend_for("rms_norm", "cpu") == "torch"
    _expect_unavailable("rope_", "cuda")
    dflash_ops.set_backend(None, ops=["rope_"])
    assert dflash_ops.backend_for("rope_", "cpu") == "torch"
    _call("rope_", CALLS["rope_"]())


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
@pytest.mark.parametrize("op", DESIGN_OPS + ["block_attention_out_"])
def test_design_op_exists(op):
    assert op in dispatch.ops(), f"{op} is not registered with the dispatcher"
    packet = getattr(torch.ops.dflash, op)
    assert packet.default._schema.name == f"dflash::{op}"
    assert callable(getattr(dflash_ops, op, None)) or op == "block_attention_out_", \
        f"dflash_ops.{op} wrapper missing"


def test_schema_table_covers_every_op():
    assert set(WRITES) == set(dispatch.ops()), "update WRITES for new/removed ops"


@pytest.mark.parametrize("op", sorted(WRITES))
def test_schema_alias_annotations(op):
    schema = getattr(torch.ops.dflash, op).default._schema
    written = set()
    for a in schema.arguments:
        if a.alias_info is not None:
            assert a.alias_info.is_write, f"{op}: {a.name} has a read-only alias annotation"
            written.add(a.name)
    assert written == WRITES[op], f"{op}: schema writes {sorted(written)}, expected " \
                                  f"{sorted(WRITES[op])}: {schema}"
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


# --------------------------------------------------------------------------- graph_backends
def test_graph_backends_applies_graph_table_to_cuda_only():
    from dflash_ops import dispatch

    before = {op: dflash_ops.backend_for(op, "cuda") for op in dispatch.ops()}
    x = torch.randn(3, 8, 64)
    w = torch.randn(64)
    with dflash_ops.graph_backends():
        for op, want in dispatch.GRAPH_CUDA.items():
            got = dflash_ops.backend_for(op, "cuda")
            if dispatch.has_backend(op, want):
                assert got == want, (op, got, want)
            else:  # the graph choice is not installed here: normal resolution, no error
                assert got == before[op], (op, got, before[op])
            assert dflash_ops.backend_for(op, "cpu") == "torch"
        # CPU calls keep running the reference inside the block
        y = torch.ops.dflash.rms_norm(x, w, 1e-6)
        with dflash_ops.use_backend("torch", ops=["rms_norm"]):  # an inner force still wins
            assert dflash_ops.backend_for("rms_norm", "cuda") == "torch"
    assert torch.equal(y, dflash_ops.ops.rms_norm_ref(x, w, 1e-6))
    assert {op: dflash_ops.backend_for(op, "cuda") for op in dispatch.ops()} == before


@pytest.mark.gpu
def test_cuda_extension_loaded_on_a_gpu_machine_with_nvcc():
    """The CUDA tests run only the backends present: a broken build must not turn them into a
    silent Triton/torch-only pass (seen on the H200, 2026-11-29: two csrc files with one object
    name broke the build and 321 GPU tests still passed)."""
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


_FMT = ("import torch, dflash_ops, sys; "
        "print('|'.join(torch.ops.dflash_probe.fmt_cpp(k) for k in range(3)))")


@pytest.mark.gpu
def test_extension_formats_numbers():
    """ostream << number inside dflash_ops._C (every TORCH_CHECK message with a number). It
    segfaulted on the H200, where the extension got a static libstdc++ whose symbols the
    process's libstdc++.so.6 interposed (setup.py: LINK_ARGS). In a subprocess, so a crash
    fails this test instead of the session."""
    from dflash_ops import _ext

    if _ext.load()["how"] == "absent":
        pytest.skip("no CUDA extension here")
    proc = subprocess.run([sys.executable, "-c", _FMT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "int64 42|double 1.5|ostringstream 42"
