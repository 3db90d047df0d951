"""Triton paged KV-cache write: ``store_kv_``, every layer in one launch.

The L per-layer caches are separate tensors with any strides (unit stride in D), so the kernel
addresses them through a device table ``[2, L, 5]`` int64: for K (row 0) and V (row 1), layer
l's element offset from ``k_caches[0]`` / ``v_caches[0]`` and its 4 strides (the kernel assumes
the last is 1, which the argument checks guarantee). The table is built on the host once per set
of caches and kept in a small LRU keyed by the caches' (data_ptr, strides), so later calls, and
CUDA-graph capture after one warm-up call, copy nothing to the device.

Grid: (cdiv(T, BLOCK_T), L * head blocks); a program copies BLOCK_T tokens x BLOCK_H heads x D
of K and of V (about 2048 elements each, 4 warps, 16-byte vectors). A slot < 0 or >= num_blocks *
block_size is skipped on the device (its token's K/V are not even read). Cache offsets are
64-bit; source offsets 32-bit unless k/v span >= 2^31 elements.
"""
from __future__ import annotations

import collections
import math

import torch
import triton
import triton.language as tl

from .. import dispatch
from ._pdl import pdl_kwargs

_ELEMS = 2048  # elements of K (and of V) a program
_TABLES: "collections.OrderedDict" = collections.OrderedDict()
_MAX_TABLES = 64
_CAPTURED: dict = {}  # tables a CUDA graph captured: kept alive beyond the LRU
_INDEX_32_MAX = 2**31  # offsets/slots below this use 32-bit math (tests lower it)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, tab_ptr, t, h, d, layer, mask, blk, row,
               st_t, st_l, st_h, ALIGN: tl.constexpr, SRC_64: tl.constexpr):
    # src: [T, L, Hkv, D] at t*st_t + layer*st_l + h*st_h; dst: this layer's cache at
    # off + blk*s0 + row*s1 + h*s2 (int64), with off/s0/s1/s2 from the table row tab_ptr[0:4].
    if SRC_64:
        src = t.to(tl.int64)[:, None] * st_t + layer.to(tl.int64) * st_l \
            + h.to(tl.int64)[None, :] * st_h
    else:
        src = t[:, None] * st_t + layer * st_l + h[None, :] * st_h
    off = tl.multiple_of(tl.load(tab_ptr), ALIGN)
    s0 = tl.multiple_of(tl.load(tab_ptr + 1), ALIGN)
    s1 = tl.multiple_of(tl.load(tab_ptr + 2), ALIGN)
    s2 = tl.multiple_of(tl.load(tab_ptr + 3), ALIGN)
    dst = (off + blk.to(tl.int64) * s0 + row.to(tl.int64) * s1)[:, None] \
        + h.to(tl.int64)[None, :] * s2
    vals = tl.load(src_ptr + src[:, :, None] + d[None, None, :], mask=mask)
    tl.store(dst_ptr + dst[:, :, None] + d[None, None, :], vals, mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, tab_ptr, slot_ptr, T, L, HKV, NHB, NSLOTS,
                     BS, slot_st, k_st_t, k_st_l, k_st_h, v_st_t, v_st_l, v_st_h,
                     D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     ALIGN: tl.constexpr, SRC_64: tl.constexpr, SLOT_64: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    layer = g // NHB
    h = (g - layer * NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    tmask = t < T
    slot = tl.load(slot_ptr + t * slot_st, mask=tmask, other=-1)
    valid = tmask & (slot >= 0) & (slot < NSLOTS)
    slot = tl.where(valid, slot, 0)
    if not SLOT_64:  # a 64-bit division costs tens of instructions
        slot = slot.to(tl.int32)
    blk = slot // BS
    row = slot - blk * BS
    mask = (valid[:, None] & (h < HKV)[None, :])[:, :, None]
    _copy_rows(k_ptr, kc_ptr, tab_ptr + layer * 5, t, h, d, layer, mask, blk, row,
               k_st_t, k_st_l, k_st_h, ALIGN, SRC_64)
    _copy_rows(v_ptr, vc_ptr, tab_ptr + (L + layer) * 5, t, h, d, layer, mask, blk, row,
               v_st_t, v_st_l, v_st_h, ALIGN, SRC_64)


def _layer_table(k_caches, v_caches):
    """(table [2, L, 5] int64 on the caches' device, ALIGN): ALIGN is the largest power of two
    (up to 16 bytes) dividing every layer offset and stride, for vectorised stores."""
    first = k_caches[0]
    es = first.element_size()
    key = (first.device, es, tuple((c.data_ptr(), c.stride()) for c in k_caches),
           tuple((c.data_ptr(), c.stride()) for c in v_caches))
    capturing = first.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        if capturing:  # a captured graph reads this table on every replay: never free it
            _CAPTURED[key] = hit
        return hit
    if capturing:
        raise RuntimeError(
            "dflash.store_kv_ (triton): the per-layer cache table for these k_caches/v_caches "
            "is not on the device yet and cannot be copied there during CUDA-graph capture; call "
            "the op once with the same caches before capture")
    rows, align = [], 16 // es  # gcd with a power of two stays one
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        base = caches[0].data_ptr()
        for i, c in enumerate(caches):
            diff = c.data_ptr() - base
            if diff % es:
                raise ValueError(f"dflash.store_kv_: {name}[{i}] is not element-aligned with "
                                 f"{name}[0] (data_ptr difference {diff} bytes)")
            row = [diff // es, *c.stride()]
            for v in row[:4]:
                align = math.gcd(align, v)
            rows.append(row)
    # non_blocking: a pageable host buffer is staged before the call returns; no stream sync
    table = torch.tensor(rows, dtype=torch.int64).view(2, len(k_caches), 5).to(
        first.device, non_blocking=True)
    _TABLES[key] = (table, align)
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return table, align


def config(hkv: int, d: int):
    """(BLOCK_T, BLOCK_H, num_warps): about 2048 elements of K and of V a program, 16 a thread."""
    rows = 1 << max(0, (_ELEMS // d).bit_length() - 1)  # a power of two
    block_h = min(triton.next_power_of_2(max(1, hkv)), rows)
    block_t = rows // block_h
    return block_t, block_h, max(1, min(8, block_t * block_h * d // 512))


def _span(t: torch.Tensor, pads) -> int:
    return sum((s + p) * abs(st) for s, st, p in zip(t.shape, t.stride(), pads))


def store_kv_(k, v, k_caches, v_caches, slot_mapping) -> None:
    t, n_layers, hkv, d = k.shape
    if t == 0 or n_layers == 0 or hkv == 0:
        return
    table, align = _layer_table(k_caches, v_caches)
    num_blocks, block_size = k_caches[0].shape[:2]
    n_slots = num_blocks * block_size
    block_t, block_h, num_warps = config(hkv, d)
    nhb = triton.cdiv(hkv, block_h)
    pads = (block_t, 0, block_h, d)
    _store_kv_kernel[(triton.cdiv(t, block_t), n_layers * nhb)](
        k, v, k_caches[0], v_caches[0], table, slot_mapping, t, n_layers, hkv, nhb, n_slots,
        block_size, slot_mapping.stride(0), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        D=d, BLOCK_T=block_t, BLOCK_H=block_h, ALIGN=align,
        SRC_64=max(_span(k, pads), _span(v, pads)) >= _INDEX_32_MAX,
        SLOT_64=n_slots >= _INDEX_32_MAX,
        num_warps=num_warps, **pdl_kwargs(k.device))


dispatch.register_backend("store_kv_", "triton", store_kv_)
