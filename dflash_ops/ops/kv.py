"""The context K/V path: ``store_kv_``, ``kv_proj``, ``context_kv_``.

Paged caches are ``[num_blocks, block_size, Hkv, D]`` with any strides (unit stride in D), one
tensor per layer: token t goes to block ``slot // block_size``, row ``slot % block_size``.
A slot < 0 (padding) or >= num_blocks * block_size is skipped; ``DFLASH_OPS_DEBUG=1`` makes an
out-of-range slot an error. Slots of valid tokens must be distinct.

The stacked weight ``w_kv[L*2*Hkv*D, H]`` is layer-major, K rows then V rows inside a layer, so
the GEMM output viewed as ``[T, L, 2, Hkv, D]`` gives every layer's K and V.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from .. import dispatch
from . import _checks as C
from .norm import rms_norm_ref
from .rope import HEAD_DIMS, rope_values


# store_kv_ ---------------------------------------------------------------------------------
def _check_store(k, v, k_caches, v_caches, slot_mapping, op="store_kv_"):
    C.tensor(op, "k", k, rank=4, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    t, n_layers, hkv, d = k.shape
    if n_layers == 0:
        C.fail(op, f"k must hold at least one layer ([T, L, Hkv, D] with L >= 1) and k_caches "
                   f"one cache per layer, got k {list(k.shape)}")
    C.head_dim(op, "k", d, HEAD_DIMS)
    C.tensor(op, "v", v, shape=tuple(k.shape), device=k.device, last_contiguous=True)
    C.same_dtype(op, "v", v, "k", k)
    for name, lst in (("k_caches", k_caches), ("v_caches", v_caches)):
        C.caches(op, name, lst, n_layers, num_heads=hkv, head_size=d, dtype=k.dtype,
                 device=k.device)
    if k_caches[0].shape[:2] != v_caches[0].shape[:2]:
        C.fail(op, f"v_caches must have the [num_blocks, block_size] of k_caches "
                   f"{list(k_caches[0].shape[:2])}, got {list(v_caches[0].shape[:2])}")
    C.index_vector(op, "slot_mapping", slot_mapping, t, k.device)


def _debug_slots(op, slot_mapping, cache):
    n = cache.shape[0] * cache.shape[1]
    bad = slot_mapping >= n
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        C.fail(op, f"slot_mapping[{i}] = {int(slot_mapping[i])} is past the cache's {n} slots")


def store_kv_ref(k, v, k_caches: List[torch.Tensor], v_caches: List[torch.Tensor],
                 slot_mapping) -> None:
    bs = k_caches[0].shape[1]
    n = k_caches[0].shape[0] * bs
    # Boolean indexing synchronises on CUDA; the reference is the oracle, not the fast path.
    keep = (slot_mapping >= 0) & (slot_mapping < n)
    slots = slot_mapping[keep]
    block, row = slots // bs, slots % bs
    for layer, (kc, vc) in enumerate(zip(k_caches, v_caches)):
        kc[block, row] = k[keep, layer]
        vc[block, row] = v[keep, layer]


dispatch.define_op(
    "store_kv_(Tensor k, Tensor v, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "Tensor slot_mapping) -> ()",
    validate=_check_store, reference=store_kv_ref, fake=lambda *a: None,
    debug_check=lambda k, v, kc, vc, s: _debug_slots("store_kv_", s, kc[0]))


# kv_proj -----------------------------------------------------------------------------------
def _check_proj(x, w_kv, bias=None, op="kv_proj"):
    C.tensor(op, "x", x, rank=2, dtype=C.FLOAT_DTYPES)
    C.tensor(op, "w_kv", w_kv, rank=2, device=x.device)
    C.same_dtype(op, "w_kv", w_kv, "x", x)
    if w_kv.shape[1] != x.shape[1]:
        C.fail(op, f"w_kv must be [N, H={x.shape[1]}] (H = x's columns), got {list(w_kv.shape)}")
    if bias is not None:
        C.tensor(op, "bias", bias, shape=(w_kv.shape[0],), device=x.device)
        C.same_dtype(op, "bias", bias, "x", x)


def kv_proj_ref(x, w_kv, bias=None):
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w_kv.float(), b).to(x.dtype)


dispatch.define_op(
    "kv_proj(Tensor x, Tensor w_kv, Tensor? bias=None) -> Tensor",
    validate=_check_proj, reference=kv_proj_ref,
    fake=lambda x, w_kv, bias=None: x.new_empty((x.shape[0], w_kv.shape[0])))


# context_kv_ -------------------------------------------------------------------------------
def _check_context(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                   v_caches, eps, is_neox, hidden_norm_weight=None):
    op = "context_kv_"
    _check_proj(x, w_kv, bias, op=op)
    if not isinstance(k_caches, (list, tuple)) or len(k_caches) == 0:
        C.fail(op, "k_caches must be a non-empty list of per-layer caches")
    C.tensor(op, "k_caches[0]", k_caches[0], rank=4, dtype=x.dtype, device=x.device)
    n_layers, (_, _, hkv, d) = len(k_caches), k_caches[0].shape
    C.head_dim(op, "k_caches[0]", d, HEAD_DIMS)
    for name, lst in (("k_caches", k_caches), ("v_caches", v_caches)):
        C.caches(op, name, lst, n_layers, num_heads=hkv, head_size=d, dtype=x.dtype,
                 device=x.device)
    n = n_layers * 2 * hkv * d
    if w_kv.shape[0] != n:
        C.fail(op, f"w_kv must have L*2*Hkv*D = {n_layers}*2*{hkv}*{d} = {n} rows (from the "
                   f"caches), got {w_kv.shape[0]}")
    C.tensor(op, "k_weight", k_weight, shape=(n_layers, d), device=x.device)
    C.same_dtype(op, "k_weight", k_weight, "x", x)
    t = x.shape[0]
    C.index_vector(op, "positions", positions, t, x.device)
    C.cos_sin_cache(op, cos_sin_cache, d, x.device)
    C.index_vector(op, "slot_mapping", slot_mapping, t, x.device)
    if k_caches[0].shape[:2] != v_caches[0].shape[:2]:
        C.fail(op, f"v_caches must have the [num_blocks, block_size] of k_caches "
                   f"{list(k_caches[0].shape[:2])}, got {list(v_caches[0].shape[:2])}")
    if hidden_norm_weight is not None:
        C.tensor(op, "hidden_norm_weight", hidden_norm_weight, shape=(x.shape[1],),
                 device=x.device)
        C.same_dtype(op, "hidden_norm_weight", hidden_norm_weight, "x", x)
    C.eps(op, eps)


def context_kv_ref(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                   v_caches, eps, is_neox, hidden_norm_weight=None) -> None:
    n_layers, (_, _, hkv, d) = len(k_caches), k_caches[0].shape
    if hidden_norm_weight is not None:
        x = rms_norm_ref(x, hidden_norm_weight, eps)
    kv = kv_proj_ref(x, w_kv, bias).view(x.shape[0], n_layers, 2, hkv, d)
    k = rope_values(rms_norm_ref(kv[:, :, 0], k_weight, eps), positions, cos_sin_cache, is_neox)
    store_kv_ref(k, kv[:, :, 1], k_caches, v_caches, slot_mapping)


def _debug_context(x, w, b, kw, positions, cache, slots, kc, vc, eps, neox, hn=None):
    from .rope import _debug_positions
    _debug_positions("context_kv_", positions, cache)
    _debug_slots("context_kv_", slots, kc[0])


dispatch.define_op(
    "context_kv_(Tensor x, Tensor w_kv, Tensor? bias, Tensor k_weight, Tensor positions, "
    "Tensor cos_sin_cache, Tensor slot_mapping, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "float eps, bool is_neox, Tensor? hidden_norm_weight=None) -> ()",
    validate=_check_context, reference=context_kv_ref, fake=lambda *a, **k: None,
    debug_check=_debug_context)


def store_kv_(k, v, k_caches, v_caches, slot_mapping) -> None:
    """Write k/v[T, L, Hkv, D] into every layer's paged cache at ``slot_mapping`` (-1 skipped)."""
    torch.ops.dflash.store_kv_.default(k, v, list(k_caches), list(v_caches), slot_mapping)


def kv_proj(x, w_kv, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fused multi-layer K/V GEMM: x[T, H] @ w_kv[L*2*Hkv*D, H]^T (+ bias)."""
    return torch.ops.dflash.kv_proj.default(x, w_kv, bias)


def context_kv_(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                v_caches, eps=1e-6, is_neox=True, hidden_norm_weight=None) -> None:
    """(hidden_norm) -> GEMM -> per-layer K-norm -> RoPE -> paged write of every layer's K/V."""
    torch.ops.dflash.context_kv_.default(x, w_kv, bias, k_weight, positions, cos_sin_cache,
                                         slot_mapping, list(k_caches), list(v_caches), eps,
                                         is_neox, hidden_norm_weight)
