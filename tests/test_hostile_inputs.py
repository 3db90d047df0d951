"""Hostile inputs: values a caller should not pass but the ops must survive as documented.

* ``block_attention``'s torch reference (the oracle) never lets NaN / inf in cache rows no query
  may see (past seq_len, in blocks the table does not reference) reach the output.
* The loop ops' torch references skip requests whose state row is outside ``[0, N)`` or whose
  ``n_out`` is negative (nothing written, guards around every tensor untouched) and reject
  sampled drafts outside the vocabulary; ``DFLASH_OPS_DEBUG=1`` makes the rows an error.
* The Python checks (torch and Triton backends) reject index tensors the Triton kernels read as
  flat arrays when they are strided, and 2-D rms_norm weights whose rows are not contiguous.
* The Triton ``block_attention`` wrapper runs a window longer than any key span as no window
  (a window of 2^31 - 1 overflowed the kernel's int32 bounds and hid every key).
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted

from dflash_ops import dispatch
from dflash_ops.ops import attention as A
from dflash_ops.ops import loop as L
from dflash_ops.ops import norm as N

INT_POISON = -(2 ** 40) - 3
LOOP_OPS = ("greedy_commit_", "sample_commit_", "prepare_step_")


# --------------------------------------------------------------------------------------------
# Guard memory
# --------------------------------------------------------------------------------------------
class Guarded:
    """A copy of ``t`` as a view into a larger buffer filled with ``poison`` (``pad`` elements
    before and after it in every dim, or only in the first with ``contiguous``: the view is
    then contiguous). ``check()`` asserts that the guard elements around it are unchanged."""

    def __init__(self, t: torch.Tensor, poison, pad: int = 3, contiguous: bool = False):
        pads = [pad if i == 0 or not contiguous else 0 for i in range(t.dim())]
        self.buf = torch.full([s + 2 * p for s, p in zip(t.shape, pads)], poison, dtype=t.dtype,
                              device=t.device)
        self.poison = poison
        idx = tuple(slice(p, p + s) for s, p in zip(t.shape, pads))
        self.view = self.buf[idx]
        self.view.copy_(t)
        self.inside = torch.zeros(self.buf.shape, dtype=torch.bool, device=t.device)
        self.inside[idx] = True

    def check(self, name: str = "tensor") -> None:
        guards = self.buf[~self.inside]
        assert bool((guards == self.poison).all()), f"{name}: guard memory overwritten"


def guarded_args(kw: dict, names, contiguous: bool = False) -> dict:
    """kw with the named int64 tensors replaced by guarded views; the Guarded under '_g'."""
    kw = dict(kw)
    kw["_g"] = {n: Guarded(kw[n], INT_POISON, contiguous=contiguous) for n in names}
    for n, g in kw["_g"].items():
        kw[n] = g.view
    return kw


def check_guards(kw: dict) -> None:
    for n, g in kw["_g"].items():
        g.check(n)


STATE = ("n_out", "start", "last", "out_tokens")


def run_commit(op: str, kw: dict, backend: str = "torch"):
    args = {k: v for k, v in kw.items() if k != "_g"}
    with dispatch.use_backend(backend, ops=LOOP_OPS):
        getattr(torch.ops.dflash, op).default(*args.values())
    return args


def commit_case(op: str, device="cpu"):
    mk = L._greedy_sample if op == "greedy_commit_" else L._sample_sample
    return mk(7, device)


# --------------------------------------------------------------------------------------------
# 1. block_attention reference: invisible keys never reach the output
# --------------------------------------------------------------------------------------------
def poison_invisible(kw: dict, value: float) -> dict:
    """kw with every cache row that no query may read (past seq_len, or in a block the table
    does not hold within seq_len) set to ``value`` in both caches."""
    kc, vc = kw["k_cache"].clone(), kw["v_cache"].clone()
    nb, bs = kc.shape[:2]
    seen = torch.zeros(nb, bs, dtype=torch.bool)
    for b, n in enumerate(kw["seq_lens"].tolist()):
        for j in range(n):
            blk = int(kw["block_table"][b, j // bs])
            if 0 <= blk < nb:  # an id outside [0, num_blocks) hides its keys
                seen[blk, j % bs] = True
    kc[~seen] = value
    vc[~seen] = value
    return dict(kw, k_cache=kc, v_cache=vc)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("case", list(A.samples("cpu", torch.float32)["block_attention"]))
def test_attention_reference_ignores_invisible_nan(case, value):
    kw = A.samples("cpu", torch.float32)["block_attention"][case]
    want = A.block_attention_ref(**kw)
    hostile = poison_invisible(kw, value)
    assert bool(torch.isfinite(want).all())
    got = A.block_attention_ref(**hostile)
    assert torch.equal(got, want), f"{case}: invisible {value} changed the output"
    with dispatch.use_backend("torch", ops=("block_attention",)):
        assert torch.equal(A.block_attention(**hostile), want)


def test_attention_reference_ignores_nan_in_unreferenced_and_bad_blocks():
    kw = dict(A.samples("cpu", torch.float32)["block_attention"]["noncausal"])
    table = kw["block_table"].clone()
    table[1, 2] = -1  # past request 1's 3 keys: unused
    table[2, 2] = 99  # within request 2's 12 keys: an id outside [0, num_blocks) hides them
    kw["block_table"] = table
    want = A.block_attention_ref(**kw)
    assert bool(torch.isfinite(want).all())
    got = A.block_attention_ref(**poison_invisible(kw, float("nan")))
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# 2. Loop ops: out-of-range rows / counts / drafts skipped, guards intact (every backend:
#    torch here, Triton under the interpreter below and on the GPU in section 5)
# --------------------------------------------------------------------------------------------
BAD_ROWS = ("minus-one", "N", "huge", "n_out-negative")
COMMIT_CASES = [(op, bad) for op in ("greedy_commit_", "sample_commit_") for bad in BAD_ROWS]
PREPARE_CASES = ("minus-one", "N", "huge")


def _bad_row(bad: str, n: int) -> int:
    return {"minus-one": -1, "N": n, "huge": 2 ** 40}[bad]


def check_commit_rows(op: str, bad: str, backend: str = "torch", device="cpu") -> None:
    """A request with a row outside [0, N) or a negative n_out commits nothing; the others
    commit as they would alone; guard memory around the state tensors is untouched."""
    kw = commit_case(op, device)
    n = kw["n_out"].shape[0]
    rows = kw["rows"].clone()
    r_bad = 1
    if bad != "n_out-negative":
        rows[r_bad] = _bad_row(bad, n)
    kw["rows"] = rows
    if bad == "n_out-negative":
        kw["n_out"] = kw["n_out"].clone()
        kw["n_out"][rows[r_bad]] = -3
    # what the valid requests do alone
    keep = [i for i in range(rows.shape[0]) if i != r_bad]
    alone = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    for k in ("block", "post", "p", "q", "u", "u_res", "rows", "kept", "done", "ctx_pos"):
        if k in alone:
            alone[k] = alone[k][keep].contiguous()
    alone = run_commit(op, alone, backend)

    hostile = guarded_args(kw, STATE)
    before = {k: hostile[k].clone() for k in STATE}
    got = run_commit(op, hostile, backend)
    check_guards(hostile)
    what = f"{op}[{backend}] {bad}"
    assert int(got["kept"][r_bad]) == 0 and not bool(got["done"][r_bad]), what
    assert bool((got["ctx_pos"][r_bad] == -1).all()), what
    for k in ("kept", "done", "ctx_pos"):
        assert torch.equal(got[k][keep], alone[k]), f"{what}: {k}"
    for k in STATE:  # the valid requests' updates and nothing else
        assert torch.equal(got[k], alone[k]), f"{what}: {k}"
    if bad == "n_out-negative":
        assert torch.equal(got["out_tokens"][rows[r_bad]], before["out_tokens"][rows[r_bad]])
    else:  # negative indexing would have updated row N - 1
        assert torch.equal(got["n_out"][n - 1], alone["n_out"][n - 1]), what


def check_sample_oov(backend: str = "torch", device="cpu") -> None:
    """Sampled drafts outside the vocabulary are rejected (their probabilities never read)."""
    kw = L._sample_sample(11, device, r=3, b=4, vocab=40, max_new=30)
    kw["q"] = kw["p"][:, :-1].clone()  # q == p: every in-vocabulary draft is accepted
    kw["u"] = torch.zeros_like(kw["u"])
    kw["n_out"] = torch.zeros_like(kw["n_out"])
    kw["stop_ids"] = kw["stop_ids"][:0]
    v = kw["p"].shape[-1]
    block = kw["block"].clone()
    block[0, 2] = v  # draft 2 of request 0: one past the vocabulary
    block[1, 1] = -1  # draft 1 of request 1
    block[2, 3] = 10 ** 9  # the last draft of request 2
    kw["block"] = block
    hostile = guarded_args(kw, STATE)
    got = run_commit("sample_commit_", hostile, backend)
    check_guards(hostile)
    # accepted drafts stop before the bad one; the token drawn there is in the vocabulary
    assert got["kept"].tolist() == [2, 1, 3], (backend, got["kept"].tolist())
    rows = got["rows"]
    for i in range(3):
        toks = got["out_tokens"][rows[i], :int(got["kept"][i])]
        assert bool(((toks >= 0) & (toks < v)).all()), (backend, toks)
        assert torch.equal(toks[:-1], block[i, 1:int(got["kept"][i])]), backend


def check_prepare_rows(bad: str, backend: str = "torch", device="cpu") -> None:
    """A prepare_step_ row outside [0, N) gets the padding entry; guards intact."""
    kw = L._prepare_sample(4, device)
    n = kw["last"].shape[0]
    kw["rows"] = kw["rows"].clone()
    kw["rows"][1] = _bad_row(bad, n)
    outs = ("block_out", "requests_out", "start_out", "ctx_req_out", "ctx_pos_out")
    hostile = guarded_args(kw, outs + ("last", "start"), contiguous=True)
    args = {k: v for k, v in hostile.items() if k != "_g"}
    with dispatch.use_backend(backend, ops=LOOP_OPS):
        torch.ops.dflash.prepare_step_.default(*args.values())
    check_guards(hostile)
    fill, scratch = kw["fill_id"], kw["scratch"]
    assert bool((args["block_out"][1] == fill).all()), (backend, bad)
    assert int(args["requests_out"][1]) == scratch and int(args["start_out"][1]) == 0
    for i in (0, 2):  # the valid rows as the contract says
        row = int(kw["rows"][i])
        assert int(args["block_out"][i, 0]) == int(kw["last"][row]), (backend, bad)
        assert torch.equal(args["block_out"][i, 1:], kw["drafts"][i]), (backend, bad)
        assert int(args["requests_out"][i]) == row
        assert int(args["start_out"][i]) == int(kw["start"][row])


@pytest.mark.parametrize("op,bad", COMMIT_CASES)
def test_commit_skips_out_of_range_rows(op, bad):
    check_commit_rows(op, bad)


def test_sample_commit_rejects_out_of_vocab_drafts():
    check_sample_oov()


@pytest.mark.parametrize("bad", PREPARE_CASES)
def test_prepare_step_skips_out_of_range_rows(bad):
    check_prepare_rows(bad)


@pytest.mark.parametrize("op,bad", [(op, bad) for op in LOOP_OPS
                                    for bad in ("minus-one", "N", "n_out-negative", "duplicate")
                                    if op != "prepare_step_"
                                    or bad not in ("n_out-negative", "duplicate")])
def test_debug_rejects_out_of_range_rows(op, bad, monkeypatch):
    if op == "prepare_step_":
        kw = L._prepare_sample(4, "cpu")
        n = kw["last"].shape[0]
    else:
        kw = commit_case(op)
        n = kw["n_out"].shape[0]
    kw["rows"] = kw["rows"].clone()
    if bad == "n_out-negative":
        kw["n_out"] = kw["n_out"].clone()
        kw["n_out"][kw["rows"][0]] = -1
    elif bad == "duplicate":  # two requests committing into one state slot
        kw["rows"][1] = kw["rows"][0]
    else:
        kw["rows"][0] = -1 if bad == "minus-one" else n
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "1")
    with dispatch.use_backend("torch", ops=LOOP_OPS):
        with pytest.raises(ValueError, match=f"dflash.{op}: (rows|n_out) must"):
            getattr(torch.ops.dflash, op).default(*kw.values())
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "0")
    with dispatch.use_backend("torch", ops=LOOP_OPS):  # without debug: skipped, no error
        getattr(torch.ops.dflash, op).default(*kw.values())


# --------------------------------------------------------------------------------------------
# 3. Checks: strided index tensors and non-contiguous 2-D norm weights
# --------------------------------------------------------------------------------------------
def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values as a view with stride 2 (every other element of a wider buffer)."""
    wide = torch.zeros(t.shape[0] * 2, *t.shape[1:], dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


def _attn_bad():
    kw = dict(A.samples("cpu", torch.float32)["block_attention"]["causal-sinks"])
    return {
        "query_start_loc": dict(kw, query_start_loc=_strided(kw["query_start_loc"])),
        "seq_lens": dict(kw, seq_lens=_strided(kw["seq_lens"])),
        "sinks": dict(kw, sinks=_strided(kw["sinks"])),
        "block_table": dict(kw, block_table=kw["block_table"].t().contiguous().t()),
    }


def _norm_bad():
    x = torch.randn(4, 3, 2, 32)
    wide = torch.randn(3, 48)
    return {"w[:, :D]": dict(x=x, weight=wide[:, :32], eps=1e-6),
            "w.expand(G, D)": dict(x=x, weight=torch.randn(32).expand(3, 32), eps=1e-6)}


@pytest.mark.parametrize("name", list(_attn_bad()))
@pytest.mark.parametrize("op", ["block_attention", "block_attention_out_"])
def test_attention_check_rejects_strided_index_tensors(name, op):
    kw = _attn_bad()[name]
    assert not kw[name].is_contiguous()
    if op == "block_attention_out_":
        kw = dict(kw, out=torch.zeros_like(kw["q"]))
    with dispatch.use_backend("torch", ops=(op,)):
        with pytest.raises(ValueError, match=f"dflash.{op}: {name} must be contiguous"):
            A.block_attention(**kw)  # with ``out``: block_attention_out_


def test_attention_check_accepts_row_strided_block_table():
    # a row-major slice of a wider table: unit column stride, any row stride
    kw = dict(A.samples("cpu", torch.float32)["block_attention"]["noncausal"])
    wide = torch.full((3, 5), -1, dtype=torch.int32)
    wide[:, :3] = kw["block_table"]
    want = A.block_attention_ref(**kw)
    with dispatch.use_backend("torch", ops=("block_attention",)):
        assert torch.equal(A.block_attention(**dict(kw, block_table=wide[:, :3])), want)


@pytest.mark.parametrize("name", list(_norm_bad()))
def test_rms_norm_check_rejects_non_contiguous_2d_weight(name):
    kw = _norm_bad()[name]
    with dispatch.use_backend("torch", ops=("rms_norm", "fused_add_rms_norm_")):
        with pytest.raises(ValueError, match="dflash.rms_norm: weight must be contiguous"):
            N.rms_norm(**kw)
        with pytest.raises(ValueError,
                           match="dflash.fused_add_rms_norm_: weight must be contiguous"):
            N.fused_add_rms_norm_(kw["x"].clone(), kw["x"].clone(), kw["weight"], kw["eps"])
    # the same weight made contiguous is accepted: the check is about the layout only
    with dispatch.use_backend("torch", ops=("rms_norm",)):
        N.rms_norm(kw["x"], kw["weight"].contiguous(), kw["eps"])


_TRITON_CHECKS = r"""
import torch, triton
from dflash_ops import dispatch
from dflash_ops.ops import attention as A, norm as N
from tests.test_hostile_inputs import _attn_bad, _norm_bad
for name, kw in _attn_bad().items():
    with dispatch.use_backend("triton", ops=("block_attention",)):
        try:
            A.block_attention(**kw)
        except ValueError as e:
            assert f"{name} must be contiguous" in str(e), e
        else:
            raise AssertionError(f"triton block_attention accepted a strided {name}")
for name, kw in _norm_bad().items():
    with dispatch.use_backend("triton", ops=("rms_norm",)):
        try:
            N.rms_norm(**kw)
        except ValueError as e:
            assert "weight must be contiguous" in str(e), e
        else:
            raise AssertionError(f"triton rms_norm accepted {name}")
print("interp-ok")
"""


def test_triton_checks_reject_strided_inputs_interpreted():
    run_interpreted(_TRITON_CHECKS, timeout=300)


# --------------------------------------------------------------------------------------------
# 4. Triton block_attention: a window longer than every key span is no window
# --------------------------------------------------------------------------------------------
_TRITON_WINDOW = r"""
import torch, triton
from dflash_ops import dispatch
from dflash_ops.ops import attention as A
kw = dict(A.samples("cpu", torch.float32)["block_attention"]["noncausal"])
with dispatch.use_backend("triton", ops=("block_attention",)):
    none = A.block_attention(**dict(kw, window=-1))
    assert bool((none.abs().sum(-1) > 0).all()), "no-window output has zero rows"
    for causal in (False, True):
        base = A.block_attention(**dict(kw, causal=causal, window=-1))
        for w in (2 ** 31 - 1, 2 ** 31 - 64, 12 + 8, 10 ** 6):
            got = A.block_attention(**dict(kw, causal=causal, window=w))
            assert torch.equal(got, base), (causal, w, got.abs().max())
            ref = A.block_attention_ref(**dict(kw, causal=causal, window=w))
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (causal, w)
print("interp-ok")
"""


def test_triton_attention_huge_window_interpreted():
    run_interpreted(_TRITON_WINDOW, timeout=300)


# --------------------------------------------------------------------------------------------
# 5. block_attention: query_start_loc holding anything (3 requests, Tq = 8)
# --------------------------------------------------------------------------------------------
HOSTILE_QSL = {
    "past-Tq": [0, 3, 4, 12],  # the last request's rows run past Tq
    "past-Tq-mid": [0, 5, 11, 12],  # request 1 ends past Tq, request 2 owns no row
    "negative": [-3, 2, 4, 8],  # request 0 starts before row 0
    "huge": [0, 3, 4, 2 ** 31 - 1],
    "huge-negative": [-(2 ** 31), 3, 4, 8],
    "all-past": [9, 9, 9, 9],  # no request owns a row: all zeros
    "non-monotone": [0, 6, 2, 8],  # requests 0 and 2 both claim rows 2..5: guards only
}
OUT_POISON = 1234.0  # exact in fp16 / bf16 / fp32


def check_attention_qsl(name: str, backend: str, device="cpu", dtype=torch.float32) -> None:
    """Every sample case (causal, window, sinks, GQA) with query_start_loc = HOSTILE_QSL[name]:
    no write outside ``out`` (guard rows before and after it), and the output equals the torch
    reference's (rows cut to [0, Tq), positions from the unclamped lengths), except for
    overlapping requests, whose rows two requests write."""
    from dflash_ops.triton import attention as TA  # only for the direct split calls

    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: 1 ulp near 1 is 7.8e-3
    for case, kw in A.samples(device, dtype)["block_attention"].items():
        kw = dict(kw, query_start_loc=torch.tensor(HOSTILE_QSL[name], dtype=torch.int32,
                                                   device=device))
        with dispatch.use_backend("torch", ops=("block_attention",)):
            want = A.block_attention(**kw)
        calls = [None]
        if backend == "triton":  # the split path and its combine kernel too
            calls.append(2)
        for splits in calls:
            out = Guarded(torch.zeros_like(kw["q"]), OUT_POISON, contiguous=True)
            if splits is None:
                with dispatch.use_backend(backend, ops=("block_attention_out_",)):
                    A.block_attention(**kw, out=out.view)
            else:
                TA.block_attention_out_(**kw, out=out.view, splits=splits)
            what = f"block_attention[{backend}] {case} qsl={name} splits={splits}"
            out.check(what)
            got = out.view
            assert bool(torch.isfinite(got).all()), what
            if name != "non-monotone":
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                           msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(HOSTILE_QSL))
def test_attention_hostile_query_start_loc(name):
    check_attention_qsl(name, "torch")


# --------------------------------------------------------------------------------------------
# 6. The same cases on the Triton kernels (interpreter) and on the GPU (Triton, CUDA)
# --------------------------------------------------------------------------------------------
_TRITON_HOSTILE = r"""
import torch, triton
import tests.test_hostile_inputs as h
for op, bad in h.COMMIT_CASES:
    h.check_commit_rows(op, bad, "triton")
h.check_sample_oov("triton")
for bad in h.PREPARE_CASES:
    h.check_prepare_rows(bad, "triton")
for name in h.HOSTILE_QSL:
    h.check_attention_qsl(name, "triton")
print("interp-ok")
"""


def test_triton_hostile_values_interpreted():
    run_interpreted(_TRITON_HOSTILE, timeout=900)


def _need(op: str, backend: str) -> None:
    if not dispatch.has_backend(op, backend):
        pytest.skip(f"no {backend} kernel for {op} (available: "
                    f"{dispatch.available_backends(op)})")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_loop_hostile_values_gpu(backend):
    for op in LOOP_OPS:
        _need(op, backend)
    for op, bad in COMMIT_CASES:
        check_commit_rows(op, bad, backend, "cuda")
    check_sample_oov(backend, "cuda")
    for bad in PREPARE_CASES:
        check_prepare_rows(bad, backend, "cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_attention_hostile_query_start_loc_gpu(backend, dtype):
    _need("block_attention_out_", backend)
    for name in HOSTILE_QSL:
        check_attention_qsl(name, backend, "cuda", dtype)
    torch.cuda.synchronize()
