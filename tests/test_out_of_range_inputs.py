"""Out-of-range device values and degenerate sizes, starting from each op's first sample case.

``DFLASH_OPS_DEBUG=1`` turns out-of-range device values (slots, positions, block ids, lengths)
into errors naming them, without writing; without it those values are skipped/clamped as each
op documents. Degenerate sizes give the documented result or an error naming the argument.
"""
from __future__ import annotations

import pytest
import torch

from dflash_ops.ops.norm import rms_norm_ref
from dflash_ops.ops.rope import rope_values
from dflash_ops.ops._samples import EPS, P, rnd, set_
from tests.test_bad_inputs import (ERRORS, I32, _assert_untouched, _call, _expect_error, _names,
                                   _snapshot, _written_args, base)

I64 = torch.int64


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    """Every test starts without debug checks."""
    monkeypatch.delenv("DFLASH_OPS_DEBUG", raising=False)


# --------------------------------------------------------------------------------------------
# DFLASH_OPS_DEBUG=1: out-of-range device values become errors (nothing written); without it
# they are skipped as documented.
# --------------------------------------------------------------------------------------------
DEBUG_CASES = [
    ("store_kv_", "slot-past-cache", set_(slot_mapping=torch.tensor([0, 5, -1, 16, 3, 7])),
     "slot_mapping"),
    ("store_kv_", "slot-huge", set_(slot_mapping=torch.tensor([0, 5, -1, 2 ** 40, 3, 7])),
     "slot_mapping"),
    ("rope_", "position-past-table", set_(positions=torch.tensor([0, 1, P, 3, 4])), "positions"),
    ("rope_", "position-negative", set_(positions=torch.tensor([0, 1, 2, -3, 4])), "positions"),
    ("qk_norm_rope_", "position-past-table", set_(positions=torch.tensor([0, 1, 2, 3, 99])),
     "positions"),
    ("knorm_rope_", "position-past-table", set_(positions=torch.tensor([P + 5, 1, 2, 3, 4])),
     "positions"),
    ("context_kv_", "slot-past-cache", set_(slot_mapping=torch.tensor([3, -1, 0, 9, 16])),
     "slot_mapping"),
    ("context_kv_", "position-past-table", set_(positions=torch.tensor([3, 1, P, 9, 2])),
     "positions"),
    ("block_attention", "block-id-past-cache",
     set_(block_table=torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 10]], dtype=I32)), "block_table"),
    ("block_attention", "block-id-negative",
     set_(block_table=torch.tensor([[0, -1, 2], [3, 4, 5], [6, 7, 8]], dtype=I32)), "block_table"),
    ("block_attention", "seq_len-past-table",
     set_(seq_lens=torch.tensor([7, 3, 13], dtype=I32)), "seq_lens"),
    ("block_attention", "query_start_loc-past-Tq",
     set_(query_start_loc=torch.tensor([0, 3, 4, 9], dtype=I32)), "query_start_loc"),
    ("block_attention_out_", "block-id-past-cache",
     set_(block_table=torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 10]], dtype=I32)), "block_table"),
    ("block_attention_out_", "seq_len-negative",
     set_(seq_lens=torch.tensor([7, -1, 12], dtype=I32)), "seq_lens"),
]


def _debug_params():
    return [pytest.param(op, mutate, arg, id=f"{op}-{cid}") for op, cid, mutate, arg in DEBUG_CASES]


@pytest.mark.parametrize("op, mutate, arg", _debug_params())
def test_debug_mode_rejects_out_of_range_values(monkeypatch, op, mutate, arg):
    torch.manual_seed(0)
    kw = base(op)
    mutate(kw)
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "1")
    _expect_error(op, kw, arg, f"{op} (DFLASH_OPS_DEBUG=1)")


@pytest.mark.parametrize("op, mutate, arg", _debug_params())
def test_without_debug_out_of_range_values_do_not_raise(op, mutate, arg):
    torch.manual_seed(0)
    kw = base(op)
    mutate(kw)
    _call(op, kw)


def test_store_kv_skips_out_of_range_slot_without_debug():
    torch.manual_seed(0)
    kw = base("store_kv_")
    n = 4 * 4
    kw["slot_mapping"] = torch.tensor([0, 5, -1, n, 3, 2 ** 40], dtype=I64)
    before = [c.clone() for c in kw["k_caches"] + kw["v_caches"]]
    _call("store_kv_", kw)
    written = {0: 0, 5: 1, 3: 4}  # slot -> token
    for layer in range(2):
        for caches_, src, old in ((kw["k_caches"], kw["k"], before[:2]),
                                  (kw["v_caches"], kw["v"], before[2:])):
            flat, flat_old = caches_[layer].reshape(n, 2, 64), old[layer].reshape(n, 2, 64)
            for slot in range(n):
                want = src[written[slot], layer] if slot in written else flat_old[slot]
                assert torch.equal(flat[slot], want), f"layer {layer} slot {slot}"


def test_rope_leaves_out_of_range_position_unrotated_without_debug():
    torch.manual_seed(0)
    kw = base("rope_")
    kw["positions"] = torch.tensor([0, 5, P, -1, 7], dtype=I64)
    x0 = kw["x"].clone()
    _call("rope_", kw)
    for t in (2, 3):
        assert torch.equal(kw["x"][t], x0[t]), f"token {t} (out-of-range position) was changed"
    ok = torch.tensor([0, 1, 4])
    want = rope_values(x0[ok], kw["positions"][ok], kw["cos_sin_cache"], True)
    torch.testing.assert_close(kw["x"][ok], want)


def test_knorm_rope_norms_but_does_not_rotate_out_of_range_position_without_debug():
    torch.manual_seed(0)
    kw = base("knorm_rope_")
    kw["positions"] = torch.tensor([0, 5, 1000, 2, 7], dtype=I64)
    k0 = kw["k"].clone()
    _call("knorm_rope_", kw)
    normed = rms_norm_ref(k0, kw["k_weight"], EPS)
    torch.testing.assert_close(kw["k"][2], normed[2])


def test_block_attention_hides_out_of_range_block_without_debug():
    """Non-causal, one query: keys in a block id past the cache are invisible, so the result
    equals attention over the keys of the valid blocks alone."""
    torch.manual_seed(0)
    kw = base("block_attention")
    kw.update(causal=False, sinks=None, q=kw["q"][:1].clone(),
              block_table=torch.tensor([[2, 99, 5]], dtype=I32),
              seq_lens=torch.tensor([12], dtype=I32),
              query_start_loc=torch.tensor([0, 1], dtype=I32))
    got = _call("block_attention", kw)
    # the same keys laid out without the bad block: blocks 2 and 5 as keys [0, 8)
    kw2 = dict(kw, block_table=torch.tensor([[2, 5, 0]], dtype=I32),
               seq_lens=torch.tensor([8], dtype=I32))
    want = _call("block_attention", kw2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


def test_debug_check_runs_after_argument_validation(monkeypatch):
    """With DFLASH_OPS_DEBUG=1 a malformed argument still gets its own error, not a crash in the
    debug check (e.g. a wrong-rank slot_mapping)."""
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "1")
    kw = base("store_kv_")
    kw["slot_mapping"] = torch.tensor([[0, 1, 2, 3, 4, 5]])
    _expect_error("store_kv_", kw, "slot_mapping", "store_kv_ (debug)")


# --------------------------------------------------------------------------------------------
# Degenerate sizes: either the documented behaviour or a ValueError/RuntimeError naming the
# argument -- never an IndexError from deep inside a kernel, and nothing written.
# --------------------------------------------------------------------------------------------
def _degenerate(op, kw, arg, check_ok):
    snap = _snapshot(kw, _written_args(op))
    try:
        result = _call(op, kw)
    except ERRORS as e:
        assert _names(str(e), arg), f"{op}: error does not name {arg!r}: {e}"
        _assert_untouched(snap, op)
        return
    check_ok(kw, result, snap)


def test_rope_with_empty_cos_sin_table():
    """cos_sin_cache [0, R]: every position is outside [0, P), so tokens stay unrotated
    (documented), or the table is rejected by name."""
    kw = base("rope_")
    kw["cos_sin_cache"] = kw["cos_sin_cache"][:0]

    def ok(kw, _, snap):
        _assert_untouched(snap, "rope_ with P = 0 (tokens must stay unrotated)")
    _degenerate("rope_", kw, "cos_sin_cache", ok)


def test_store_kv_with_zero_layers():
    """k/v [T, 0, Hkv, D] with empty cache lists: nothing to write, or a named error."""
    kw = base("store_kv_")
    kw.update(k=rnd(6, 0, 2, 64), v=rnd(6, 0, 2, 64), k_caches=[], v_caches=[])
    _degenerate("store_kv_", kw, "k_caches", lambda *a: None)


@pytest.mark.parametrize("what", ["max_blocks=0", "num_blocks=0"])
def test_block_attention_without_any_valid_block(what):
    """block_table [B, 0] (seq_lens clamp to 0) or caches with no blocks (every id out of
    range): each query sees no key, so the output is zeros (documented), or a named error."""
    kw = base("block_attention")
    if what == "max_blocks=0":
        kw["block_table"], arg = kw["block_table"][:, :0].contiguous(), "block_table"
    else:
        kw["k_cache"], kw["v_cache"], arg = rnd(0, 4, 2, 64), rnd(0, 4, 2, 64), "k_cache"

    def ok(kw, out, _):
        assert torch.equal(out, torch.zeros_like(kw["q"]))
    _degenerate("block_attention", kw, arg, ok)


# --------------------------------------------------------------------------------------------
# Guard memory, every backend: the out-of-range cases above with every written tensor a view
# into a larger poisoned buffer; the guards stay intact and the results equal the torch
# reference's on the same inputs (torch here; Triton under the interpreter; Triton and CUDA on
# the GPU, where benchmarks/gpu_check.sh also runs them under compute-sanitizer).
# --------------------------------------------------------------------------------------------
GUARD_POISON = 1234.0  # exact in fp16 / bf16 / fp32


def _case_args(op, mutate, device, dtype):
    """The op's first sample case on ``device`` / ``dtype`` with ``mutate`` applied."""
    from dflash_ops.ops import samples
    kw = dict(next(iter(samples(device, dtype)[op].values())))
    mutate(kw)  # CPU index tensors

    def dev(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, (list, tuple)):
            return type(v)(dev(t) for t in v)
        return v
    return {k: dev(v) for k, v in kw.items()}


def _guard(kw, names):
    """kw with every written tensor (or list of them) as a guarded view; the Guarded list."""
    from tests.test_hostile_inputs import Guarded
    kw, guards = dict(kw), []
    for n in names:
        v = kw[n]
        many = isinstance(v, (list, tuple))
        gs = [Guarded(t, GUARD_POISON if t.is_floating_point() else -77, contiguous=True)
              for t in (v if many else [v])]
        guards += [(n, g) for g in gs]
        kw[n] = [g.view for g in gs] if many else gs[0].view
    return kw, guards


def _clone(kw):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else
                [t.clone() for t in v] if isinstance(v, (list, tuple)) else v)
            for k, v in kw.items()}


def check_guarded_out_of_range(op, cid, mutate, backend, device="cpu", dtype=torch.float32):
    from dflash_ops import dispatch as D
    kw = _case_args(op, mutate, device, dtype)
    written = list(_written_args(op))
    want_kw = _clone(kw)
    with D.use_backend("torch", ops=(op,)):
        want = _call(op, want_kw)
    got_kw, guards = _guard(_clone(kw), written)
    with D.use_backend(backend, ops=(op,)):
        got = _call(op, got_kw)
    what = f"{op}[{backend}] {cid} {dtype}"
    for n, g in guards:
        g.check(f"{what}: {n}")
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    pairs = [(want, got)] if isinstance(want, torch.Tensor) else []
    for n in written:
        w, g = want_kw[n], got_kw[n]
        pairs += list(zip(w, g)) if isinstance(w, (list, tuple)) else [(w, g)]
    for w, g in pairs:
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("op, mutate, arg", _debug_params())
def test_out_of_range_values_guarded_torch(op, mutate, arg):
    check_guarded_out_of_range(op, arg, mutate, "torch")


_TRITON_GUARDED = r"""
import torch, triton
from dflash_ops import dispatch
import tests.test_out_of_range_inputs as t
n = 0
for op, cid, mutate, arg in t.DEBUG_CASES:
    if dispatch.has_backend(op, "triton"):
        t.check_guarded_out_of_range(op, cid, mutate, "triton")
        n += 1
assert n == len(t.DEBUG_CASES), n
print("interp-ok")
"""


def test_out_of_range_values_guarded_triton_interpreted():
    from tests.conftest import run_interpreted
    run_interpreted(_TRITON_GUARDED, timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_out_of_range_values_guarded_gpu(backend, dtype):
    from dflash_ops import dispatch as D
    ran = 0
    for op, cid, mutate, arg in DEBUG_CASES:
        if D.has_backend(op, backend):
            check_guarded_out_of_range(op, cid, mutate, backend, "cuda", dtype)
            ran += 1
    assert ran, f"no {backend} kernel for any case"
    torch.cuda.synchronize()
