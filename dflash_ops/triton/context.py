"""Triton GEMMs of the context K/V path: ``kv_proj`` and the fused ``context_kv_``.

One tiled GEMM kernel (tl.dot, fp32 accumulation, bias added in fp32, one rounding to the
dtype) serves both ops; a constexpr picks the epilogue:

* ``kv_proj``: store the [BLOCK_M, BLOCK_N] tile of out[T, N] (ragged T and N masked).
* ``context_kv_``: BLOCK_N = D, so an N tile is exactly one head of the layer-major
  ``[L, 2, Hkv, D]`` column order; its (layer, K/V, head) follow from the tile's column index.
  The accumulator is rounded to the dtype (as ``kv_proj_ref`` does); a V tile goes straight to
  the layer's V cache; a K tile gets the per-row RMSNorm with k_weight[layer] (HF rounding:
  T(x * rstd), then T(normed * w)), RoPE at the token's position in fp32 on those rounded values
  (NeoX or GPT-J, partial rotary R <= D, positions outside [0, P) unrotated), rounded once, and
  goes to the layer's K cache. Slots < 0 or >= num_blocks * block_size are skipped. Caches are
  addressed through ``triton.kv``'s cached per-layer table (offset + strides per layer), so a
  CUDA-graph capture after one warm-up call copies nothing to the device.

The rotation partner of each column is formed in registers: GPT-J pairs (2i, 2i+1) by a
reshape to [BM, D/2, 2] and a split; NeoX pairs (i, i + R/2) by a reshape to
[BM, D/R, 2, R/2] when R is a power of two (every real checkpoint), else by ``tl.gather``.

``hidden_norm_weight``: for now a first pass (``triton.norm.rms_norm``, HF rounding) writes
the normed x, then the GEMM reads it. TODO: fold it into the GEMM (pre-scaled weight columns and
a per-row sum of squares accumulated in the K loop) once measured.

Configs come from small functions of (T, N, H, D) below (no autotuning on the hot path). They
were NOT yet measured on a GPU (2026-11-29): the dispatch tables keep ``torch`` as the default
for both ops until they are. Skinny T (<= 64): narrow N tiles so that N = 10240 gives >= 2 x 132
programs; no split-K yet (it needs an fp32 workspace and a second pass to keep one rounding).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import dispatch
from . import kv as _kv
from .norm import rms_norm as _rms_norm

_NUM_SMS = 132  # H200; only used to size skinny-T tiles
_SMEM_RING = 160 * 1024  # bytes of shared memory for the operand ring (H200 has 227 KB/block)


def _stages(want: int, bm: int, bn: int, bk: int, es: int) -> int:
    return max(2, min(want, _SMEM_RING // ((bm + bn) * bk * es)))


@triton.jit
def _tile_ids(NUM_M, NUM_N, GROUP_M: tl.constexpr):
    # grouped ordering: GROUP_M row tiles share each run of column tiles (L2 reuse of w)
    pid = tl.program_id(0)
    in_group = GROUP_M * NUM_N
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(NUM_M - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gemm_tile(x_ptr, w_ptr, b_ptr, rows, cols, T, N, H, x_st_m, x_st_k, w_st_n, w_st_k, b_st,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # acc[BLOCK_M, BLOCK_N] = x[rows, :] @ w[cols, :]^T (+ bias[cols]) in fp32
    k = tl.arange(0, BLOCK_K)
    rmask = rows < T
    cmask = cols < N
    # out-of-range rows/cols read row 0 / col 0 (masked at the store): unmasked in M/N loads
    r = tl.where(rmask, rows, 0).to(tl.int64)
    c = tl.where(cmask, cols, 0).to(tl.int64)
    a_ptrs = x_ptr + r[:, None] * x_st_m + k[None, :] * x_st_k
    b_ptrs = w_ptr + c[:, None] * w_st_n + k[None, :] * w_st_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (k0 + k) < H
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        if x_ptr.dtype.element_ty == tl.float32:  # fp32 in, fp32 math (no TF32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K * x_st_k
        b_ptrs += BLOCK_K * w_st_k
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols * b_st, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _kv_proj_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, N, H, x_st_m, x_st_k, w_st_n, w_st_k, b_st,
                    o_st_m, NUM_M, NUM_N,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile_ids(NUM_M, NUM_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _gemm_tile(x_ptr, w_ptr, b_ptr, rows, cols, T, N, H, x_st_m, x_st_k, w_st_n, w_st_k,
                     b_st, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    mask = (rows < T)[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * o_st_m + cols[None, :]
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _partner(y, BLOCK_M: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
             IS_NEOX: tl.constexpr, GATHER: tl.constexpr):
    # the rotation partner of every column of y[BLOCK_M, D] (columns >= R: anything)
    if IS_NEOX:
        if GATHER:  # R not a power of two
            c = tl.arange(0, D)
            idx = tl.where(c < R // 2, c + R // 2, tl.where(c < R, c - R // 2, c))
            return tl.gather(y, tl.broadcast_to(idx[None, :], (BLOCK_M, D)), 1)
        else:
            q = tl.permute(tl.reshape(y, (BLOCK_M, D // R, 2, R // 2)), (0, 1, 3, 2))
            a, b = tl.split(q)  # first and second half of each R-chunk
            p = tl.permute(tl.join(b, a), (0, 1, 3, 2))
            return tl.reshape(p, (BLOCK_M, D))
    else:
        a, b = tl.split(tl.reshape(y, (BLOCK_M, D // 2, 2)))
        return tl.reshape(tl.join(b, a), (BLOCK_M, D))


@triton.jit
def _context_kv_kernel(x_ptr, w_ptr, b_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr,
                       tab_ptr, T, N, H, HKV, n_layers, x_st_m, x_st_k, w_st_n, w_st_k, b_st,
                       kw_st_l, kw_st_d, pos_st, P, cs_st0, cs_st1, slot_st, NSLOTS, BS, eps,
                       NUM_M, NUM_N,
                       D: tl.constexpr, R: tl.constexpr, IS_NEOX: tl.constexpr,
                       GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                       ALIGN: tl.constexpr):
    pid_m, pid_n = _tile_ids(NUM_M, NUM_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * D + tl.arange(0, D)
    acc = _gemm_tile(x_ptr, w_ptr, b_ptr, rows, cols, T, N, H, x_st_m, x_st_k, w_st_n, w_st_k,
                     b_st, HAS_BIAS, BLOCK_M, D, BLOCK_K, EVEN_K)
    dtype = kc_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)  # the rounding of kv_proj_ref

    # this tile = head h of K (is_v = 0) or V (1) of layer `layer`, column order [L, 2, Hkv, D]
    layer = pid_n // (2 * HKV)
    is_v = (pid_n // HKV) % 2
    h = pid_n % HKV
    d = tl.arange(0, D)
    tmask = rows < T
    slot = tl.load(slot_ptr + rows * slot_st, mask=tmask, other=-1)
    valid = tmask & (slot >= 0) & (slot < NSLOTS)
    slot = tl.where(valid, slot, 0)
    blk = slot // BS
    row = slot - blk * BS
    tab = tab_ptr + (is_v * n_layers + layer) * 5
    off = tl.multiple_of(tl.load(tab), ALIGN)
    s0 = tl.multiple_of(tl.load(tab + 1), ALIGN)
    s1 = tl.multiple_of(tl.load(tab + 2), ALIGN)
    s2 = tl.multiple_of(tl.load(tab + 3), ALIGN)
    dst = (off + blk * s0 + row * s1 + h.to(tl.int64) * s2)[:, None] + d[None, :]
    mask = valid[:, None] & (d < D)[None, :]

    if is_v == 1:
        tl.store(vc_ptr + dst, y.to(dtype), mask=mask)
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / D + eps)
        w = tl.load(kw_ptr + layer * kw_st_l + d * kw_st_d).to(tl.float32)
        y = ((y * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + rows * pos_st, mask=tmask, other=0)
        pvalid = (pos >= 0) & (pos < P)
        # cos/sin index of each column: NeoX i % (R/2), GPT-J i // 2; sign -1 on the first of
        # a pair; columns >= R (and invalid positions) keep y
        if IS_NEOX:
            ci = tl.where(d < R // 2, d, d - R // 2)
            first = d < R // 2
        else:
            ci = d // 2
            first = (d % 2) == 0
        rot = (d < R)[None, :] & pvalid[:, None] & tmask[:, None]
        cs_off = (tl.where(pvalid, pos, 0) * cs_st0)[:, None] + (ci * cs_st1)[None, :]
        cos = tl.load(cs_ptr + cs_off, mask=rot, other=1.0)
        sin = tl.load(cs_ptr + cs_off + (R // 2) * cs_st1, mask=rot, other=0.0)
        sin = tl.where(first[None, :], -sin, sin)
        other = _partner(y, BLOCK_M, D, R, IS_NEOX, GATHER)
        out = tl.where(rot, y * cos + other * sin, y)
        tl.store(kc_ptr + dst, out.to(dtype), mask=mask)


# ------------------------------------------------------------------------------------ configs
def proj_config(t: int, n: int, h: int, elem_size: int = 2):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for out[t, n] = x[t, h] w^T.

    BLOCK_M grows with T (16/32/64/128); skinny T (<= 64) takes the widest N tile (128/64/32)
    that still gives >= 2 programs per SM, since the GEMM is then a stream over w."""
    block_m = 16 if t <= 16 else 32 if t <= 32 else 64 if t <= 64 else 128
    tiles_m = triton.cdiv(t, block_m)
    if t <= 64:
        block_n = 32
        for cand in (128, 64):
            if tiles_m * triton.cdiv(n, cand) >= 2 * _NUM_SMS:
                block_n = cand
                break
        block_k, warps, stages = 128, 4, 4
    else:
        block_n, block_k, warps, stages = 128, 64, 8, 3
    if elem_size >= 4:  # fp32: keep the shared-memory ring small
        block_k, stages = 32, 2
    return block_m, block_n, block_k, 8, warps, _stages(stages, block_m, block_n, block_k,
                                                        elem_size)


def context_config(t: int, d: int, elem_size: int = 2):
    """(BLOCK_M, BLOCK_K, GROUP_M, num_warps, num_stages) for the fused kernel (BLOCK_N = D)."""
    block_m = 16 if t <= 16 else 32 if t <= 32 else 64 if t <= 64 else 128
    block_m = min(block_m, 64 if d >= 256 else 128)  # the epilogue holds a few [BM, D] fp32 tiles
    block_k = 128 if t <= 64 and d <= 64 else 64
    warps = 4 if block_m * d <= 64 * 64 else 8
    stages = 4 if t <= 64 else 3
    if elem_size >= 4:
        block_k, stages = 32, 2
    return block_m, block_k, 8, warps, _stages(stages, block_m, d, block_k, elem_size)


# ------------------------------------------------------------------------------------ ops
def kv_proj(x, w_kv, bias=None):
    t, h = x.shape
    n = w_kv.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if h == 0:
        return out.copy_(bias.expand(t, n)) if bias is not None else out.zero_()
    bm, bn, bk, gm, warps, stages = proj_config(t, n, h, x.element_size())
    num_m, num_n = triton.cdiv(t, bm), triton.cdiv(n, bn)
    b = bias if bias is not None else w_kv
    _kv_proj_kernel[(num_m * num_n,)](
        x, w_kv, b, out, t, n, h, x.stride(0), x.stride(1), w_kv.stride(0), w_kv.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0), num_m, num_n,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
        EVEN_K=h % bk == 0, num_warps=warps, num_stages=stages)
    return out


def context_kv_(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                v_caches, eps, is_neox, hidden_norm_weight=None) -> None:
    t, h = x.shape
    n_layers, (num_blocks, block_size, hkv, d) = len(k_caches), k_caches[0].shape
    if t == 0:
        return
    # the table first: it raises (before any kernel) when first seen during graph capture
    try:
        table, align = _kv._layer_table(k_caches, v_caches)
    except (RuntimeError, ValueError) as e:  # the shared helper names store_kv_
        raise type(e)(str(e).replace("store_kv_", "context_kv_")) from None
    if hidden_norm_weight is not None:  # TODO: fold into the GEMM (see the module docstring)
        x = _rms_norm(x, hidden_norm_weight, eps)
    r = cos_sin_cache.shape[1]
    bm, bk, gm, warps, stages = context_config(t, d, x.element_size())
    num_m, num_n = triton.cdiv(t, bm), n_layers * 2 * hkv
    b = bias if bias is not None else w_kv
    _context_kv_kernel[(num_m * num_n,)](
        x, w_kv, b, k_weight, positions, cos_sin_cache, slot_mapping, k_caches[0], v_caches[0],
        table, t, w_kv.shape[0], h, hkv, n_layers, x.stride(0), x.stride(1), w_kv.stride(0),
        w_kv.stride(1), bias.stride(0) if bias is not None else 0,
        k_weight.stride(0), k_weight.stride(1), positions.stride(0), cos_sin_cache.shape[0],
        cos_sin_cache.stride(0), cos_sin_cache.stride(1), slot_mapping.stride(0),
        num_blocks * block_size, block_size, eps, num_m, num_n,
        D=d, R=r, IS_NEOX=bool(is_neox), GATHER=bool(is_neox) and (r & (r - 1)) != 0,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_K=bk, GROUP_M=gm,
        EVEN_K=h > 0 and h % bk == 0, ALIGN=align, num_warps=warps, num_stages=stages)


# Not yet run on a GPU: registered only on request (DFLASH_OPS_EXPERIMENTAL=1), so that default
# users, `dflash-ops check` included, never reach an unverified kernel. Remove the gate once
# tests/test_context_kv_gpu.py passes on the H200 and the benchmark has set the dispatch tables.
EXPERIMENTAL = os.environ.get("DFLASH_OPS_EXPERIMENTAL", "0") == "1"
if EXPERIMENTAL:
    dispatch.register_backend("kv_proj", "triton", kv_proj)
    dispatch.register_backend("context_kv_", "triton", context_kv_)
