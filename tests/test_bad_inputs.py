"""Bad inputs to every ``torch.ops.dflash.*`` op raise before anything is written.

Bad input (wrong rank, dtype, device, head_dim, mismatched lengths) raises a
ValueError/RuntimeError naming the argument, before any kernel runs. Each case starts from a
valid call (the op's first sample case), breaks one argument (the cases of its family's
``bad_samples()``, plus for every op a dtype break of each tensor argument and a device break of
each but the first, generated from its sample), and checks (1) the error type, (2) that the
message names the op and the offending argument, (3) that every argument the schema marks
``(a!)`` (outputs, caches) is bit-for-bit unchanged. A device mismatch is made with the ``meta``
device so it can be tested on CPU-only machines.

Out-of-range device values and degenerate sizes: tests/test_out_of_range_inputs.py.
"""
from __future__ import annotations

import re

import pytest
import torch

import dflash_ops  # noqa: F401  (defines torch.ops.dflash.*)
from dflash_ops import dispatch
from dflash_ops.ops import bad_samples, samples
from dflash_ops.ops._samples import META, item, set_, strided_last

ERRORS = (ValueError, RuntimeError)
F32, I32 = torch.float32, torch.int32


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    """Every test starts without debug checks, with the default backend choice."""
    monkeypatch.delenv("DFLASH_OPS_DEBUG", raising=False)


# --------------------------------------------------------------------------------------------
# A valid call for each op: the first case of its sample table, keyword arguments named as in
# the schema.
# --------------------------------------------------------------------------------------------
def base(op):
    return dict(next(iter(samples("cpu", F32)[op].values())))


def _written_args(op):
    return dispatch.ops()[op].written


def _snapshot(kw, names):
    snap = {}
    for n in names:
        v = kw[n]
        if isinstance(v, torch.Tensor):
            v = [v]
        snap[n] = [(t, t.clone()) for t in v if t.device.type != "meta"]
    return snap


def _assert_untouched(snap, what):
    for n, pairs in snap.items():
        for i, (t, before) in enumerate(pairs):
            assert torch.equal(t, before), f"{what}: {n}[{i}] was written before the error"


def _call(op, kw):
    return getattr(torch.ops.dflash, op).default(**kw)


def _names(msg, arg):
    return re.search(rf"(?<![\w.]){re.escape(arg)}(?!\w)", msg) is not None


def _expect_error(op, kw, arg, what):
    snap = _snapshot(kw, _written_args(op))
    with pytest.raises(ERRORS) as info:
        _call(op, kw)
    msg = str(info.value)
    assert not isinstance(info.value, dispatch.BackendUnavailableError), msg
    assert _names(msg, arg), f"{what}: error does not name {arg!r}: {msg}"
    assert op in msg, f"{what}: error does not name the op {op!r}: {msg}"
    _assert_untouched(snap, what)
    return msg


def _hidden_rms_params():
    return [pytest.param(mutate, arg, id=cid) for cid, mutate, arg in
            bad_samples()["context_kv_"] if cid.startswith("hidden_rms")]


@pytest.mark.parametrize("mutate, arg", _hidden_rms_params())
def test_context_kv_hidden_rms_error_is_one_line(mutate, arg):
    """context_kv_ with hidden_rms=True (or asked for beside a hidden_norm weight) and one
    argument broken: a one-line error that starts with the op and the argument."""
    kw = base("context_kv_")
    mutate(kw)
    assert kw["hidden_rms"] is True
    msg = _expect_error("context_kv_", kw, arg, "context_kv_ hidden_rms")
    assert "\n" not in msg and msg.startswith(f"dflash.context_kv_: {arg} "), msg


def _tensor_args(kw):
    """(name, name as an error names it, list index or None) of every non-empty tensor argument
    (empty tensors stand for absent arguments in some schemas)."""
    out = []
    for name, v in kw.items():
        if isinstance(v, torch.Tensor) and v.numel():
            out.append((name, name, None))
        elif isinstance(v, list):
            out.extend((name, f"{name}[{i}]", i) for i, t in enumerate(v) if t.numel())
    return out


def _change(name, index, fn):
    return item(name, index, fn) if index is not None else set_(**{name: lambda kw: fn(kw[name])})


def generated_cases(op):
    """Breaks every op gets from its first sample case: each tensor argument in a dtype of the
    other kind (floating <-> integer), and each but the first on another device."""
    cases = []
    for k, (name, shown, index) in enumerate(_tensor_args(base(op))):
        t = base(op)[name] if index is None else base(op)[name][index]
        wrong = I32 if t.is_floating_point() else F32
        cases.append((f"{shown}-{str(wrong).replace('torch.', '')}",
                      _change(name, index, lambda x, w=wrong: x.to(w)), shown))
        if k:
            cases.append((f"{shown}-meta", _change(name, index, lambda x: x.to(META)), shown))
    return cases


def _params():
    cases = bad_samples()
    every = {op: cases.get(op, []) + generated_cases(op) for op in sorted(dispatch.ops())}
    return [pytest.param(op, mutate, arg, id=f"{op}-{cid}")
            for op, cases in every.items() for cid, mutate, arg in cases]


def test_every_op_has_samples_to_break():
    table = samples("cpu", F32)
    missing = [op for op in dispatch.ops() if not table.get(op)]
    assert not missing, f"ops without sample cases: {missing}"
    assert all(generated_cases(op) for op in dispatch.ops())
    cases = bad_samples()
    no_bad = [op for op in dispatch.ops() if not cases.get(op)]
    assert not no_bad, f"ops without bad_samples() cases in their family module: {no_bad}"
    unknown = sorted(set(cases) - set(dispatch.ops()))
    assert not unknown, f"bad_samples() cases for ops that are not defined: {unknown}"


@pytest.mark.parametrize("op", sorted(dispatch.ops()))
def test_valid_base_call_runs(op):
    """The starting point of every case is a valid call (so each error comes from the break)."""
    _call(op, base(op))


@pytest.mark.parametrize("op, mutate, arg", _params())
def test_bad_input_raises_naming_argument(op, mutate, arg):
    torch.manual_seed(0)
    kw = base(op)
    mutate(kw)
    _expect_error(op, kw, arg, op)


def _to_cuda(v, device="cuda", _moved=None):
    """kw with every CPU tensor (also inside lists) moved to ``device`` with its exact sizes,
    strides and storage offset (``.to()`` would make a strided view contiguous and lose the
    case), tensors that share a storage still sharing one (the overlap cases); meta tensors
    (the device mismatch cases) stay where they are."""
    moved = {} if _moved is None else _moved  # CPU storage address -> its device copy
    if isinstance(v, dict):
        return {k: _to_cuda(x, device, moved) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_to_cuda(x, device, moved) for x in v)
    if isinstance(v, torch.Tensor) and v.device.type == "cpu":
        store = v.untyped_storage()
        key = (store.data_ptr(), v.dtype)
        if key not in moved:
            flat = torch.empty(0, dtype=v.dtype).set_(store, 0,
                                                      (store.nbytes() // v.element_size(),))
            moved[key] = flat.to(device)
        return moved[key].as_strided(v.size(), v.stride(), v.storage_offset())
    return v


def test_to_cuda_keeps_strides():
    x = strided_last(4, 3, 64)[1:]
    y = _to_cuda({"x": [x]}, device="cpu")["x"][0]
    assert y.stride() == x.stride() and y.storage_offset() == x.storage_offset()
    assert torch.equal(y, x)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("op, mutate, arg", _params())
def test_bad_input_raises_naming_argument_gpu(op, mutate, arg, backend):
    """The same cases on CUDA tensors with each GPU backend forced: the C++ kernels validate in
    C++ (the dispatcher calls them directly), so their messages are checked here."""
    if not dispatch.has_backend(op, backend):
        pytest.skip(f"no {backend} kernel for {op}")
    torch.manual_seed(0)
    kw = base(op)
    mutate(kw)
    kw = _to_cuda(kw)
    with dflash_ops.use_backend(backend, ops=[op]):
        _expect_error(op, kw, arg, f"{op} [{backend}]")
