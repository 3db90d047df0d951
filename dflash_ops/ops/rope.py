"""Rotary embedding ops: ``rope_``, ``qk_norm_rope_``, ``knorm_rope_``.

``cos_sin_cache[P, R]`` (fp32) holds, for position p, ``[cos(p*f_0..f_{R/2-1}), sin(...)]``; the
rotary acts on the first R dims of each head (R < D: partial rotary). NeoX style rotates the two
halves ``(x[i], x[i + R/2])``; GPT-J style rotates adjacent pairs ``(x[2i], x[2i+1])``.
A position outside ``[0, P)`` leaves that token unrotated (the norm, if any, still applies);
``DFLASH_OPS_DEBUG=1`` turns it into an error.
"""
from __future__ import annotations

import torch

from .. import dispatch
from . import _checks as C
from .norm import rms_norm_ref

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


dispatch.define_op(
    "rope_(Tensor(a!) x, Tensor positions, Tensor cos_sin_cache, bool is_neox) -> ()",
    validate=_check_rope, reference=_rope_ref, fake=lambda *a: None,
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


dispatch.define_op(
    "qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, "
    "Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox) -> ()",
    validate=_check_qk, reference=_qk_ref, fake=lambda *a: None,
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


dispatch.define_op(
    "knorm_rope_(Tensor(a!) k, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, "
    "float eps, bool is_neox) -> ()",
    validate=_check_knorm, reference=_knorm_ref, fake=lambda *a: None,
    debug_check=lambda k, w, positions, cache, eps, n: _debug_positions(
        "knorm_rope_", positions, cache))


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
