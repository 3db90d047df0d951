"""``torch.library.opcheck`` on every ``torch.ops.dflash.*`` op, plus a torch.compile smoke test.

opcheck runs test_schema (the op writes only what its schema marks ``(a!)``), the autograd
registration check, the fake kernel against the real one, and AOT dispatch with dynamic shapes.
Every case is small so the whole file runs in seconds on CPU; the same cases run on CUDA tensors
under ``@pytest.mark.gpu``. ``test_every_registered_op_is_opchecked`` fails when an op is
registered with the dispatcher but has no case here.
"""
from __future__ import annotations

import pytest
import torch

import dflash_ops  # noqa: F401  (defines torch.ops.dflash.*)
from dflash_ops import dispatch
from dflash_ops.ops.rope import make_cos_sin_cache

requires_cuda = [pytest.mark.gpu]  # tests/conftest.py skips these without a CUDA GPU

EPS = 1e-6
P = 32  # cos/sin table length


def _gen(seed=0):
    return torch.Generator(device="cpu").manual_seed(seed)


def _rnd(g, *shape, dtype, device):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _positions(g, t, device):
    return torch.randint(0, P, (t,), generator=g, dtype=torch.int64).to(device)


def _paged_caches(n_layers, num_blocks, block_size, hkv, d, dtype, device, vllm_layout=False):
    """Per-layer paged K/V caches [num_blocks, block_size, Hkv, D], NaN-poisoned so an unwritten
    element would show; with ``vllm_layout`` they are head-major strided views into one
    ``[num_blocks, Hkv, block_size, 2*D]`` tensor per layer (K and V side by side)."""
    kcs, vcs = [], []
    for _ in range(n_layers):
        if vllm_layout:
            kv = torch.full((num_blocks, hkv, block_size, 2 * d), float("nan"), dtype=dtype,
                            device=device)
            kcs.append(kv[..., :d].permute(0, 2, 1, 3))
            vcs.append(kv[..., d:].permute(0, 2, 1, 3))
        else:
            kcs.append(torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype,
                                  device=device))
            vcs.append(torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype,
                                  device=device))
    return kcs, vcs


# --------------------------------------------------------------------------------------------
# Cases: (op name, case id, builder(device, dtype) -> (args, kwargs))
# --------------------------------------------------------------------------------------------
def _rms_norm_1d(device, dtype):
    g = _gen(1)
    return (_rnd(g, 5, 3, 64, dtype=dtype, device=device), _rnd(g, 64, dtype=dtype, device=device),
            EPS), {}


def _rms_norm_2d(device, dtype):
    # k[T, L, Hkv, D] with a per-layer weight [L, D]
    g = _gen(2)
    return (_rnd(g, 4, 3, 2, 32, dtype=dtype, device=device),
            _rnd(g, 3, 32, dtype=dtype, device=device), EPS), {}


def _rms_norm_strided(device, dtype):
    # the K view of a fused [T, L, 2, Hkv, D] GEMM output
    g = _gen(3)
    kv = _rnd(g, 4, 2, 2, 2, 64, dtype=dtype, device=device)
    return (kv[:, :, 0], _rnd(g, 2, 64, dtype=dtype, device=device), EPS), {}


def _fused_add(device, dtype):
    g = _gen(4)
    return (_rnd(g, 7, 64, dtype=dtype, device=device), _rnd(g, 7, 64, dtype=dtype, device=device),
            _rnd(g, 64, dtype=dtype, device=device), EPS), {}


def _rope(is_neox, rotary_dim, strided=False):
    def build(device, dtype):
        g = _gen(5)
        t, h, d = 5, 4, 64
        if strided:  # the Q part of a fused QKV output [T, Hq + 2*Hkv, D]
            x = _rnd(g, t, h + 4, d, dtype=dtype, device=device)[:, :h]
        else:
            x = _rnd(g, t, h, d, dtype=dtype, device=device)
        cache = make_cos_sin_cache(P, rotary_dim, device=device)
        return (x, _positions(g, t, device), cache, is_neox), {}
    return build


def _qk_norm_rope(is_neox, rotary_dim):
    def build(device, dtype):
        g = _gen(6)
        t, hq, hkv, d = 5, 8, 2, 64
        qkv = _rnd(g, t, hq + 2 * hkv, d, dtype=dtype, device=device)
        q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
        return (q, k, _rnd(g, d, dtype=dtype, device=device), _rnd(g, d, dtype=dtype, device=device),
                _positions(g, t, device), make_cos_sin_cache(P, rotary_dim, device=device), EPS,
                is_neox), {}
    return build


def _knorm_rope(is_neox, rotary_dim):
    def build(device, dtype):
        g = _gen(7)
        t, n_layers, hkv, d = 5, 3, 2, 64
        kv = _rnd(g, t, n_layers, 2, hkv, d, dtype=dtype, device=device)
        k = kv[:, :, 0]  # strided view: [T, L, Hkv, D] out of [T, L, 2, Hkv, D]
        assert not k.is_contiguous()
        return (k, _rnd(g, n_layers, d, dtype=dtype, device=device), _positions(g, t, device),
                make_cos_sin_cache(P, rotary_dim, device=device), EPS, is_neox), {}
    return build


def _store_kv(vllm_layout):
    def build(device, dtype):
        g = _gen(8)
        t, n_layers, hkv, d, nb, bs = 6, 2, 2, 64, 4, 4
        k = _rnd(g, t, n_layers, hkv, d, dtype=dtype, device=device)
        v = _rnd(g, t, n_layers, hkv, d, dtype=dtype, device=device)
        kcs, vcs = _paged_caches(n_layers, nb, bs, hkv, d, dtype, device, vllm_layout)
        slots = torch.tensor([0, 5, -1, 14, -1, 7], dtype=torch.int64, device=device)
        return (k, v, kcs, vcs, slots), {}
    return build


def _kv_proj(with_bias):
    def build(device, dtype):
        g = _gen(9)
        t, h, n = 5, 32, 2 * 2 * 2 * 16
        bias = _rnd(g, n, dtype=dtype, device=device) if with_bias else None
        return (_rnd(g, t, h, dtype=dtype, device=device), _rnd(g, n, h, dtype=dtype, device=device),
                bias), {}
    return build


def _context_kv(with_bias, with_hidden_norm, is_neox=True, rotary_dim=64):
    def build(device, dtype):
        g = _gen(10)
        t, h, n_layers, hkv, d, nb, bs = 5, 32, 2, 2, 64, 4, 4
        n = n_layers * 2 * hkv * d
        x = _rnd(g, t, h, dtype=dtype, device=device)
        w = _rnd(g, n, h, dtype=dtype, device=device) * 0.2
        bias = _rnd(g, n, dtype=dtype, device=device) if with_bias else None
        kw = _rnd(g, n_layers, d, dtype=dtype, device=device)
        kcs, vcs = _paged_caches(n_layers, nb, bs, hkv, d, dtype, device)
        slots = torch.tensor([3, -1, 0, 9, 15], dtype=torch.int64, device=device)
        hn = _rnd(g, h, dtype=dtype, device=device) if with_hidden_norm else None
        return (x, w, bias, kw, _positions(g, t, device),
                make_cos_sin_cache(P, rotary_dim, device=device), slots, kcs, vcs, EPS, is_neox,
                hn), {}
    return build


def _attention_args(device, dtype, causal, window, with_sinks, hq=4, hkv=2):
    g = _gen(11)
    d, nb, bs = 64, 10, 4
    seq_lens = [7, 3, 12]
    q_lens = [3, 1, 4]
    m = 3
    q = _rnd(g, sum(q_lens), hq, d, dtype=dtype, device=device)
    kc = _rnd(g, nb, bs, hkv, d, dtype=dtype, device=device)
    vc = _rnd(g, nb, bs, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(nb, generator=g)[: len(seq_lens) * m].view(len(seq_lens), m)
    block_table = perm.to(torch.int32).to(device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    sinks = torch.randn(hq, generator=g).to(device) if with_sinks else None
    return (q, kc, vc, block_table, sl, qsl, d ** -0.5, causal, window, sinks)


def _block_attention(causal, window, with_sinks, hq=4, hkv=2):
    def build(device, dtype):
        return _attention_args(device, dtype, causal, window, with_sinks, hq, hkv), {}
    return build


def _block_attention_out(causal, window, with_sinks):
    def build(device, dtype):
        args = _attention_args(device, dtype, causal, window, with_sinks)
        out = torch.full_like(args[0], float("nan"))
        return args, {"out": out}
    return build


def _silu_mul(strided):
    def build(device, dtype):
        g = _gen(13)
        if strided:  # rows wider than 2*I: the gate/up part of a wider GEMM output, 3-D
            return (_rnd(g, 3, 4, 2 * 24 + 8, dtype=dtype, device=device)[:, :, :2 * 24],), {}
        return (_rnd(g, 7, 2 * 40, dtype=dtype, device=device),), {}
    return build


CASES = [
    ("rms_norm", "w1d", _rms_norm_1d),
    ("rms_norm", "w2d", _rms_norm_2d),
    ("rms_norm", "w2d-strided", _rms_norm_strided),
    ("fused_add_rms_norm_", "basic", _fused_add),
    ("rope_", "neox", _rope(True, 64)),
    ("rope_", "gptj", _rope(False, 64)),
    ("rope_", "neox-partial", _rope(True, 32)),
    ("rope_", "gptj-partial-strided", _rope(False, 16, strided=True)),
    ("qk_norm_rope_", "neox", _qk_norm_rope(True, 64)),
    ("qk_norm_rope_", "gptj-partial", _qk_norm_rope(False, 32)),
    ("knorm_rope_", "neox-strided", _knorm_rope(True, 64)),
    ("knorm_rope_", "gptj-partial-strided", _knorm_rope(False, 32)),
    ("store_kv_", "nhd", _store_kv(False)),
    ("store_kv_", "vllm-head-major", _store_kv(True)),
    ("kv_proj", "bias", _kv_proj(True)),
    ("kv_proj", "nobias", _kv_proj(False)),
    ("context_kv_", "bias-hidden_norm", _context_kv(True, True)),
    ("context_kv_", "nobias-no-hidden_norm", _context_kv(False, False)),
    ("context_kv_", "gptj-partial", _context_kv(False, True, is_neox=False, rotary_dim=32)),
    ("block_attention", "noncausal", _block_attention(False, -1, False)),
    ("block_attention", "causal-window-sinks", _block_attention(True, 3, True)),
    ("block_attention", "gqa4-noncausal-window", _block_attention(False, 2, False, hq=8, hkv=2)),
    ("block_attention_out_", "causal", _block_attention_out(True, -1, False)),
    ("block_attention_out_", "noncausal-sinks", _block_attention_out(False, -1, True)),
    # causal/window/sinks at their schema defaults: the dispatcher drops such trailing args
    ("block_attention_out_", "all-defaults", _block_attention_out(False, -1, False)),
    ("silu_mul", "contiguous", _silu_mul(False)),
    ("silu_mul", "rowstride-3d", _silu_mul(True)),
]

# fp32 for every case; bf16 for the cheap ones (everything here is small, so all of them).
DTYPES = [torch.float32, torch.bfloat16]


def _params(device, marks=()):
    return [pytest.param(op, build, dtype, id=f"{op}-{cid}-{str(dtype).replace('torch.', '')}",
                         marks=list(marks))
            for op, cid, build in CASES for dtype in DTYPES]


def _opcheck(op, build, dtype, device):
    args, kwargs = build(device, dtype)
    # bf16 reference math in fp32 then rounded: the fake/real comparison is exact, but opcheck's
    # aot_dispatch test re-runs the op, so allow rounding-level differences.
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    overload = getattr(torch.ops.dflash, op).default
    torch.library.opcheck(overload, args, kwargs, **tol)


@pytest.mark.parametrize("op, build, dtype", _params("cpu"))
def test_opcheck_cpu(op, build, dtype):
    _opcheck(op, build, dtype, "cpu")


@pytest.mark.parametrize("op, build, dtype", _params("cuda", requires_cuda))
def test_opcheck_cuda(op, build, dtype):
    _opcheck(op, build, dtype, "cuda")


def test_every_registered_op_is_opchecked():
    covered = {op for op, _, _ in CASES}
    registered = set(dispatch.ops())
    missing = registered - covered
    assert not missing, f"ops registered but not covered by opcheck: {sorted(missing)}"
    stale = covered - registered
    assert not stale, f"opcheck cases for ops that are not registered: {sorted(stale)}"
    for op in registered:
        assert hasattr(torch.ops.dflash, op), f"torch.ops.dflash.{op} missing"


# --------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): rms_norm -> qk_norm_rope_ -> store_kv_ -> block_attention
# --------------------------------------------------------------------------------------------
def _draft_layer(hidden, norm_w, w_qkv, q_w, k_w, positions, cache, slots, k_caches, v_caches,
                 block_table, seq_lens, qsl, hq, hkv, d):
    """One drafter attention step on our ops: norm, QKV GEMM, per-head norm + RoPE, cache
    write, block attention over the caches."""
    t = hidden.shape[0]
    h = torch.ops.dflash.rms_norm(hidden, norm_w, EPS)
    qkv = (h @ w_qkv.t()).view(t, hq + 2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    torch.ops.dflash.qk_norm_rope_(q, k, q_w, k_w, positions, cache, EPS, True)
    torch.ops.dflash.store_kv_(k.unsqueeze(1), v.unsqueeze(1), k_caches, v_caches, slots)
    o = torch.ops.dflash.block_attention(q, k_caches[0], v_caches[0], block_table, seq_lens, qsl,
                                         d ** -0.5, True, -1, None)
    return o.reshape(t, hq * d) + hidden[:, : hq * d], q, k


def _draft_inputs():
    g = _gen(12)
    hq, hkv, d, hidden_size = 2, 1, 64, 160
    nb, bs = 6, 4
    b, blk = 2, 4  # two requests, a block of 4 draft tokens each
    t = b * blk
    ctx = [5, 7]  # context lengths already in the caches
    hidden = torch.randn(t, hidden_size, generator=g)
    norm_w = torch.randn(hidden_size, generator=g)
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden_size, generator=g) * hidden_size ** -0.5
    q_w, k_w = torch.randn(d, generator=g), torch.randn(d, generator=g)
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([c + blk for c in ctx], dtype=torch.int32)
    qsl = torch.tensor([0, blk, 2 * blk], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + blk) for c in ctx])
    req = torch.arange(t) // blk
    slots = block_table.long()[req, positions // bs] * bs + positions % bs
    cache = make_cos_sin_cache(32, d)
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    return (hidden, norm_w, w_qkv, q_w, k_w, positions, cache, slots, [k_cache], [v_cache],
            block_table, seq_lens, qsl, hq, hkv, d)


def _clone_inputs(inputs):
    return tuple([x.clone() for x in a] if isinstance(a, list) else
                 (a.clone() if isinstance(a, torch.Tensor) else a) for a in inputs)


@pytest.mark.parametrize("backend", [
    "aot_eager",  # functionalization of the (a!) ops, fast
    pytest.param("inductor", marks=pytest.mark.slow),  # ~20 s of C++ compilation on 2 CPU cores
])
def test_torch_compile_fullgraph_draft_layer(backend):
    torch._dynamo.reset()
    eager_in = _draft_inputs()
    comp_in = _clone_inputs(eager_in)
    out_e, q_e, k_e = _draft_layer(*eager_in)
    compiled = torch.compile(_draft_layer, fullgraph=True, backend=backend, dynamic=False)
    out_c, q_c, k_c = compiled(*comp_in)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(q_c, q_e)
    torch.testing.assert_close(k_c, k_e)
    # the in-place cache write must survive functionalization
    torch.testing.assert_close(comp_in[8][0], eager_in[8][0])
    torch.testing.assert_close(comp_in[9][0], eager_in[9][0])
    # and the caches really were written (the draft block's slots changed)
    fresh = _draft_inputs()
    assert not torch.equal(comp_in[8][0], fresh[8][0])
