"""Rotary embedding ops: ``rope_``, ``qk_norm_rope_``, ``knorm_rope_``, ``qk_norm_rope_store_``.

``cos_sin_cache[P, R]`` (fp32) holds, for position p, ``[cos(p*f_0..f_{R/2-1}), sin(...)]``; the
rotary acts on the first R dims of each head (R < D: partial rotary). NeoX style rotates the two
halves ``(x[i], x[i + R/2])``; GPT-J style rotates adjacent pairs ``(x[2i], x[2i+1])``.
A position outside ``[0, P)`` leaves that token unrotated (the norm, if any, still applies);
``DFLASH_OPS_DEBUG=1`` turns it into an error.

``qk_norm_rope_store_`` is a decoder layer's step after its QKV GEMM in one launch:
``qk_norm_rope_`` on q (in place) and k, then ``store_kv_`` (ops/kv.py: caches, slots) of that
k and of v, so k and v are read once and k is never written back (with no weights, ``rope_``
instead of the norms).
"""
from __future__ import annotations

import torch

from .. import dispatch
from . import _checks as C
from ._samples import EPS, META, P, Maker, cos_sin, positions, rnd, set_, strided_last, to
from .norm import rms_norm_ref

__all__ = ["rope_", "qk_norm_rope_", "knorm_rope_", "qk_norm_rope_store_", "make_cos_sin_cache"]

HEAD_DIMS = (16, 32, 64, 128, 256)


def make_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0,
                       device=None) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` fp32 table the rope ops read (default RoPE scaling)."""
    if rotary_dim % 2:
        raise ValueError(f"make_cos_sin_cache: rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64,
                                            device=device) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def rope_values(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                is_neox: bool) -> torch.Tensor:
    """x[T, ..., D] rotated (fp32 math), returned in x's dtype; x itself is not written."""
    r = cos_sin_cache.shape[1]
    half = r // 2
    p = cos_sin_cache.shape[0]
    valid = (positions >= 0) & (positions < p)
    cs = cos_sin_cache[positions.clamp(0, max(p - 1, 0))]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    xr = x[..., :r].float()
    if is_neox:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    rot = torch.where(valid.reshape((-1,) + (1,) * (x.dim() - 1)), rot, xr)
    out = x.clone()
    out[..., :r] = rot.to(x.dtype)
    return out


def _check_heads(op, name, t, rank, device=None):
    C.tensor(op, name, t, rank=rank, dtype=C.FLOAT_DTYPES[:2] + (torch.float32,), device=device,
             last_contiguous=True)
    C.head_dim(op, name, t.shape[-1], HEAD_DIMS)


def _check_pos(op, positions, cos_sin_cache, t, head_size, device):
    C.index_vector(op, "positions", positions, t, device)
    C.cos_sin_cache(op, cos_sin_cache, head_size, device)


def _debug_positions(op, positions, cos_sin_cache):
    p = cos_sin_cache.shape[0]
    bad = (positions < 0) | (positions >= p)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        C.fail(op, f"positions[{i}] = {int(positions[i])} is outside the cos_sin_cache [0, {p})")


# rope_ ------------------------------------------------------------------------------------
def _check_rope(x, positions, cos_sin_cache, is_neox):
    _check_heads("rope_", "x", x, 3)
    _check_pos("rope_", positions, cos_sin_cache, x.shape[0], x.shape[-1], x.device)


def _rope_ref(x, positions, cos_sin_cache, is_neox):
    x.copy_(rope_values(x, positions, cos_sin_cache, is_neox))


# Eager calls: the C++ kernel (8-16 us of host time against 65-120 us for a Triton launch).
# Default triton: rope_ runs the qk_norm_rope_ kernel without the norm (below); in the decode
# step (36 calls, sum of kernel times under graph replay) triton takes 70 us, cuda 147 us.
dispatch.define_op(
    "rope_(Tensor(a!) x, Tensor positions, Tensor cos_sin_cache, bool is_neox) -> ()",
    validate=_check_rope, reference=_rope_ref, fake=lambda *a: None, default="triton",
    eager="cuda",
    debug_check=lambda x, positions, cache, is_neox: _debug_positions("rope_", positions, cache))


# qk_norm_rope_ -----------------------------------------------------------------------------
def _check_qk(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox):
    op = "qk_norm_rope_"
    _check_heads(op, "q", q, 3)
    _check_heads(op, "k", k, 3, device=q.device)
    C.same_dtype(op, "k", k, "q", q)
    d = q.shape[-1]
    if k.shape[0] != q.shape[0] or k.shape[2] != d:
        C.fail(op, f"k must be [T={q.shape[0]}, Hkv, D={d}] like q, got {list(k.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        C.tensor(op, name, w, shape=(d,), device=q.device)
        C.same_dtype(op, name, w, "q", q)
    C.eps(op, eps)
    _check_pos(op, positions, cos_sin_cache, q.shape[0], d, q.device)


def _qk_ref(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox):
    q.copy_(rope_values(rms_norm_ref(q, q_weight, eps), positions, cos_sin_cache, is_neox))
    k.copy_(rope_values(rms_norm_ref(k, k_weight, eps), positions, cos_sin_cache, is_neox))


# Eager calls: the C++ kernel (8-16 us of host time against 65-120 us for a Triton launch).
# Default triton (Qwen3-8B shapes, bf16, graph replay): triton 1.57 vs cuda 2.99 us at T = 1,
# 24.0 vs 33.2 us at T = 4096, 94.1 vs 119.0 us at T = 16384.
dispatch.define_op(
    "qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, "
    "Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox) -> ()",
    validate=_check_qk, reference=_qk_ref, fake=lambda *a: None, default="triton",
    eager="cuda",
    debug_check=lambda q, k, wq, wk, positions, cache, eps, n: _debug_positions(
        "qk_norm_rope_", positions, cache))


# knorm_rope_ -------------------------------------------------------------------------------
def _check_knorm(k, k_weight, positions, cos_sin_cache, eps, is_neox):
    op = "knorm_rope_"
    _check_heads(op, "k", k, 4)
    t, n_layers, _, d = k.shape
    C.tensor(op, "k_weight", k_weight, shape=(n_layers, d), device=k.device)
    C.same_dtype(op, "k_weight", k_weight, "k", k)
    C.eps(op, eps)
    _check_pos(op, positions, cos_sin_cache, t, d, k.device)


def _knorm_ref(k, k_weight, positions, cos_sin_cache, eps, is_neox):
    k.copy_(rope_values(rms_norm_ref(k, k_weight, eps), positions, cos_sin_cache, is_neox))


# Eager calls: the C++ kernel (8-16 us of host time against 65-120 us for a Triton launch).
# Default triton (Qwen3-8B shapes, bf16, graph replay): triton 1.56 vs cuda 2.95 us at T = 1,
# 24.8 vs 33.2 us at T = 4096, 95.8 vs 119.8 us at T = 16384.
dispatch.define_op(
    "knorm_rope_(Tensor(a!) k, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, "
    "float eps, bool is_neox) -> ()",
    validate=_check_knorm, reference=_knorm_ref, fake=lambda *a: None, default="triton",
    eager="cuda",
    debug_check=lambda k, w, positions, cache, eps, n: _debug_positions(
        "knorm_rope_", positions, cache))


# qk_norm_rope_store_ -----------------------------------------------------------------------
def _check_qkrs(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, k_cache,
                v_cache, slot_mapping):
    op = "qk_norm_rope_store_"
    _check_heads(op, "q", q, 3)
    _check_heads(op, "k", k, 3, device=q.device)
    C.same_dtype(op, "k", k, "q", q)
    t, d = q.shape[0], q.shape[-1]
    if k.shape[0] != t or k.shape[2] != d:
        C.fail(op, f"k must be [T={t}, Hkv, D={d}] like q, got {list(k.shape)}")
    C.tensor(op, "v", v, shape=tuple(k.shape), device=q.device, last_contiguous=True)
    C.same_dtype(op, "v", v, "q", q)
    if (q_weight is None) != (k_weight is None):
        C.fail(op, "q_weight and k_weight must both be given (QK-norm) or both be None (RoPE "
                   f"alone), got q_weight {'None' if q_weight is None else 'a tensor'} and "
                   f"k_weight {'None' if k_weight is None else 'a tensor'}")
    if q_weight is not None:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            C.tensor(op, name, w, shape=(d,), device=q.device)
            C.same_dtype(op, name, w, "q", q)
    C.eps(op, eps)
    _check_pos(op, positions, cos_sin_cache, t, d, q.device)
    hkv = k.shape[1]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.tensor(op, name, c, rank=4, dtype=q.dtype, device=q.device, last_contiguous=True)
        if c.shape[2] != hkv or c.shape[3] != d:
            C.fail(op, f"{name} must be [num_blocks, block_size, {hkv}, {d}] (Hkv, D of k), "
                       f"got {list(c.shape)}")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        C.fail(op, f"v_cache must have the [num_blocks, block_size] of k_cache "
                   f"{list(k_cache.shape[:2])}, got {list(v_cache.shape[:2])}")
    C.index_vector(op, "slot_mapping", slot_mapping, t, q.device)


def _qkrs_ref(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, k_cache,
              v_cache, slot_mapping):
    from .kv import store_kv_ref  # (ops/kv.py imports this module)
    if q_weight is not None:
        qn, kn = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    else:
        qn, kn = q, k
    kr = rope_values(kn, positions, cos_sin_cache, is_neox)
    q.copy_(rope_values(qn, positions, cos_sin_cache, is_neox))
    store_kv_ref(kr[:, None], v[:, None], [k_cache], [v_cache], slot_mapping)


def _debug_qkrs(q, k, v, wq, wk, positions, cos_sin_cache, eps, is_neox, k_cache, v_cache,
                slot_mapping):
    from .kv import _debug_slots
    _debug_positions("qk_norm_rope_store_", positions, cos_sin_cache)
    _debug_slots("qk_norm_rope_store_", slot_mapping, k_cache)


# Default triton (as qk_norm_rope_'s: a graph-replayed launch is shorter than the C++ kernel's
# at decode sizes); eager calls take the C++ kernel (less host time).
dispatch.define_op(
    "qk_norm_rope_store_(Tensor(a!) q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, "
    "Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox, Tensor(b!) k_cache, "
    "Tensor(c!) v_cache, Tensor slot_mapping) -> ()",
    validate=_check_qkrs, reference=_qkrs_ref, fake=lambda *a: None, default="triton",
    eager="cuda", debug_check=_debug_qkrs)


def qk_norm_rope_store_(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox,
                        k_cache, v_cache, slot_mapping) -> None:
    """q[T, Hq, D] <- RoPE(RMSNorm(q) * q_weight) in place; the paged caches' rows at
    ``slot_mapping`` (-1 skipped) <- RoPE(RMSNorm(k) * k_weight) and v (k, v [T, Hkv, D] are not
    written). q_weight = k_weight = None: RoPE alone (no QK-norm)."""
    torch.ops.dflash.qk_norm_rope_store_.default(q, k, v, q_weight, k_weight, positions,
                                                 cos_sin_cache, eps, is_neox, k_cache, v_cache,
                                                 slot_mapping)


def rope_(x, positions, cos_sin_cache, is_neox=True) -> None:
    """In place: rotary embedding on x[T, H, D] at ``positions``."""
    torch.ops.dflash.rope_.default(x, positions, cos_sin_cache, is_neox)


def qk_norm_rope_(q, k, q_weight, k_weight, positions, cos_sin_cache, eps=1e-6,
                  is_neox=True) -> None:
    """In place: per-head RMSNorm then RoPE on q[T, Hq, D] and k[T, Hkv, D]."""
    torch.ops.dflash.qk_norm_rope_.default(q, k, q_weight, k_weight, positions, cos_sin_cache,
                                           eps, is_neox)


def knorm_rope_(k, k_weight, positions, cos_sin_cache, eps=1e-6, is_neox=True) -> None:
    """In place: layer l's K-norm (k_weight[l]) then RoPE on k[T, L, Hkv, D], all layers at once."""
    torch.ops.dflash.knorm_rope_.default(k, k_weight, positions, cos_sin_cache, eps, is_neox)


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    def rope(is_neox, rotary_dim, strided=False, seed=5):
        m = Maker(seed, device, dtype)
        # strided: the Q part of a fused QKV output [T, Hq + 2*Hkv, D]
        x = m.rnd(5, 8, 64)[:, :4] if strided else m.rnd(5, 4, 64)
        return dict(x=x, positions=m.positions(5), cos_sin_cache=m.cos_sin(rotary_dim),
                    is_neox=is_neox)

    def qk(is_neox, rotary_dim, seed=6):
        m = Maker(seed, device, dtype)
        qkv = m.rnd(5, 12, 64)  # q and k: views of one fused QKV output
        return dict(q=qkv[:, :8], k=qkv[:, 8:10], q_weight=m.rnd(64), k_weight=m.rnd(64),
                    positions=m.positions(5), cos_sin_cache=m.cos_sin(rotary_dim), eps=EPS,
                    is_neox=is_neox)

    def knorm(is_neox, rotary_dim, seed=7):
        m = Maker(seed, device, dtype)
        # k [T, L, Hkv, D]: a strided view out of the fused [T, L, 2, Hkv, D] K/V output
        return dict(k=m.rnd(5, 3, 2, 2, 64)[:, :, 0], k_weight=m.rnd(3, 64),
                    positions=m.positions(5), cos_sin_cache=m.cos_sin(rotary_dim), eps=EPS,
                    is_neox=is_neox)

    def qkrs(norm, is_neox, rotary_dim, head_major, seed):
        m = Maker(seed, device, dtype)
        qkv = m.rnd(5, 12, 64)  # q, k and v: views of one fused QKV output
        kc, vc = m.caches(1, 4, 4, 2, 64, head_major)
        return dict(q=qkv[:, :8], k=qkv[:, 8:10], v=qkv[:, 10:12],
                    q_weight=m.rnd(64) if norm else None, k_weight=m.rnd(64) if norm else None,
                    positions=m.positions(5), cos_sin_cache=m.cos_sin(rotary_dim), eps=EPS,
                    is_neox=is_neox, k_cache=kc[0], v_cache=vc[0],
                    slot_mapping=m.ints([0, 5, -1, 14, 3]))

    return {
        "rope_": {"neox": rope(True, 64), "gptj": rope(False, 64, seed=8),
                  "neox-partial": rope(True, 32, seed=9),
                  "gptj-partial-strided": rope(False, 16, strided=True, seed=10)},
        "qk_norm_rope_": {"neox": qk(True, 64), "gptj-partial": qk(False, 32, seed=11)},
        "knorm_rope_": {"gptj-strided": knorm(False, 64),
                        "neox-partial-strided": knorm(True, 32, seed=12)},
        "qk_norm_rope_store_": {"norm-neox": qkrs(True, True, 64, False, 15),
                                "rope-gptj-partial-head-major": qkrs(False, False, 32, True, 16)},
    }


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``)."""
    I32, BF16, F32 = torch.int32, torch.bfloat16, torch.float32
    qkrs = [
        ("q-rank2", set_(q=rnd(5, 64)), "q"),
        ("q-int", to("q", dtype=I32), "q"),
        ("k-T-differs", set_(k=rnd(4, 2, 64)), "k"),
        ("k-head_dim-differs", set_(k=rnd(5, 2, 32)), "k"),
        ("k-bf16", to("k", dtype=BF16), "k"),
        ("v-shape", set_(v=rnd(5, 1, 64)), "v"),
        ("v-bf16", to("v", dtype=BF16), "v"),
        ("v-last-stride", set_(v=strided_last(5, 2, 64)), "v"),
        ("k_weight-missing", set_(k_weight=None), "k_weight"),
        ("q_weight-shape", set_(q_weight=rnd(32)), "q_weight"),
        ("k_weight-meta", to("k_weight", device=META), "k_weight"),
        ("eps-negative", set_(eps=-1.0), "eps"),
        ("positions-len", set_(positions=positions(6)), "positions"),
        ("positions-int32", to("positions", dtype=I32), "positions"),
        ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 31)), "cos_sin_cache"),
        ("k_cache-Hkv", set_(k_cache=rnd(4, 4, 4, 64)), "k_cache"),
        ("k_cache-rank3", set_(k_cache=rnd(16, 2, 64)), "k_cache"),
        ("k_cache-bf16", to("k_cache", dtype=BF16), "k_cache"),
        ("v_cache-D", set_(v_cache=rnd(4, 4, 2, 32)), "v_cache"),
        ("v_cache-block_size", set_(v_cache=rnd(4, 8, 2, 64)), "v_cache"),
        ("v_cache-meta", to("v_cache", device=META), "v_cache"),
        ("slot_mapping-int32", to("slot_mapping", dtype=I32), "slot_mapping"),
        ("slot_mapping-len", set_(slot_mapping=torch.arange(4)), "slot_mapping"),
    ]
    return {
        "qk_norm_rope_store_": qkrs,
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
            ("positions-rank2", set_(positions=lambda kw: kw["positions"].view(5, 1)),
             "positions"),
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
    }
