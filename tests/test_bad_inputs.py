"""Bad inputs to every ``torch.ops.dflash.*`` op raise before anything is written.

DESIGN.md: bad input (wrong rank, dtype, device, head_dim, mismatched lengths) raises a
ValueError/RuntimeError naming the argument, before any kernel runs. Each case below starts from
a valid call, breaks one argument, and checks (1) the error type, (2) that the message names the
op and the offending argument, (3) that every argument the schema marks ``(a!)`` (outputs,
caches) is bit-for-bit unchanged. A device mismatch is made with the ``meta`` device so it can be
tested on CPU-only machines.

``DFLASH_OPS_DEBUG=1`` turns out-of-range device values (slots, positions, block ids, lengths)
into errors naming them, again without writing; without it those values are skipped/clamped as
each op documents.
"""
from __future__ import annotations

import re

import pytest
import torch

import dflash_ops  # noqa: F401  (defines torch.ops.dflash.*)
from dflash_ops import dispatch
from dflash_ops.ops.norm import rms_norm_ref
from dflash_ops.ops.rope import make_cos_sin_cache, rope_values

ERRORS = (ValueError, RuntimeError)
EPS = 1e-6
P = 32
F32, BF16, I32, I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    """Every test starts without debug checks, with the default backend choice."""
    monkeypatch.delenv("DFLASH_OPS_DEBUG", raising=False)


def rnd(*shape, dtype=F32):
    return torch.randn(*shape).to(dtype)


def strided_last(*shape, dtype=F32):
    """A tensor of ``shape`` whose last dimension has stride 2."""
    return torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]


def cos_sin(rotary_dim=64, p=P):
    return make_cos_sin_cache(p, rotary_dim)


def caches(n_layers=2, nb=4, bs=4, hkv=2, d=64, dtype=F32):
    return [rnd(nb, bs, hkv, d, dtype=dtype) for _ in range(n_layers)]


def positions(t):
    return torch.randint(0, P, (t,), dtype=I64)


# --------------------------------------------------------------------------------------------
# A valid call for each op, as keyword arguments named as in the schema.
# --------------------------------------------------------------------------------------------
def base_rms_norm():
    return dict(x=rnd(4, 3, 64), weight=rnd(64), eps=EPS)


def base_fused_add():
    return dict(x=rnd(5, 64), residual=rnd(5, 64), weight=rnd(64), eps=EPS)


def base_rope():
    return dict(x=rnd(5, 4, 64), positions=positions(5), cos_sin_cache=cos_sin(), is_neox=True)


def base_qk():
    qkv = rnd(5, 12, 64)
    return dict(q=qkv[:, :8], k=qkv[:, 8:10], q_weight=rnd(64), k_weight=rnd(64),
                positions=positions(5), cos_sin_cache=cos_sin(), eps=EPS, is_neox=True)


def base_knorm():
    return dict(k=rnd(5, 3, 2, 2, 64)[:, :, 0], k_weight=rnd(3, 64), positions=positions(5),
                cos_sin_cache=cos_sin(), eps=EPS, is_neox=False)


def base_store():
    return dict(k=rnd(6, 2, 2, 64), v=rnd(6, 2, 2, 64), k_caches=caches(), v_caches=caches(),
                slot_mapping=torch.tensor([0, 5, -1, 14, 3, 7], dtype=I64))


def base_proj():
    return dict(x=rnd(5, 32), w_kv=rnd(64, 32), bias=rnd(64))


def base_context(d=64):
    n_layers, hkv = 2, 2
    return dict(x=rnd(5, 32), w_kv=rnd(n_layers * 2 * hkv * d, 32), bias=rnd(n_layers * 2 * hkv * d),
                k_weight=rnd(n_layers, d), positions=positions(5), cos_sin_cache=cos_sin(),
                slot_mapping=torch.tensor([3, -1, 0, 9, 15], dtype=I64),
                k_caches=caches(n_layers, d=d), v_caches=caches(n_layers, d=d), eps=EPS,
                is_neox=True, hidden_norm_weight=rnd(32))


def base_attn(d=64, hq=4, hkv=2):
    # three requests, q_lens 3/1/4, seq_lens 7/3/12, block_size 4, 3 blocks each
    return dict(q=rnd(8, hq, d), k_cache=rnd(10, 4, hkv, d), v_cache=rnd(10, 4, hkv, d),
                block_table=torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=I32),
                seq_lens=torch.tensor([7, 3, 12], dtype=I32),
                query_start_loc=torch.tensor([0, 3, 4, 8], dtype=I32), scale=d ** -0.5,
                causal=True, window=-1, sinks=torch.randn(hq))


def base_attn_out():
    kw = base_attn()
    kw["out"] = torch.zeros_like(kw["q"])
    return kw


def base_silu_mul():
    return dict(x=rnd(5, 3, 2 * 32))


BASES = {
    "rms_norm": base_rms_norm,
    "fused_add_rms_norm_": base_fused_add,
    "rope_": base_rope,
    "qk_norm_rope_": base_qk,
    "knorm_rope_": base_knorm,
    "store_kv_": base_store,
    "kv_proj": base_proj,
    "context_kv_": base_context,
    "block_attention": base_attn,
    "block_attention_out_": base_attn_out,
    "silu_mul": base_silu_mul,
}


# --------------------------------------------------------------------------------------------
# Breaking one argument: set(name=value or fn(kw) -> value, ...)
# --------------------------------------------------------------------------------------------
def set_(**changes):
    def mutate(kw):
        for name, val in changes.items():
            kw[name] = val(kw) if callable(val) else val
    return mutate


def to(name, *, dtype=None, device=None):
    return set_(**{name: lambda kw: kw[name].to(dtype=dtype, device=device)})


def item(name, i, val):
    """Replace element i of the list argument ``name``."""
    def mutate(kw):
        lst = list(kw[name])
        lst[i] = val(lst[i]) if callable(val) else val
        kw[name] = lst
    return mutate


def both(*mutations):
    def mutate(kw):
        for m in mutations:
            m(kw)
    return mutate


META = "meta"

CASES = {
    "rms_norm": [
        ("x-int", to("x", dtype=I32), "x"),
        ("x-0d", set_(x=torch.tensor(1.0)), "x"),
        ("x-last-stride", set_(x=strided_last(4, 3, 64)), "x"),
        ("weight-bf16", to("weight", dtype=BF16), "weight"),
        ("weight-int", to("weight", dtype=I32), "weight"),
        ("weight-rank3", set_(weight=rnd(1, 3, 64)), "weight"),
        ("weight-cols", set_(weight=rnd(32)), "weight"),
        ("weight2d-x2d", set_(x=rnd(4, 64), weight=rnd(2, 64)), "weight"),
        ("weight2d-groups", set_(weight=rnd(2, 64)), "weight"),
        ("weight-meta", to("weight", device=META), "weight"),
        ("eps-negative", set_(eps=-1.0), "eps"),
    ],
    "fused_add_rms_norm_": [
        ("x-int", both(to("x", dtype=I32), to("residual", dtype=I32), to("weight", dtype=I32)), "x"),
        ("residual-shape", set_(residual=rnd(4, 64)), "residual"),
        ("residual-bf16", to("residual", dtype=BF16), "residual"),
        ("residual-meta", to("residual", device=META), "residual"),
        ("residual-last-stride", set_(residual=strided_last(5, 64)), "residual"),
        ("weight-bf16", to("weight", dtype=BF16), "weight"),
        ("weight-cols", set_(weight=rnd(32)), "weight"),
        ("weight-meta", to("weight", device=META), "weight"),
        ("eps-negative", set_(eps=-1.0), "eps"),
    ],
    "rope_": [
        ("x-rank2", set_(x=rnd(5, 64)), "x"),
        ("x-rank4", set_(x=rnd(5, 1, 4, 64)), "x"),
        ("x-int", to("x", dtype=I32), "x"),
        ("x-head_dim-96", set_(x=rnd(5, 4, 96)), "x"),
        ("x-head_dim-48", set_(x=rnd(5, 4, 48)), "x"),
        ("x-last-stride", set_(x=strided_last(5, 4, 64)), "x"),
        ("positions-int32", to("positions", dtype=I32), "positions"),
        ("positions-float", to("positions", dtype=F32), "positions"),
        ("positions-len", set_(positions=positions(4)), "positions"),
        ("positions-rank2", set_(positions=lambda kw: kw["positions"].view(5, 1)), "positions"),
        ("positions-meta", to("positions", device=META), "positions"),
        ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 33)), "cos_sin_cache"),
        ("cache-zero-cols", set_(cos_sin_cache=rnd(P, 0)), "cos_sin_cache"),
        ("cache-too-many-cols", set_(cos_sin_cache=cos_sin(128)), "cos_sin_cache"),
        ("cache-bf16", to("cos_sin_cache", dtype=BF16), "cos_sin_cache"),
        ("cache-rank1", set_(cos_sin_cache=rnd(64)), "cos_sin_cache"),
        ("cache-meta", to("cos_sin_cache", device=META), "cos_sin_cache"),
    ],
    "qk_norm_rope_": [
        ("q-rank2", set_(q=rnd(5, 64)), "q"),
        ("q-int", to("q", dtype=I32), "q"),
        ("q-head_dim-96", set_(q=rnd(5, 8, 96), k=rnd(5, 2, 96), q_weight=rnd(96),
                                k_weight=rnd(96)), "q"),
        ("q-last-stride", set_(q=strided_last(5, 8, 64)), "q"),
        ("k-head_dim-differs", set_(k=rnd(5, 2, 32)), "k"),
        ("k-T-differs", set_(k=rnd(4, 2, 64)), "k"),
        ("k-rank4", set_(k=rnd(5, 1, 2, 64)), "k"),
        ("k-bf16", to("k", dtype=BF16), "k"),
        ("k-meta", to("k", device=META), "k"),
        ("q_weight-shape", set_(q_weight=rnd(32)), "q_weight"),
        ("q_weight-bf16", to("q_weight", dtype=BF16), "q_weight"),
        ("k_weight-shape", set_(k_weight=rnd(2, 64)), "k_weight"),
        ("k_weight-meta", to("k_weight", device=META), "k_weight"),
        ("positions-len", set_(positions=positions(6)), "positions"),
        ("positions-int32", to("positions", dtype=I32), "positions"),
        ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 31)), "cos_sin_cache"),
        ("cache-too-many-cols", set_(cos_sin_cache=cos_sin(66)), "cos_sin_cache"),
        ("cache-fp16", to("cos_sin_cache", dtype=torch.float16), "cos_sin_cache"),
        ("eps-negative", set_(eps=-1.0), "eps"),
    ],
    "knorm_rope_": [
        ("k-rank3", set_(k=rnd(5, 2, 64)), "k"),
        ("k-int", to("k", dtype=I32), "k"),
        ("k-head_dim-48", set_(k=rnd(5, 3, 2, 48), k_weight=rnd(3, 48)), "k"),
        ("k-head_dim-96", set_(k=rnd(5, 3, 2, 96), k_weight=rnd(3, 96)), "k"),
        ("k-last-stride", set_(k=strided_last(5, 3, 2, 64)), "k"),
        ("k_weight-layers", set_(k_weight=rnd(2, 64)), "k_weight"),
        ("k_weight-1d", set_(k_weight=rnd(64)), "k_weight"),
        ("k_weight-bf16", to("k_weight", dtype=BF16), "k_weight"),
        ("k_weight-meta", to("k_weight", device=META), "k_weight"),
        ("positions-len", set_(positions=positions(4)), "positions"),
        ("positions-int32", to("positions", dtype=I32), "positions"),
        ("positions-meta", to("positions", device=META), "positions"),
        ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 63)), "cos_sin_cache"),
        ("cache-too-many-cols", set_(cos_sin_cache=cos_sin(128)), "cos_sin_cache"),
        ("cache-bf16", to("cos_sin_cache", dtype=BF16), "cos_sin_cache"),
        ("eps-negative", set_(eps=-1e-3), "eps"),
    ],
    "store_kv_": [
        ("k-rank3", set_(k=rnd(6, 2, 64)), "k"),
        ("k-int", both(to("k", dtype=I32), to("v", dtype=I32)), "k"),
        ("k-head_dim-96", set_(k=rnd(6, 2, 2, 96), v=rnd(6, 2, 2, 96), k_caches=caches(d=96),
                                v_caches=caches(d=96)), "k"),
        ("k-last-stride", set_(k=strided_last(6, 2, 2, 64)), "k"),
        ("v-shape", set_(v=rnd(6, 2, 1, 64)), "v"),
        ("v-bf16", to("v", dtype=BF16), "v"),
        ("v-meta", to("v", device=META), "v"),
        ("k_caches-too-few", item("k_caches", slice(1, None), []), "k_caches"),
        ("v_caches-too-many", set_(v_caches=caches(3)), "v_caches"),
        ("k_caches[1]-Hkv", item("k_caches", 1, rnd(4, 4, 4, 64)), "k_caches[1]"),
        ("v_caches[0]-D", item("v_caches", 0, rnd(4, 4, 2, 32)), "v_caches[0]"),
        ("k_caches[1]-num_blocks", item("k_caches", 1, rnd(5, 4, 2, 64)), "k_caches[1]"),
        ("v_caches-num_blocks", set_(v_caches=caches(nb=8)), "v_caches"),
        ("v_caches-block_size", set_(v_caches=caches(bs=8)), "v_caches"),
        ("k_caches[0]-last-stride", item("k_caches", 0, strided_last(4, 4, 2, 64)), "k_caches[0]"),
        ("k_caches[0]-bf16", item("k_caches", 0, lambda c: c.to(BF16)), "k_caches[0]"),
        ("k_caches[0]-rank3", item("k_caches", 0, rnd(16, 2, 64)), "k_caches[0]"),
        ("k_caches[1]-meta", item("k_caches", 1, lambda c: c.to(META)), "k_caches[1]"),
        ("slot_mapping-int32", to("slot_mapping", dtype=I32), "slot_mapping"),
        ("slot_mapping-float", to("slot_mapping", dtype=F32), "slot_mapping"),
        ("slot_mapping-len", set_(slot_mapping=torch.arange(5)), "slot_mapping"),
        ("slot_mapping-rank2", set_(slot_mapping=lambda kw: kw["slot_mapping"].view(6, 1)),
         "slot_mapping"),
        ("slot_mapping-meta", to("slot_mapping", device=META), "slot_mapping"),
    ],
    "kv_proj": [
        ("x-rank3", set_(x=rnd(5, 1, 32)), "x"),
        ("x-rank1", set_(x=rnd(32)), "x"),
        ("x-int", both(to("x", dtype=I32), to("w_kv", dtype=I32), to("bias", dtype=I32)), "x"),
        ("w_kv-bf16", to("w_kv", dtype=BF16), "w_kv"),
        ("w_kv-cols", set_(w_kv=rnd(64, 16)), "w_kv"),
        ("w_kv-rank1", set_(w_kv=rnd(64 * 32)), "w_kv"),
        ("w_kv-meta", to("w_kv", device=META), "w_kv"),
        ("bias-shape", set_(bias=rnd(32)), "bias"),
        ("bias-rank2", set_(bias=rnd(1, 64)), "bias"),
        ("bias-bf16", to("bias", dtype=BF16), "bias"),
        ("bias-meta", to("bias", device=META), "bias"),
    ],
    "context_kv_": [
        ("x-int", both(to("x", dtype=I32), to("w_kv", dtype=I32)), "x"),
        ("x-rank3", set_(x=rnd(5, 1, 32)), "x"),
        ("w_kv-rows", set_(w_kv=rnd(256, 32), bias=None), "w_kv"),
        ("w_kv-cols", set_(w_kv=rnd(512, 16)), "w_kv"),
        ("w_kv-bf16", to("w_kv", dtype=BF16), "w_kv"),
        ("w_kv-meta", to("w_kv", device=META), "w_kv"),
        ("bias-shape", set_(bias=rnd(256)), "bias"),
        ("bias-bf16", to("bias", dtype=BF16), "bias"),
        ("k_weight-layers", set_(k_weight=rnd(3, 64)), "k_weight"),
        ("k_weight-bf16", to("k_weight", dtype=BF16), "k_weight"),
        ("k_weight-meta", to("k_weight", device=META), "k_weight"),
        ("positions-len", set_(positions=positions(4)), "positions"),
        ("positions-int32", to("positions", dtype=I32), "positions"),
        ("slot_mapping-len", set_(slot_mapping=torch.arange(6)), "slot_mapping"),
        ("slot_mapping-int32", to("slot_mapping", dtype=I32), "slot_mapping"),
        ("slot_mapping-meta", to("slot_mapping", device=META), "slot_mapping"),
        ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 33)), "cos_sin_cache"),
        ("cache-too-many-cols", set_(cos_sin_cache=cos_sin(128)), "cos_sin_cache"),
        ("cache-bf16", to("cos_sin_cache", dtype=BF16), "cos_sin_cache"),
        ("k_caches-empty", set_(k_caches=[]), "k_caches"),
        ("v_caches-too-many", set_(v_caches=caches(3)), "v_caches"),
        ("v_caches-too-few", set_(v_caches=caches(1)), "v_caches"),
        ("k_caches[1]-Hkv", item("k_caches", 1, rnd(4, 4, 4, 64)), "k_caches[1]"),
        ("v_caches[0]-D", item("v_caches", 0, rnd(4, 4, 2, 32)), "v_caches[0]"),
        ("v_caches-num_blocks", set_(v_caches=caches(nb=8)), "v_caches"),
        ("k_caches[0]-last-stride", item("k_caches", 0, strided_last(4, 4, 2, 64)), "k_caches[0]"),
        ("k_caches[0]-bf16", item("k_caches", 0, lambda c: c.to(BF16)), "k_caches[0]"),
        ("v_caches[1]-meta", item("v_caches", 1, lambda c: c.to(META)), "v_caches[1]"),
        ("head_dim-96", lambda kw: kw.update(base_context(d=96)), "k_caches[0]"),
        ("hidden_norm_weight-shape", set_(hidden_norm_weight=rnd(64)), "hidden_norm_weight"),
        ("hidden_norm_weight-bf16", to("hidden_norm_weight", dtype=BF16), "hidden_norm_weight"),
        ("hidden_norm_weight-meta", to("hidden_norm_weight", device=META), "hidden_norm_weight"),
        ("eps-negative", set_(eps=-1.0), "eps"),
    ],
}

CASES["silu_mul"] = [
    ("x-int", to("x", dtype=I32), "x"),
    ("x-float64", to("x", dtype=torch.float64), "x"),
    ("x-0d", set_(x=torch.tensor(1.0)), "x"),
    ("x-odd-last-dim", set_(x=rnd(5, 3, 63)), "x"),
    ("x-zero-last-dim", set_(x=rnd(5, 3, 0)), "x"),
    ("x-last-stride", set_(x=strided_last(5, 3, 64)), "x"),
    ("x-leading-dims-do-not-merge", set_(x=lambda kw: kw["x"].transpose(0, 1)), "x"),
]

ATTN_CASES = [
    ("q-rank2", set_(q=rnd(8, 64)), "q"),
    ("q-int", to("q", dtype=I32), "q"),
    ("q-head_dim-96", lambda kw: kw.update({k: v for k, v in base_attn(d=96).items()
                                            if k in ("q", "k_cache", "v_cache")}), "q"),
    ("q-last-stride", set_(q=strided_last(8, 4, 64)), "q"),
    ("k_cache-bf16", to("k_cache", dtype=BF16), "k_cache"),
    ("k_cache-D", set_(k_cache=rnd(10, 4, 2, 32)), "k_cache"),
    ("k_cache-rank3", set_(k_cache=rnd(40, 2, 64)), "k_cache"),
    ("k_cache-last-stride", set_(k_cache=strided_last(10, 4, 2, 64)), "k_cache"),
    ("k_cache-meta", to("k_cache", device=META), "k_cache"),
    ("v_cache-Hkv", set_(v_cache=rnd(10, 4, 1, 64)), "v_cache"),
    ("v_cache-num_blocks", set_(v_cache=rnd(12, 4, 2, 64)), "v_cache"),
    ("v_cache-bf16", to("v_cache", dtype=BF16), "v_cache"),
    ("Hq-not-multiple-of-Hkv", set_(q=rnd(8, 4, 64), k_cache=rnd(10, 4, 3, 64),
                                    v_cache=rnd(10, 4, 3, 64)), "q"),
    ("block_table-int64", to("block_table", dtype=I64), "block_table"),
    ("block_table-rank1", set_(block_table=lambda kw: kw["block_table"].flatten()),
     "block_table"),
    ("block_table-meta", to("block_table", device=META), "block_table"),
    ("seq_lens-len-B+1", set_(seq_lens=torch.tensor([7, 3, 12, 1], dtype=I32)), "seq_lens"),
    ("seq_lens-len-B-1", set_(seq_lens=torch.tensor([7, 3], dtype=I32)), "seq_lens"),
    ("seq_lens-int64", to("seq_lens", dtype=I64), "seq_lens"),
    ("seq_lens-meta", to("seq_lens", device=META), "seq_lens"),
    ("query_start_loc-len-B", set_(query_start_loc=torch.tensor([0, 3, 4], dtype=I32)),
     "query_start_loc"),
    ("query_start_loc-len-B+2", set_(query_start_loc=torch.tensor([0, 3, 4, 8, 8], dtype=I32)),
     "query_start_loc"),
    ("query_start_loc-int64", to("query_start_loc", dtype=I64), "query_start_loc"),
    ("query_start_loc-meta", to("query_start_loc", device=META), "query_start_loc"),
    ("scale-zero", set_(scale=0.0), "scale"),
    ("scale-negative", set_(scale=-0.125), "scale"),
    ("sinks-shape", set_(sinks=torch.randn(2)), "sinks"),
    ("sinks-bf16", to("sinks", dtype=BF16), "sinks"),
    ("sinks-meta", to("sinks", device=META), "sinks"),
]
CASES["block_attention"] = ATTN_CASES
CASES["block_attention_out_"] = ATTN_CASES + [
    ("out-shape", set_(out=torch.zeros(8, 4, 32)), "out"),
    ("out-rank2", set_(out=torch.zeros(8, 256)), "out"),
    ("out-bf16", to("out", dtype=BF16), "out"),
    ("out-last-stride", set_(out=strided_last(8, 4, 64)), "out"),
    ("out-meta", to("out", device=META), "out"),
]


def _written_args(op):
    schema = getattr(torch.ops.dflash, op).default._schema
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


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


def _params():
    return [pytest.param(op, mutate, arg, id=f"{op}-{cid}")
            for op, cases in CASES.items() for cid, mutate, arg in cases]


def test_every_op_has_bad_input_cases():
    missing = set(dispatch.ops()) - set(CASES)
    assert not missing, f"ops without bad-input cases: {sorted(missing)}"


@pytest.mark.parametrize("op", sorted(BASES))
def test_valid_base_call_runs(op):
    """The starting point of every case is a valid call (so each error comes from the break)."""
    torch.manual_seed(0)
    kw = BASES[op]()
    _call(op, kw)


@pytest.mark.parametrize("op, mutate, arg", _params())
def test_bad_input_raises_naming_argument(op, mutate, arg):
    torch.manual_seed(0)
    kw = BASES[op]()
    mutate(kw)
    _expect_error(op, kw, arg, op)


def _to_cuda(v, device="cuda"):
    """kw with every CPU tensor (also inside lists) moved to ``device`` with its exact sizes,
    strides and storage offset (``.to()`` would make a strided view contiguous and lose the
    case); meta tensors (the device mismatch cases) stay where they are."""
    if isinstance(v, dict):
        return {k: _to_cuda(x, device) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_to_cuda(x, device) for x in v)
    if isinstance(v, torch.Tensor) and v.device.type == "cpu":
        store = v.untyped_storage()
        flat = torch.empty(0, dtype=v.dtype).set_(store, 0, (store.nbytes() // v.element_size(),))
        return flat.to(device).as_strided(v.size(), v.stride(), v.storage_offset())
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
    kw = BASES[op]()
    mutate(kw)
    kw = _to_cuda(kw)
    with dflash_ops.use_backend(backend, ops=[op]):
        _expect_error(op, kw, arg, f"{op} [{backend}]")


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
    kw = BASES[op]()
    mutate(kw)
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "1")
    _expect_error(op, kw, arg, f"{op} (DFLASH_OPS_DEBUG=1)")


@pytest.mark.parametrize("op, mutate, arg", _debug_params())
def test_without_debug_out_of_range_values_do_not_raise(op, mutate, arg):
    torch.manual_seed(0)
    kw = BASES[op]()
    mutate(kw)
    _call(op, kw)


def test_store_kv_skips_out_of_range_slot_without_debug():
    torch.manual_seed(0)
    kw = base_store()
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
    kw = base_rope()
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
    kw = base_knorm()
    kw["positions"] = torch.tensor([0, 5, 1000, 2, 7], dtype=I64)
    k0 = kw["k"].clone()
    _call("knorm_rope_", kw)
    normed = rms_norm_ref(k0, kw["k_weight"], EPS)
    torch.testing.assert_close(kw["k"][2], normed[2])


def test_block_attention_hides_out_of_range_block_without_debug():
    """Non-causal, one query: keys in a block id past the cache are invisible, so the result
    equals attention over the keys of the valid blocks alone."""
    torch.manual_seed(0)
    kw = base_attn()
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
    kw = base_store()
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
    kw = base_rope()
    kw["cos_sin_cache"] = kw["cos_sin_cache"][:0]

    def ok(kw, _, snap):
        _assert_untouched(snap, "rope_ with P = 0 (tokens must stay unrotated)")
    _degenerate("rope_", kw, "cos_sin_cache", ok)


def test_store_kv_with_zero_layers():
    """k/v [T, 0, Hkv, D] with empty cache lists: nothing to write, or a named error."""
    kw = base_store()
    kw.update(k=rnd(6, 0, 2, 64), v=rnd(6, 0, 2, 64), k_caches=[], v_caches=[])
    _degenerate("store_kv_", kw, "k_caches", lambda *a: None)


@pytest.mark.parametrize("what", ["max_blocks=0", "num_blocks=0"])
def test_block_attention_without_any_valid_block(what):
    """block_table [B, 0] (seq_lens clamp to 0) or caches with no blocks (every id out of
    range): each query sees no key, so the output is zeros (documented), or a named error."""
    kw = base_attn()
    if what == "max_blocks=0":
        kw["block_table"], arg = kw["block_table"][:, :0].contiguous(), "block_table"
    else:
        kw["k_cache"], kw["v_cache"], arg = rnd(0, 4, 2, 64), rnd(0, 4, 2, 64), "k_cache"

    def ok(kw, out, _):
        assert torch.equal(out, torch.zeros_like(kw["q"]))
    _degenerate("block_attention", kw, arg, ok)
