"""Each op's PyTorch reference (what ``torch.ops.dflash.*`` runs on CPU tensors) against an
independent formulation: HF transformers' Qwen3/GPT-J modules, complex-number RoPE, per-layer
and per-token python loops (block_attention's against dense SDPA: tests/test_attention_reference.py).

Tolerances
* fp32 against fp32/fp64: tight (1e-5 scale).
* bf16/fp16: the 2x rule against an fp64 ground truth: the op's max error is at most 2x
  the max error of the same math done in PyTorch in the test dtype, plus an atol of one ulp at
  the largest magnitude of the truth (``_rule_atol``). Where the formulation is the same
  rounding sequence (HF RMSNorm), the result must be bit-exact or within 1 ulp.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gptj import modeling_gptj as hf_gptj
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb,
)

import dflash_ops

OPS = torch.ops.dflash
ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LOW_DTYPES = [torch.bfloat16, torch.float16]
F64 = torch.float64


def _id(v):
    return str(v).replace("torch.", "")


# helpers ------------------------------------------------------------------------------------
def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in units in the last place between two same-dtype float tensors."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert not (a.isnan().any() or b.isnan().any()), "NaN in a compared tensor"
    itype, bits = {torch.float32: (torch.int32, 32), torch.float16: (torch.int16, 16),
                   torch.bfloat16: (torch.int16, 16)}[a.dtype]

    def ordered(t):  # sign-magnitude -> monotone integers (+0 and -0 both 0)
        i = t.contiguous().view(itype).to(torch.int64)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    if a.numel() == 0:
        return 0
    return int((ordered(a) - ordered(b)).abs().max())


def assert_ulp(a, b, max_ulp=1, what=""):
    d = ulp_distance(a, b)
    assert d <= max_ulp, f"{what}: {d} ulp apart (allowed {max_ulp}); max abs diff " \
                         f"{(a.double() - b.double()).abs().max().item():.3g}"


def _rule_atol(truth: torch.Tensor, dtype) -> float:
    return torch.finfo(dtype).eps * max(1.0, truth.abs().max().item() if truth.numel() else 0.0)


def assert_rule(out, truth, same_math, what="", atol=None):
    """The 2x rule: max|out - truth| <= 2 * max|same_math - truth| + atol (truth in fp64)."""
    truth = truth.double()
    atol = _rule_atol(truth, out.dtype) if atol is None else atol
    err = (out.double() - truth).abs().max().item()
    base = (same_math.double() - truth).abs().max().item()
    assert err <= 2 * base + atol, \
        f"{what}: error {err:.4g} > 2 x {base:.4g} (PyTorch in {_id(out.dtype)}) + {atol:.3g}"


def assert_fp32_close(out, expected, what="", atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(out.double(), expected.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0):
    """Fresh random values (never zeros), generated in fp32 then rounded to dtype."""
    return (torch.randn(*shape) * scale + offset).to(dtype)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    m = Qwen3RMSNorm(weight.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
        return m(x)


def rms_norm_f64(x, weight, eps):
    xf = x.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


# RoPE formulations ---------------------------------------------------------------------------
def inv_freq_f64(rotary_dim, base):
    return base ** (-torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)


def rope_complex_f64(x, positions, rotary_dim, base, is_neox):
    """x[T, ..., D] rotated in complex128, angles computed in fp64 from scratch (no table).
    GPT-J pairs adjacent dims (2i, 2i+1); NeoX pairs (i, i + R/2). Returns fp64."""
    r, half = rotary_dim, rotary_dim // 2
    xd = x.double()
    if is_neox:
        xc = torch.complex(xd[..., :half], xd[..., half:r])
    else:
        xc = torch.view_as_complex(xd[..., :r].reshape(*x.shape[:-1], half, 2).contiguous())
    theta = positions.double()[:, None] * inv_freq_f64(r, base)[None, :]  # [T, R/2]
    rot = torch.polar(torch.ones_like(theta), theta)
    rot = rot.reshape((x.shape[0],) + (1,) * (x.dim() - 2) + (half,))
    y = xc * rot
    yr = torch.cat([y.real, y.imag], -1) if is_neox else torch.view_as_real(y).flatten(-2)
    return torch.cat([yr, xd[..., r:]], -1)


def hf_rope(x, positions, cache, is_neox, compute_dtype=None):
    """x[T, H, D] rotated with HF's formulas (Qwen3 rotate_half for NeoX, GPT-J
    rotate_every_two) using cos/sin rows of ``cache``; cos/sin cast to the compute dtype as HF
    does. The last D - R dims pass through."""
    cd = compute_dtype or x.dtype
    r, half = cache.shape[1], cache.shape[1] // 2
    cos, sin = cache[positions, :half].to(cd), cache[positions, half:].to(cd)  # [T, R/2]
    xr = x[..., :r].to(cd)
    if is_neox:
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        y, _ = apply_rotary_pos_emb(xr, xr, cos2, sin2, unsqueeze_dim=1)
    else:
        y = hf_gptj.apply_rotary_pos_emb(xr[None], sin[None], cos[None])[0]
    return torch.cat([y, x[..., r:].to(cd)], -1)


def rope_layers(x4, positions, cache, is_neox, compute_dtype=None):
    """hf_rope over each layer of x[T, L, Hkv, D]."""
    return torch.stack([hf_rope(x4[:, l], positions, cache, is_neox, compute_dtype)
                        for l in range(x4.shape[1])], dim=1)


# rms_norm ------------------------------------------------------------------------------------
# The reference claims HF Qwen3RMSNorm's rounding order (normalise in fp32, round to the dtype,
# multiply by the weight in the dtype), so it must match HF bit for bit; 1 ulp would let the
# vLLM order (multiply in fp32, round once) through. Kernel tests may allow 1 ulp.
NORM_ULP = 0
NORM_SHAPES = [(1, 16), (7, 100), (3, 4, 128), (2, 3, 5, 64), (5, 4096)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_1d_weight_vs_hf(dtype, shape):
    x = rand(*shape, dtype=dtype, scale=3.0, offset=0.25)
    w = rand(shape[-1], dtype=dtype, scale=0.5, offset=1.0)
    for eps in (1e-6, 1e-5):
        y = OPS.rms_norm(x, w, eps)
        assert y.dtype == dtype and y.shape == x.shape
        assert_ulp(y, hf_rms_norm(x, w, eps), NORM_ULP, f"rms_norm {shape} eps={eps}")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
def test_rms_norm_2d_weight_per_layer_loop(dtype):
    t, n_layers, hkv, d, eps = 6, 5, 3, 128, 1e-6
    w = rand(n_layers, d, dtype=dtype, scale=0.5, offset=1.0)
    x4 = rand(t, n_layers, hkv, d, dtype=dtype, scale=2.0)
    y4 = OPS.rms_norm(x4, w, eps)
    expected = torch.stack([hf_rms_norm(x4[:, l], w[l], eps) for l in range(n_layers)], 1)
    assert_ulp(y4, expected, NORM_ULP, "x[T, L, Hkv, D] with w[L, D]")

    x3 = x4.reshape(t, n_layers * hkv, d)  # [T, L*Hkv, D]: layer l owns rows l*Hkv..l*Hkv+Hkv-1
    y3 = OPS.rms_norm(x3, w, eps)
    expected3 = torch.cat([hf_rms_norm(x3[:, l * hkv:(l + 1) * hkv], w[l], eps)
                           for l in range(n_layers)], 1)
    assert_ulp(y3, expected3, NORM_ULP, "x[T, L*Hkv, D] with w[L, D]")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
def test_rms_norm_2d_weight_general_groups(dtype):
    # x[T, 2, 6, D], G = 4: the 12 rows of a token are 4 groups of 3 consecutive rows
    t, d, g, eps = 3, 64, 4, 1e-6
    x = rand(t, 2, 6, d, dtype=dtype)
    w = rand(g, d, dtype=dtype, scale=0.5, offset=1.0)
    y = OPS.rms_norm(x, w, eps)
    rows = x.reshape(t, 12, d)
    expected = torch.stack([hf_rms_norm(rows[:, r], w[r // 3], eps) for r in range(12)], 1)
    assert_ulp(y, expected.view_as(x), NORM_ULP, "row r uses weight[r // (R // G)]")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
def test_rms_norm_strided_kv_view(dtype):
    t, n_layers, hkv, d, eps = 5, 3, 2, 64, 1e-6
    kv = rand(t, n_layers, 2, hkv, d, dtype=dtype, scale=2.0)
    before = kv.clone()
    k = kv[:, :, 0]  # [T, L, Hkv, D] view, non-contiguous
    assert not k.is_contiguous()
    w2 = rand(n_layers, d, dtype=dtype, scale=0.5, offset=1.0)
    w1 = rand(d, dtype=dtype, scale=0.5, offset=1.0)
    y2 = OPS.rms_norm(k, w2, eps)
    expected2 = torch.stack([hf_rms_norm(k[:, l].contiguous(), w2[l], eps)
                             for l in range(n_layers)], 1)
    assert_ulp(y2, expected2, NORM_ULP, "strided k, 2-D weight")
    y1 = OPS.rms_norm(k, w1, eps)
    assert_ulp(y1, hf_rms_norm(k.contiguous(), w1, eps), NORM_ULP, "strided k, 1-D weight")
    assert torch.equal(kv, before), "rms_norm wrote into its input"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", [(1, 64), (9, 320), (2, 3, 128)], ids=str)
def test_fused_add_rms_norm_vs_hf(dtype, shape):
    eps = 1e-6
    x = rand(*shape, dtype=dtype)
    residual = rand(*shape, dtype=dtype, scale=4.0)
    w = rand(shape[-1], dtype=dtype, scale=0.5, offset=1.0)
    exp_residual = residual + x
    exp_x = hf_rms_norm(exp_residual, w, eps)
    OPS.fused_add_rms_norm_(x, residual, w, eps)
    assert_ulp(residual, exp_residual, 0, "residual")
    assert_ulp(x, exp_x, NORM_ULP, "x")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
def test_fused_add_rms_norm_strided_and_2d_weight(dtype):
    # x a column slice of a wider buffer (row stride != D); 2-D weight [L, D] over x[T, L, Hkv, D]
    t, n_layers, hkv, d, eps = 4, 3, 2, 64, 1e-5
    buf = rand(t, n_layers, hkv, 2 * d, dtype=dtype)
    buf_before = buf.clone()
    x = buf[..., :d]
    residual = rand(t, n_layers, hkv, d, dtype=dtype, scale=2.0)
    w = rand(n_layers, d, dtype=dtype, scale=0.5, offset=1.0)
    exp_residual = residual + x
    exp_x = torch.stack([hf_rms_norm(exp_residual[:, l], w[l], eps) for l in range(n_layers)], 1)
    OPS.fused_add_rms_norm_(x, residual, w, eps)
    assert_ulp(residual, exp_residual, 0, "residual")
    assert_ulp(buf[..., :d], exp_x, NORM_ULP, "x written through the view")
    assert torch.equal(buf[..., d:], buf_before[..., d:]), "wrote outside the x view"


# cos/sin table -------------------------------------------------------------------------------
@pytest.mark.parametrize("rotary_dim,base", [(64, 1e4), (128, 1e6), (32, 5e5)])
def test_cos_sin_cache_vs_fp64_and_hf(rotary_dim, base):
    p = 4096
    cache = dflash_ops.make_cos_sin_cache(p, rotary_dim, base)
    assert cache.shape == (p, rotary_dim) and cache.dtype == torch.float32
    theta = torch.arange(p, dtype=F64)[:, None] * inv_freq_f64(rotary_dim, base)[None]
    half = rotary_dim // 2
    assert_fp32_close(cache[:, :half], theta.cos(), "cos", atol=2e-7, rtol=0)
    assert_fp32_close(cache[:, half:], theta.sin(), "sin", atol=2e-7, rtol=0)

    # HF computes the angles in fp32: its error grows like position * 2^-23 (about 1e-4 at 4096)
    cfg = Qwen3Config(head_dim=rotary_dim, hidden_size=4 * rotary_dim, num_attention_heads=4,
                      max_position_embeddings=p,
                      rope_parameters={"rope_type": "default", "rope_theta": base})
    cos, sin = Qwen3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(p)[None])
    cos, sin = cos[0], sin[0]
    for name, got, want in (("cos", cache[:, :half], cos), ("sin", cache[:, half:], sin)):
        assert torch.equal(want[:, :half], want[:, half:])  # HF layout: cat(freqs, freqs)
        assert_fp32_close(got[:256], want[:256, :half], f"HF {name} < 256", atol=2e-5, rtol=0)
        assert_fp32_close(got, want[:, :half], f"HF {name}", atol=4e-4, rtol=0)


# rope_ ---------------------------------------------------------------------------------------
ROPE_DIMS = [(64, 64), (128, 128), (128, 64), (256, 128), (64, 32)]  # (D, R)


def _rope_case(t, h, d, r, dtype, base=1e4, p=2048):
    cache = dflash_ops.make_cos_sin_cache(p, r, base)
    positions = torch.randint(0, p, (t,))
    positions[0] = p - 1
    x = rand(t, h, d, dtype=dtype, scale=1.5)
    return x, positions, cache, base


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("d,r", ROPE_DIMS, ids=lambda v: str(v))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rope_vs_hf_and_complex(dtype, d, r, is_neox):
    t, h = (1, 3) if d == 256 else (19, 4)
    x, positions, cache, base = _rope_case(t, h, d, r, dtype)
    x0 = x.clone()
    OPS.rope_(x, positions, cache, is_neox)
    assert torch.equal(x[..., r:], x0[..., r:]), "partial rotary changed the last D - R dims"
    truth = rope_complex_f64(x0, positions, r, base, is_neox)
    if dtype == torch.float32:
        assert_fp32_close(x, hf_rope(x0, positions, cache, is_neox), "vs HF formula, same table")
        assert_fp32_close(x, truth, "vs complex fp64")
    else:
        assert_rule(x, truth, hf_rope(x0, positions, cache, is_neox), "rope_ low precision")


def test_rope_neox_vs_hf_rotary_embedding_module():
    # end to end against Qwen3RotaryEmbedding's own cos/sin (fp32 angles: positions < 256)
    d, base, t, h = 128, 1e6, 11, 4
    cfg = Qwen3Config(head_dim=d, hidden_size=h * d, num_attention_heads=h,
                      max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": base})
    positions = torch.randint(0, 256, (t,))
    x = rand(t, h, d)
    cos, sin = Qwen3RotaryEmbedding(cfg)(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x, x, cos[0], sin[0], unsqueeze_dim=1)
    OPS.rope_(x, positions, dflash_ops.make_cos_sin_cache(256, d, base), True)
    assert_fp32_close(x, expected, "vs Qwen3RotaryEmbedding + apply_rotary_pos_emb", atol=1e-4)


@pytest.mark.parametrize("r", [64, 32])
def test_rope_neox_and_gptj_differ(r):
    x, positions, cache, _ = _rope_case(8, 4, 64, r, torch.float32)
    positions = torch.arange(1, 9) * 37  # nonzero angles everywhere
    a, b = x.clone(), x.clone()
    OPS.rope_(a, positions, cache, True)
    OPS.rope_(b, positions, cache, False)
    diff = (a - b)[..., :r].abs()
    assert diff.max() > 0.5 and diff.mean() > 0.05, "NeoX and GPT-J results nearly agree"
    assert torch.equal(a[..., r:], b[..., r:])
    # and each style matches only its own formulation
    gptj_as_neox = hf_rope(x, positions, cache, True)
    assert (b - gptj_as_neox).abs().max() > 0.5


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
def test_rope_out_of_range_positions_leave_token_unchanged(is_neox, dtype):
    p, d = 64, 64
    cache = dflash_ops.make_cos_sin_cache(p, d, 1e4)
    positions = torch.tensor([3, -1, 63, 64, -7, 0, 1000, 2**40, 17])
    x = rand(len(positions), 4, d, dtype=dtype)
    x0 = x.clone()
    OPS.rope_(x, positions, cache, is_neox)
    bad = (positions < 0) | (positions >= p)
    assert torch.equal(x[bad], x0[bad]), "an out-of-range position changed its token"
    good = ~bad
    expected = hf_rope(x0[good], positions[good], cache, is_neox, torch.float32)
    if dtype == torch.float32:
        assert_fp32_close(x[good], expected, "in-range tokens")
    else:
        assert_ulp(x[good], expected.to(dtype), 1, "in-range tokens")


# qk_norm_rope_ -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("d,r", [(128, 128), (64, 32)], ids=str)
def test_qk_norm_rope_vs_hf(dtype, is_neox, d, r):
    t, hq, hkv, eps, base, p = 13, 8, 2, 1e-6, 1e6, 4096
    cache = dflash_ops.make_cos_sin_cache(p, r, base)
    positions = torch.randint(0, p, (t,))
    # q and k as views of a fused QKV projection output
    qkv = rand(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    q0, k0 = q.clone(), k.clone()
    wq = rand(d, dtype=dtype, scale=0.5, offset=1.0)
    wk = rand(d, dtype=dtype, scale=0.5, offset=1.0)
    OPS.qk_norm_rope_(q, k, wq, wk, positions, cache, eps, is_neox)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "V part of the QKV buffer changed"
    for name, got, x0, w in (("q", q, q0, wq), ("k", k, k0, wk)):
        normed = hf_rms_norm(x0, w, eps)  # HF rounding point: the norm output in dtype
        truth = rope_complex_f64(normed, positions, r, base, is_neox)
        if dtype == torch.float32:
            assert_fp32_close(got, hf_rope(normed, positions, cache, is_neox), f"{name} vs HF")
            assert_fp32_close(got, truth, f"{name} vs complex fp64")
        else:
            assert_rule(got, truth, hf_rope(normed, positions, cache, is_neox), name)
            assert torch.equal(got[..., r:], normed[..., r:]), f"{name}: pass-through dims"


# knorm_rope_ ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("layout", ["kv_view", "contiguous"])
def test_knorm_rope_vs_per_layer_loop(dtype, is_neox, layout):
    t, n_layers, hkv, d, eps, base, p = 9, 5, 2, 128, 1e-6, 1e6, 1024
    r = d if is_neox else 64  # partial rotary in the GPT-J cases
    cache = dflash_ops.make_cos_sin_cache(p, r, base)
    positions = torch.randint(0, p, (t,))
    positions[-1] = -1  # out of range: normed, not rotated
    kv = rand(t, n_layers, 2, hkv, d, dtype=dtype, scale=2.0)
    k = kv[:, :, 0] if layout == "kv_view" else kv[:, :, 0].contiguous()
    v_before = kv[:, :, 1].clone()
    k0 = k.clone()
    w = rand(n_layers, d, dtype=dtype, scale=0.5, offset=1.0)
    OPS.knorm_rope_(k, w, positions, cache, eps, is_neox)
    assert torch.equal(kv[:, :, 1], v_before), "the V half of the KV buffer changed"
    if layout == "kv_view":
        assert torch.equal(kv[:, :, 0], k)

    normed = torch.stack([hf_rms_norm(k0[:, l], w[l], eps) for l in range(n_layers)], 1)
    assert torch.equal(k[-1], normed[-1]), "position -1: expected the normed, unrotated k"
    ok = positions >= 0
    got, normed_ok, pos_ok = k[ok], normed[ok], positions[ok]
    truth = rope_complex_f64(normed_ok, pos_ok, r, base, is_neox)
    if dtype == torch.float32:
        assert_fp32_close(got, rope_layers(normed_ok, pos_ok, cache, is_neox), "vs HF loop")
        assert_fp32_close(got, truth, "vs complex fp64")
    else:
        assert_rule(got, truth, rope_layers(normed_ok, pos_ok, cache, is_neox), "knorm_rope_")


# store_kv_ -----------------------------------------------------------------------------------
def make_caches(layout, n_layers, nb, bs, hkv, d, dtype):
    """Per-layer (k_cache, v_cache) views and the buffers that own them."""
    bufs, kcs, vcs = [], [], []
    for _ in range(n_layers):
        if layout == "separate":
            kb, vb = rand(nb, bs, hkv, d, dtype=dtype), rand(nb, bs, hkv, d, dtype=dtype)
            bufs += [kb, vb]
            kcs.append(kb)
            vcs.append(vb)
        elif layout == "nhd":  # vLLM [num_blocks, 2, block_size, Hkv, D]
            b = rand(nb, 2, bs, hkv, d, dtype=dtype)
            bufs.append(b)
            kcs.append(b[:, 0])
            vcs.append(b[:, 1])
        elif layout == "hnd2d":  # vLLM >= 0.33: [num_blocks, Hkv, block_size, 2*D]
            b = rand(nb, hkv, bs, 2 * d, dtype=dtype)
            bufs.append(b)
            kcs.append(b[..., :d].permute(0, 2, 1, 3))
            vcs.append(b[..., d:].permute(0, 2, 1, 3))
        else:
            raise AssertionError(layout)
    return bufs, kcs, vcs


def loop_store(k, v, kcs, vcs, slots):
    """The independent formulation: per layer, per token, skip slots outside [0, nb*bs)."""
    nb, bs = kcs[0].shape[:2]
    for l in range(k.shape[1]):
        for t in range(k.shape[0]):
            s = int(slots[t])
            if 0 <= s < nb * bs:
                kcs[l][s // bs, s % bs] = k[t, l]
                vcs[l][s // bs, s % bs] = v[t, l]


def make_slots(t, nb, bs):
    n = nb * bs
    slots = torch.randperm(n)[:t].clone()
    bad = [-1, n, -1, n + 12345, -(2**40), 2**40]
    for i, s in zip(range(1, t, 2), bad):
        slots[i] = s
    return slots


@pytest.mark.parametrize("layout", ["separate", "nhd", "hnd2d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("t,bs", [(13, 4), (1, 16), (40, 16)], ids=str)
def test_store_kv_vs_python_loop(layout, dtype, t, bs):
    n_layers, hkv, d, nb = 3, 2, 64, 7
    bufs, kcs, vcs = make_caches(layout, n_layers, nb, bs, hkv, d, dtype)
    if layout != "separate":
        assert not kcs[0].is_contiguous()
    exp_bufs = [b.clone() for b in bufs]
    _, exp_k, exp_v = _views_of(layout, exp_bufs, n_layers, d)
    kv = rand(t, n_layers, 2, hkv, d, dtype=dtype)  # k and v as views of the GEMM output
    k, v = kv[:, :, 0], kv[:, :, 1]
    slots = make_slots(t, nb, bs) if t > 1 else torch.tensor([nb * bs - 1])
    OPS.store_kv_(k, v, kcs, vcs, slots)
    loop_store(k, v, exp_k, exp_v, slots)
    for i, (got, want) in enumerate(zip(bufs, exp_bufs)):
        assert torch.equal(got, want), f"cache buffer {i} differs from the per-token loop"


def _views_of(layout, bufs, n_layers, d):
    if layout == "separate":
        return bufs, bufs[0::2], bufs[1::2]
    if layout == "nhd":
        return bufs, [b[:, 0] for b in bufs], [b[:, 1] for b in bufs]
    return bufs, [b[..., :d].permute(0, 2, 1, 3) for b in bufs], \
        [b[..., d:].permute(0, 2, 1, 3) for b in bufs]


def test_store_kv_all_slots_skipped_changes_nothing():
    n_layers, hkv, d, nb, bs = 2, 2, 64, 3, 4
    bufs, kcs, vcs = make_caches("nhd", n_layers, nb, bs, hkv, d, torch.float32)
    before = [b.clone() for b in bufs]
    k, v = rand(4, n_layers, hkv, d), rand(4, n_layers, hkv, d)
    OPS.store_kv_(k, v, kcs, vcs, torch.tensor([-1, nb * bs, -3, nb * bs + 1]))
    assert all(torch.equal(a, b) for a, b in zip(bufs, before))


# kv_proj -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("t,h", [(1, 64), (7, 320), (33, 256)], ids=str)
def test_kv_proj_vs_linear_f64(dtype, with_bias, t, h):
    n = 2 * 2 * 2 * 64  # L=2, Hkv=2, D=64
    x = rand(t, h, dtype=dtype)
    w = rand(n, h, dtype=dtype, scale=1 / math.sqrt(h))
    b = rand(n, dtype=dtype, scale=0.5) if with_bias else None
    y = OPS.kv_proj(x, w, b)
    assert y.shape == (t, n) and y.dtype == dtype
    truth = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.float32:
        assert_fp32_close(y, truth, "kv_proj fp32")
    else:
        assert_rule(y, truth, F.linear(x, w, b), "kv_proj")


# context_kv_ ---------------------------------------------------------------------------------
def context_chain(x, w_kv, bias, wk, positions, cache, slots, kcs, vcs, eps, is_neox, hnw,
                  n_layers, hkv, d, mode):
    """(hidden RMSNorm) -> F.linear -> view [T, L, 2, Hkv, D] -> per-layer K RMSNorm -> RoPE ->
    per-layer per-token cache write. mode "dtype": HF modules in x's dtype; "f64": fp64 math,
    no intermediate rounding, RoPE angles from scratch (the ground truth)."""
    t = x.shape[0]
    f64 = mode == "f64"
    r = cache.shape[1]
    h = x if hnw is None else (rms_norm_f64(x, hnw, eps) if f64 else hf_rms_norm(x, hnw, eps))
    if f64:
        y = F.linear(h.double(), w_kv.double(), None if bias is None else bias.double())
    else:
        y = F.linear(h, w_kv, bias)
    kv = y.view(t, n_layers, 2, hkv, d)
    ks, vs = [], []
    for l in range(n_layers):
        if f64:
            kl = rope_complex_f64(rms_norm_f64(kv[:, l, 0], wk[l], eps), positions, r, BASE,
                                  is_neox)
        else:
            kl = hf_rope(hf_rms_norm(kv[:, l, 0], wk[l], eps), positions, cache, is_neox)
        ks.append(kl)
        vs.append(kv[:, l, 1])
    k, v = torch.stack(ks, 1), torch.stack(vs, 1)
    loop_store(k, v, kcs, vcs, slots)


BASE = 1e6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("hidden_norm", [False, True, "rms"], ids=["nohn", "hn", "rms"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_context_kv_vs_explicit_chain(dtype, is_neox, hidden_norm, with_bias):
    """hidden_norm "rms": the op gets the norm's weight folded into w_kv (w_kv * weight, rounded
    to the dtype) and hidden_rms=True; the chains keep the unfolded weight and the norm (the
    documented equivalence, to the tolerance rule)."""
    t, hid, n_layers, hkv, d, nb, bs, eps, p = 11, 256, 3, 2, 64, 5, 4, 1e-6, 2048
    layout = "nhd" if is_neox else "hnd2d"
    r = d if hidden_norm else d // 2  # partial rotary in half the cases
    cache = dflash_ops.make_cos_sin_cache(p, r, BASE)
    positions = torch.randint(0, p, (t,))
    slots = make_slots(t, nb, bs)
    x = rand(t, hid, dtype=dtype, scale=2.0)
    n = n_layers * 2 * hkv * d
    w_kv = rand(n, hid, dtype=dtype, scale=1 / math.sqrt(hid))
    bias = rand(n, dtype=dtype, scale=0.3) if with_bias else None
    wk = rand(n_layers, d, dtype=dtype, scale=0.5, offset=1.0)
    hnw = rand(hid, dtype=dtype, scale=0.5, offset=1.0) if hidden_norm else None

    bufs, kcs, vcs = make_caches(layout, n_layers, nb, bs, hkv, d, dtype)
    args = (x, w_kv, bias, wk, positions, cache, slots)
    expected = {}
    for mode in ("dtype", "f64"):
        eb = [(b.double() if mode == "f64" else b.clone()) for b in bufs]
        _, ek, ev = _views_of(layout, eb, n_layers, d)
        context_chain(*args, ek, ev, eps, is_neox, hnw, n_layers, hkv, d, mode)
        expected[mode] = eb
    if hidden_norm == "rms":
        folded = (w_kv.float() * hnw.float()[None, :]).to(dtype)
        OPS.context_kv_(x, folded, *args[2:], kcs, vcs, eps, is_neox, None, True)
    else:
        OPS.context_kv_(*args, kcs, vcs, eps, is_neox, hnw)

    written = torch.zeros(nb, bs, dtype=torch.bool)
    for s in slots.tolist():
        if 0 <= s < nb * bs:
            written[s // bs, s % bs] = True
    mask = written  # [nb, bs]: indexes the [nb, bs, Hkv, D] K/V views
    for i, got in enumerate(bufs):
        _, gk, gv = _views_of(layout, [got], 1, d)
        _, dk, dv = _views_of(layout, [expected["dtype"][i]], 1, d)
        _, fk, fv = _views_of(layout, [expected["f64"][i]], 1, d)
        for name, g_, d_, f_ in (("K", gk[0], dk[0], fk[0]), ("V", gv[0], dv[0], fv[0])):
            what = f"layer {i} {name}"
            assert torch.equal(g_[~mask], d_[~mask]), f"{what}: an unwritten slot changed"
            if dtype == torch.float32:
                assert_fp32_close(g_[mask], d_[mask], what + " vs fp32 chain")
                assert_fp32_close(g_[mask], f_[mask], what + " vs fp64 chain", atol=1e-4)
            else:
                assert_rule(g_[mask], f_[mask], d_[mask], what)


def test_rope_empty_cos_sin_table_leaves_x_unchanged():
    # P = 0: every position is outside [0, P), so per the rope docstring nothing rotates (or the
    # argument check rejects the table with a ValueError); it must not crash while computing.
    x = rand(3, 2, 64)
    x0 = x.clone()
    try:
        OPS.rope_(x, torch.tensor([0, 1, 5]), torch.zeros(0, 64), True)
    except ValueError as e:
        assert "cos_sin_cache" in str(e)
        return
    assert torch.equal(x, x0)


def test_empty_batch_is_a_no_op():
    # T = 0 (nothing to do this step) must not crash and must not touch anything
    d, n_layers, hkv = 64, 3, 2
    cache = dflash_ops.make_cos_sin_cache(16, d)
    none_i64 = torch.empty(0, dtype=torch.int64)
    assert OPS.rms_norm(torch.empty(0, d), rand(d), 1e-6).shape == (0, d)
    assert OPS.rms_norm(torch.empty(0, n_layers, hkv, d), rand(n_layers, d), 1e-6).shape == \
        (0, n_layers, hkv, d)
    OPS.fused_add_rms_norm_(torch.empty(0, d), torch.empty(0, d), rand(d), 1e-6)
    OPS.rope_(torch.empty(0, hkv, d), none_i64, cache, True)
    OPS.qk_norm_rope_(torch.empty(0, 4, d), torch.empty(0, hkv, d), rand(d), rand(d), none_i64,
                      cache, 1e-6, False)
    OPS.knorm_rope_(torch.empty(0, n_layers, hkv, d), rand(n_layers, d), none_i64, cache, 1e-6,
                    True)
    bufs, kcs, vcs = make_caches("nhd", n_layers, 2, 4, hkv, d, torch.float32)
    before = [b.clone() for b in bufs]
    empty_kv = torch.empty(0, n_layers, hkv, d)
    OPS.store_kv_(empty_kv, empty_kv, kcs, vcs, none_i64)
    n = n_layers * 2 * hkv * d
    assert OPS.kv_proj(torch.empty(0, 32), rand(n, 32), None).shape == (0, n)
    OPS.context_kv_(torch.empty(0, 32), rand(n, 32), None, rand(n_layers, d), none_i64, cache,
                    none_i64, kcs, vcs, 1e-6, True, rand(32))
    assert all(torch.equal(a, b) for a, b in zip(bufs, before))
    out = OPS.block_attention(torch.empty(0, 4, d), kcs[0], vcs[0],
                              torch.zeros(1, 2, dtype=torch.int32),
                              torch.tensor([3], dtype=torch.int32),
                              torch.tensor([0, 0], dtype=torch.int32), 0.125)
    assert out.shape == (0, 4, d)
