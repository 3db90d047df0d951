"""Triton GEMMs of the context K/V path: ``kv_proj`` and the fused ``context_kv_``.

One tiled GEMM (tl.dot, fp32 accumulation, bias added in fp32, one rounding to the dtype)
serves both ops. x and w are read through TMA tensor descriptors when they allow it (16-bit,
16-byte aligned rows; ``tma_ok``), else through pointers. ``kv_proj`` may run persistent (one
program per SM walking the tiles, ``tl.range(..., flatten=True)``): that is what brings large T
to cuBLAS (Triton 3.6 has no warp specialization on Hopper).

``context_kv_`` has one kernel with two modes:

* fused (T <= SPLIT_T): BLOCK_N = D, so an N tile is exactly one head of the layer-major
  ``[L, 2, Hkv, D]`` column order; its (layer, K/V, head) follow from the tile's column index.
* split (larger T): ``kv_proj`` writes kv[T, N], then the kernel's epilogue alone reads it back
  (FROM_KV): at large T the GEMM wants wider tiles than one head.

The epilogue: the accumulator is rounded to the dtype (as ``kv_proj_ref`` does); a V tile goes
straight to the layer's V cache; a K tile gets the per-row RMSNorm with k_weight[layer] (HF
rounding: T(x * rstd), then T(normed * w)), RoPE at the token's position in fp32 on those
rounded values (NeoX or GPT-J, partial rotary R <= D, positions outside [0, P) unrotated),
rounded once, and goes to the layer's K cache. Slots < 0 or >= num_blocks * block_size are
skipped. Caches are addressed through ``triton.kv``'s cached per-layer table (offset + strides
per layer), so a CUDA-graph capture after one warm-up call copies nothing to the device.

The rotation partner of each column is formed in registers: GPT-J pairs (2i, 2i+1) by a
reshape to [BM, D/2, 2] and a split; NeoX pairs (i, i + R/2) by a reshape to
[BM, D/R, 2, R/2] when R is a power of two (every real checkpoint), else by ``tl.gather``.

``hidden_norm_weight``: a first ``rms_norm`` pass over x, whose output the GEMM reads.

Configs are functions of (T, N, H, D) below, from benchmarks/sweep_context.py runs on the H200;
no autotuning on the hot path.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import dispatch
from ..streams import on_side
from ._pdl import pdl_kwargs
from . import kv as _kv
from .norm import rms_norm as _rms_norm

_NUM_SMS = 132  # H200; only used to size skinny-T tiles
_SMEM_RING = 160 * 1024  # bytes of shared memory for the operand ring (H200 has 227 KB/block)


def _stages(want: int, bm: int, bn: int, bk: int, es: int) -> int:
    return max(2, min(want, _SMEM_RING // ((bm + bn) * bk * es)))


@triton.jit
def _tile_ids(pid, NUM_M, NUM_N, GROUP_M: tl.constexpr):
    # grouped ordering: GROUP_M row tiles share each run of column tiles (L2 reuse of w)
    in_group = GROUP_M * NUM_N
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(NUM_M - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gemm_tile(x_ptr, w_ptr, b_ptr, rows, cols, m0, n0, T, N, H, x_st_m, x_st_k, w_st_n,
               w_st_k, b_st, TMA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # acc[BLOCK_M, BLOCK_N] = x[rows, :] @ w[cols, :]^T (+ bias[cols]) in fp32. TMA: x_ptr and
    # w_ptr are tensor descriptors (blocks [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K], out-of-range
    # elements read as zero); else pointers, out-of-range rows/cols read row/col 0 (masked at
    # the store) so that only K needs masks.
    k = tl.arange(0, BLOCK_K)
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not TMA:
        r = tl.where(rows < T, rows, 0).to(tl.int64)
        c = tl.where(cmask, cols, 0).to(tl.int64)
        a_ptrs = x_ptr + r[:, None] * x_st_m + k[None, :] * x_st_k
        b_ptrs = w_ptr + c[:, None] * w_st_n + k[None, :] * w_st_k
    for k0 in range(0, H, BLOCK_K):
        if TMA:
            a = x_ptr.load([m0, k0])
            b = w_ptr.load([n0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (k0 + k) < H
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        if a.dtype == tl.float32:  # fp32 in, fp32 math (no TF32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        if not TMA:
            a_ptrs += BLOCK_K * x_st_k
            b_ptrs += BLOCK_K * w_st_k
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols * b_st, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _glu_acc(x_ptr, w_ptr, rows, cols, m0, n0, T, N, H, x_st_m, x_st_k, w_st_n, w_st_k,
             TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # (gate, up) [BLOCK_M, BLOCK_N] fp32: x[rows] @ w[cols]^T and x[rows] @ w[N + cols]^T, w
    # holding N gate rows then N up rows, in one K loop (each step loads x's tile once and
    # both weight tiles; _gemm_tile's loads otherwise: a gate tile running past N reads up
    # rows, a column masked at the store)
    k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not TMA:
        r = tl.where(rows < T, rows, 0).to(tl.int64)
        c = tl.where(cols < N, cols, 0).to(tl.int64)
        a_ptrs = x_ptr + r[:, None] * x_st_m + k[None, :] * x_st_k
        g_ptrs = w_ptr + c[:, None] * w_st_n + k[None, :] * w_st_k
        u_ptrs = g_ptrs + N * w_st_n
    for k0 in range(0, H, BLOCK_K):
        if TMA:
            a = x_ptr.load([m0, k0])
            bg = w_ptr.load([n0, k0])
            bu = w_ptr.load([N + n0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            kmask = (k0 + k) < H
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=kmask[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=kmask[None, :], other=0.0)
        if a.dtype == tl.float32:  # fp32 in, fp32 math (no TF32)
            acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision="ieee")
            acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, tl.trans(bg), acc_g)
            acc_u = tl.dot(a, tl.trans(bu), acc_u)
        if not TMA:
            a_ptrs += BLOCK_K * x_st_k
            g_ptrs += BLOCK_K * w_st_k
            u_ptrs += BLOCK_K * w_st_k
    return acc_g, acc_u


@triton.jit
def _store_tile(y, rows, cols, pid_n, T, N, out_ptr, o_st_m, res_ptr, nw_ptr, ss_ptr, NSS,
                ADD_NORM: tl.constexpr):
    # y: the tile's fp32 result, bias added. Plain: out = T(y). ADD_NORM (o_proj with the
    # post-attention norm folded into the next GEMM): o = T(y) as the GEMM's output, the
    # residual (res, row stride o_st_m as out's) becomes h = T(o + res) as fused_add_rms_norm_
    # rounds it, out = T(h * nw) (the norm's weight; the next GEMM applies the row's rstd in its
    # epilogue) and ss[row, pid_n] = the tile's sum of h^2 in fp32 (NSS tiles a row).
    mask = (rows < T)[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * o_st_m + cols[None, :]
    dt = out_ptr.dtype.element_ty
    if ADD_NORM:
        r = tl.load(res_ptr + off, mask=mask, other=0.0).to(tl.float32)
        h = (y.to(dt).to(tl.float32) + r).to(dt)
        tl.store(res_ptr + off, h, mask=mask)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        tl.store(ss_ptr + rows.to(tl.int64) * NSS + pid_n, tl.sum(hf * hf, axis=1),
                 mask=rows < T)
        w = tl.load(nw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + off, (hf * w[None, :]).to(dt), mask=mask)
    else:
        tl.store(out_ptr + off, y.to(dt), mask=mask)


@triton.jit
def _row_rstd(ss_ptr, rows, T, NSS, H, eps, NSSP: tl.constexpr):
    # rsqrt(mean of the row's squares + eps) from the NSS partial sums ADD_NORM stored
    j = tl.arange(0, NSSP)
    s = tl.load(ss_ptr + rows.to(tl.int64)[:, None] * NSS + j[None, :],
                mask=(rows < T)[:, None] & (j < NSS)[None, :], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(s, axis=1) / H + eps)


@triton.jit
def _kv_proj_tile(tile, x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr, T, N, H, x_st_m,
                  x_st_k, w_st_n, w_st_k, b_st, o_st_m, NUM_M, NUM_N, NSS, eps,
                  TMA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  EVEN_K: tl.constexpr, GLU: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                  ADD_NORM: tl.constexpr, RSTD: tl.constexpr, NSSP: tl.constexpr,
                  PDL: tl.constexpr):
    pid_m, pid_n = _tile_ids(tile, NUM_M, NUM_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GLU:
        # silu_mul of the gate | up GEMM (N outputs from 2N weight rows): each half (times the
        # row's rstd with RSTD: the norm folded from ADD_NORM, plus the bias) rounded to the
        # dtype as the GEMM's output would be, then triton/act.py's silu and product
        g, u = _glu_acc(x_ptr, w_ptr, rows, cols, pid_m * BLOCK_M, pid_n * BLOCK_N, T, N, H,
                        x_st_m, x_st_k, w_st_n, w_st_k, TMA, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        if RSTD:
            rstd = _row_rstd(ss_ptr, rows, T, NSS, H, eps, NSSP)[:, None]
            g = g * rstd
            u = u * rstd
        if HAS_BIAS:
            cm = cols < N
            g += tl.load(b_ptr + cols * b_st, mask=cm, other=0.0).to(tl.float32)[None, :]
            u += tl.load(b_ptr + (N + cols) * b_st, mask=cm, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        gf = g.to(dt).to(tl.float32)
        if LIBDEVICE_EXP:
            e = libdevice.exp(-gf)
        else:
            e = tl.exp(-gf)
        sv = tl.math.div_rn(gf, 1.0 + e).to(dt)
        y = sv.to(tl.float32) * u.to(dt).to(tl.float32)
    else:
        y = _gemm_tile(x_ptr, w_ptr, b_ptr, rows, cols, pid_m * BLOCK_M, pid_n * BLOCK_N,
                       T, N, H, x_st_m, x_st_k, w_st_n, w_st_k, b_st, TMA, HAS_BIAS, BLOCK_M,
                       BLOCK_N, BLOCK_K, EVEN_K)
    if PDL:  # the main loop is over: the next grid may start launching (_pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    _store_tile(y, rows, cols, pid_n, T, N, out_ptr, o_st_m, res_ptr, nw_ptr, ss_ptr, NSS,
                ADD_NORM)


@triton.jit
def _kv_proj_kernel(x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr, T, N, H, x_st_m,
                    x_st_k, w_st_n, w_st_k, b_st, o_st_m, NUM_M, NUM_N, NSS, eps,
                    TMA: tl.constexpr, PERSISTENT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, GLU: tl.constexpr,
                    LIBDEVICE_EXP: tl.constexpr, ADD_NORM: tl.constexpr, RSTD: tl.constexpr,
                    NSSP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    # PERSISTENT: one program per SM walks the tiles (stride = grid size); else one per tile.
    # GLU: out = silu_mul(x @ w^T) with w [2N, H] (gate rows, then up rows), N outputs a row.
    # ADD_NORM / RSTD: the residual add and RMSNorm between two GEMMs (_store_tile, _row_rstd).
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), NUM_M * NUM_N, tl.num_programs(0), flatten=True):
            _kv_proj_tile(tile, x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr, T, N, H,
                          x_st_m, x_st_k, w_st_n, w_st_k, b_st, o_st_m, NUM_M, NUM_N, NSS, eps,
                          TMA, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, GLU,
                          LIBDEVICE_EXP, ADD_NORM, RSTD, NSSP, False)  # no trigger: the first
            # tile's would let the next grid launch while most of the tiles remain
    else:
        _kv_proj_tile(tl.program_id(0), x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr,
                      T, N, H, x_st_m, x_st_k, w_st_n, w_st_k, b_st, o_st_m, NUM_M, NUM_N, NSS,
                      eps, TMA, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, GLU,
                      LIBDEVICE_EXP, ADD_NORM, RSTD, NSSP, PDL)


@triton.jit
def _slice_acc(x_ptr, w_ptr, rows, cols, m0, n0, k_lo, k_hi, T, N, x_st_m, x_st_k, w_st_n,
               w_st_k, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    # x[rows, k_lo:k_hi] @ w[cols, k_lo:k_hi]^T in fp32, from zero, in BLOCK_K steps from k_lo
    # (k_lo a multiple of BLOCK_K); loads as in _gemm_tile (TMA reads past H as zeros)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not TMA:
        r = tl.where(rows < T, rows, 0).to(tl.int64)
        c = tl.where(cols < N, cols, 0).to(tl.int64)
        a_ptrs = x_ptr + r[:, None] * x_st_m + (k_lo + k)[None, :].to(tl.int64) * x_st_k
        b_ptrs = w_ptr + c[:, None] * w_st_n + (k_lo + k)[None, :].to(tl.int64) * w_st_k
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if TMA:
            a = x_ptr.load([m0, k0])
            b = w_ptr.load([n0, k0])
        else:
            kmask = (k0 + k) < k_hi
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
            a_ptrs += BLOCK_K * x_st_k
            b_ptrs += BLOCK_K * w_st_k
        if a.dtype == tl.float32:  # fp32 in, fp32 math (no TF32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _split_store(total, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr, rows, cols, pid_n, T, N, b_st,
                 o_st_m, NSS, HAS_BIAS: tl.constexpr, ADD_NORM: tl.constexpr):
    # the tile's sum of slices (+ bias) rounded once to out (ADD_NORM: _store_tile's)
    if HAS_BIAS:
        total += tl.load(b_ptr + cols * b_st, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    _store_tile(total, rows, cols, pid_n, T, N, out_ptr, o_st_m, res_ptr, nw_ptr, ss_ptr, NSS,
                ADD_NORM)


@triton.jit
def _prefetch_l2(wp_ptr, cols, N, w_st_n, k_lo, k_hi, ES: tl.constexpr):
    # a hint, no data: w[cols, k_lo:k_hi] (unit stride along K) into L2, one
    # prefetch.global.L2 a 128-byte line (eight lines of each row a step); rows past N repeat
    # the last row, lines past k_hi the first
    c = tl.where(cols < N, cols, N - 1).to(tl.int64)
    step: tl.constexpr = 128 // ES
    j = tl.arange(0, 8) * step
    for k0 in range(k_lo, k_hi, 8 * step):
        k = tl.where(k0 + j < k_hi, k0 + j, k_lo)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [wp_ptr + c[:, None] * w_st_n + k[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _proj_splitk_kernel(x_ptr, w_ptr, wp_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, res_ptr, nw_ptr,
                        ss_ptr, T, N, H, KS, x_st_m, x_st_k, w_st_n, w_st_k, b_st, o_st_m, NUM_M,
                        NUM_N, NSS, SPLIT: tl.constexpr, SERIAL: tl.constexpr, TMA: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ADD_NORM: tl.constexpr,
                        PREFETCH: tl.constexpr, PDL: tl.constexpr):
    tile = tl.program_id(0)
    pid_m, pid_n = _tile_ids(tile, NUM_M, NUM_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:  # (PDL only) the weight does not come from the prior grid: its slice
        # streams into L2 while that grid finishes (wp_ptr: w itself, w_ptr may be a TMA
        # descriptor); PREFETCH is w's element size in bytes
        if SERIAL:
            _prefetch_l2(wp_ptr, cols, N, w_st_n, 0, H, PREFETCH)
        else:
            _prefetch_l2(wp_ptr, cols, N, w_st_n, tl.program_id(1) * KS,
                         tl.minimum(tl.program_id(1) * KS + KS, H), PREFETCH)
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    # K in SPLIT slices [s * KS, (s + 1) * KS) (KS a multiple of BLOCK_K); the tile's result is
    # ((0 + partial_0) + partial_1) + ... in fp32, each partial a chain of dots from zero.
    # Parallel (grid (tiles, SPLIT)): program (tile, s) stores partial_s in part[s]; the tile's
    # last program to finish (a counter a tile, acq_rel at GPU scope after a block barrier, the
    # order CUTLASS's split-K semaphore uses) sums them in slice order, adds the bias, rounds
    # once to out and sets the counter back to 0, so the next call (or graph replay) finds it
    # zeroed. SERIAL (grid (tiles,)): a program computes its tile's slices in turn, the same
    # operations in the same order: the same bits as the parallel launch (exact mode picks
    # either by the tile count; a row's result never depends on which).
    if SERIAL:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT):
            k_lo = s * KS
            total += _slice_acc(x_ptr, w_ptr, rows, cols, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                k_lo, tl.minimum(k_lo + KS, H), T, N, x_st_m, x_st_k, w_st_n,
                                w_st_k, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        if PDL:  # the main loop is over: the next grid may start launching (_pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
        _split_store(total, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr, rows, cols, pid_n, T, N,
                     b_st, o_st_m, NSS, HAS_BIAS, ADD_NORM)
    else:
        s = tl.program_id(1)
        k_lo = s * KS
        acc = _slice_acc(x_ptr, w_ptr, rows, cols, pid_m * BLOCK_M, pid_n * BLOCK_N, k_lo,
                         tl.minimum(k_lo + KS, H), T, N, x_st_m, x_st_k, w_st_n, w_st_k, TMA,
                         BLOCK_M, BLOCK_N, BLOCK_K)
        if PDL:  # the main loop is over: the next grid may start launching (_pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
        # partials: [SPLIT, NUM_M * BLOCK_M, NUM_N * BLOCK_N] fp32 (64-bit offsets); rows past
        # T neither written nor read (at M 1 a 16-row tile would move 16x the partial bytes)
        pn = NUM_N * BLOCK_N
        sl = tl.cast(NUM_M, tl.int64) * BLOCK_M * pn  # NUM_M may be the JIT's constexpr 1
        poff = rows.to(tl.int64)[:, None] * pn + cols[None, :]
        pmask = (rows < T)[:, None] & (cols >= 0)[None, :]
        tl.store(part_ptr + s * sl + poff, acc, mask=pmask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s2 in range(SPLIT):
                total += tl.load(part_ptr + s2 * sl + poff, mask=pmask, other=0.0,
                                 cache_modifier=".cg")
            _split_store(total, b_ptr, out_ptr, res_ptr, nw_ptr, ss_ptr, rows, cols, pid_n, T,
                         N, b_st, o_st_m, NSS, HAS_BIAS, ADD_NORM)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


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
def _context_tile(tile, x_ptr, w_ptr, b_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr,
                  vc_ptr, tab_ptr, T, N, H, HKV, n_layers, x_st_m, x_st_k, w_st_n, w_st_k,
                  b_st, kw_st_l, kw_st_d, pos_st, P, cs_st0, cs_st1, slot_st, NSLOTS, BS, eps,
                  NUM_M, NUM_N, TMA: tl.constexpr, FROM_KV: tl.constexpr, D: tl.constexpr,
                  R: tl.constexpr, IS_NEOX: tl.constexpr, GATHER: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, ALIGN: tl.constexpr):
    pid_m, pid_n = _tile_ids(tile, NUM_M, NUM_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * D + tl.arange(0, D)
    if FROM_KV:  # the epilogue alone: x_ptr is a precomputed kv[T, N] (already rounded)
        m = (rows < T)[:, None] & (cols < N)[None, :]
        acc = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_st_m + cols[None, :], mask=m,
                      other=0.0).to(tl.float32)
    else:
        acc = _gemm_tile(x_ptr, w_ptr, b_ptr, rows, cols, pid_m * BLOCK_M, pid_n * D, T, N, H,
                         x_st_m, x_st_k, w_st_n, w_st_k, b_st, TMA, HAS_BIAS, BLOCK_M, D,
                         BLOCK_K, EVEN_K)
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


@triton.jit
def _context_kv_kernel(x_ptr, w_ptr, b_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr,
                       vc_ptr, tab_ptr, T, N, H, HKV, n_layers, x_st_m, x_st_k, w_st_n, w_st_k,
                       b_st, kw_st_l, kw_st_d, pos_st, P, cs_st0, cs_st1, slot_st, NSLOTS,
                       BS, eps, NUM_M, NUM_N, TMA: tl.constexpr, FROM_KV: tl.constexpr,
                       D: tl.constexpr, R: tl.constexpr, IS_NEOX: tl.constexpr,
                       GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                       ALIGN: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    _context_tile(tl.program_id(0), x_ptr, w_ptr, b_ptr, kw_ptr, pos_ptr, cs_ptr,
                  slot_ptr, kc_ptr, vc_ptr, tab_ptr, T, N, H, HKV, n_layers, x_st_m, x_st_k,
                  w_st_n, w_st_k, b_st, kw_st_l, kw_st_d, pos_st, P, cs_st0, cs_st1,
                  slot_st, NSLOTS, BS, eps, NUM_M, NUM_N, TMA, FROM_KV, D, R, IS_NEOX, GATHER,
                  HAS_BIAS, BLOCK_M, BLOCK_K, GROUP_M, EVEN_K, ALIGN)


# ------------------------------------------------------------------------------------ configs
class ProjCfg(NamedTuple):
    """A kv_proj launch: tile sizes, GROUP_M (grouped tile order), warps, pipeline stages,
    whether x and w are read through TMA tensor descriptors, persistent programs, the number
    of K slices (split > 1: the split-K kernel, not persistent; a program a slice) and serial
    (the split-K kernel with a program a tile summing its slices itself: the same bits as the
    parallel launch, for exact mode)."""
    bm: int
    bn: int
    bk: int
    gm: int
    warps: int
    stages: int
    tma: bool = True
    persistent: bool = False
    split: int = 1
    serial: bool = False


class CtxCfg(NamedTuple):
    """A context_kv_ launch (``hidden_norm_weight``: a first rms_norm pass writes the normed x).
    split=False: one fused kernel (GEMM tile BLOCK_M x D, BLOCK_K, stages). split=True:
    kv_proj's GEMM (its own config) writes kv[T, N], then the same kernel's epilogue alone
    (bm rows x one head a program, warps) does norm + RoPE + the cache writes."""
    bm: int
    bk: int
    gm: int
    warps: int
    stages: int
    tma: bool = True
    split: bool = False


# Measured on the H200 (benchmarks/sweep_context.py, benchmarks/NOTES.md), Qwen3-8B K/V GEMM
# x[T, 4096] @ w[10240, 4096]^T, bf16: skinny T is a stream over w (84 MB, floor ~19.7 us):
# BLOCK_N 64 with BLOCK_K 128 23.0 us at T <= 16 (cuBLAS 23.1); T = 64: 64x128 tiles 26.1 us
# (cuBLAS 23.4). T = 256: 64x128, 3 stages, 4 warps 39.9 us (cuBLAS 33.1). Larger T is
# compute-bound: persistent 128x128 (4 stages) 123 us at T = 1024 (cuBLAS 123), persistent
# 128x256 436 us at T = 4096 (cuBLAS 454) and 2099 us at 16384 (cuBLAS 1913).
def proj_config(t: int, n: int, h: int, elem_size: int = 2) -> ProjCfg:
    """The kv_proj launch for out[t, n] = x[t, h] w^T (see the measurements above)."""
    if elem_size >= 4:  # fp32 (tests, references): small tiles, pointer loads, no TF32
        return ProjCfg(16 if t <= 16 else 64, 64, 32, 8, 4, 2, False)
    if t <= 16:
        cfg = ProjCfg(16, 64, 128, 8, 4, 4)
    elif t <= 64:
        cfg = ProjCfg(32 if t <= 32 else 64, 128, 128, 8, 4, 3)
    elif t <= 256:
        cfg = ProjCfg(64, 128, 64, 8, 4, 3)
    elif t <= 2048:
        cfg = ProjCfg(128, 128, 64, 8, 8, 4, True, True)
    else:
        cfg = ProjCfg(128, 256, 64, 8, 8, 3, True, True)
    return cfg._replace(stages=_stages(cfg.stages, cfg.bm, cfg.bn, cfg.bk, elem_size))


# The fused kernel (BLOCK_N = D = one head) wins while the GEMM streams w (T <= 64): Qwen3-8B
# 23.9 us at T = 1 (bm 16, bk 128, 4 stages; F.linear 23.5), 24.8 at T = 16, 28.2 at T = 64.
# From T = 256 on its 128 x D tiles lose to kv_proj's (55 vs 40 us at T = 256, 2528 vs 2099 at
# 16384), so the split path runs kv_proj then the epilogue alone. hidden_norm is a first
# rms_norm pass: folded into the GEMM it measured slower at every T (28.0 vs 26.2 us at T = 1,
# 2x at T >= 64: the scaled x tile goes through registers instead of straight to the MMA).
SPLIT_T = 64


def context_config(t: int, d: int, elem_size: int = 2) -> CtxCfg:
    """The context_kv_ launch (see the measurements above)."""
    if t > SPLIT_T:
        return CtxCfg(max(8, 4096 // d), 64, 8, 4, 1, split=True)
    block_m = 16 if t <= 16 else 32 if t <= 32 else 64
    block_m = min(block_m, 32 if d >= 256 else 64)  # the epilogue holds a few [BM, D] fp32 tiles
    if elem_size >= 4:
        return CtxCfg(block_m, 32, 8, 4, 2, False)
    return CtxCfg(block_m, 128, 8, 4, _stages(4, block_m, d, 128, elem_size), t <= 16)


# ------------------------------------------------------------------------------------ launches
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tma_ok(*ts: torch.Tensor) -> bool:
    """Whether 2-D tensors can be read through TMA descriptors: 16-bit dtype, unit stride in
    the last dim, 16-byte aligned base and row stride, and a Hopper+ GPU (or the interpreter)."""
    for x in ts:
        es = x.element_size()
        if (es != 2 or x.stride(1) != 1 or (x.stride(0) * es) % 16 or x.data_ptr() % 16
                or x.shape[0] == 0):
            return False
    if ts[0].is_cuda:
        return torch.cuda.get_device_capability(ts[0].device)[0] >= 9 and not _interpreting()
    return _interpreting()


def prefetch_bytes(w: torch.Tensor, ks: int) -> int:
    """The split-K kernel's PREFETCH: w's element size where its rows have unit stride along
    K (the prefetch walks a row slice's 128-byte lines by address), else 0 (no prefetch).
    The 16-byte conditions are the bulk prefetch's (session 36); the line prefetch needs none,
    but only weights that meet them have run it on a GPU, so they stay until one that does
    not has."""
    es = w.element_size()
    ok = (w.stride(1) == 1 and w.data_ptr() % 16 == 0 and (w.stride(0) * es) % 16 == 0
          and (ks * es) % 16 == 0 and (w.shape[1] * es) % 16 == 0)
    return es if ok else 0


def _grid(tiles: int, persistent: bool, device: torch.device) -> int:
    """One program per tile, or (persistent) at most one per SM walking the tiles."""
    if not persistent:
        return tiles
    sms = 3 if device.type != "cuda" else sm_count(device.index or 0)  # interpreter: a few
    return max(1, min(tiles, sms))


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _operands(x, w, bm, bn, bk, tma):
    if tma:
        return (TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk]),
                TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk]))
    return x, w


# split-K tile counters: one int32 a tile, zero between calls (the last program of a tile sets
# its counter back), kept per device; grown (a new zeroed buffer) outside graph capture only.
# A buffer once handed out is never freed (_RETIRED): a graph captured with it keeps its
# address. Calls share the buffer, so split-K launches must not run concurrently on one device
# (two streams, or parallel branches of a graph): the models run one stream, and the DFlash 2
# selector's branch runs on ``streams.side_stream`` (its own buffer: the key's ``on_side``).
_COUNTERS: dict = {}
_RETIRED: list = []


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    key = (device.type, device.index, on_side(device))  # a branch's own (streams.py)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a buffer made inside a capture belongs to that graph's pool: a zeroed one a call
            # (captured as a memset), not cached
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(tiles, 16384), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def launch_proj(x, w_kv, bias, out, cfg: ProjCfg, add_norm=None) -> None:
    """out = x @ w_kv^T + bias with ``cfg``. ``add_norm`` = (residual, norm_weight, ss): the
    ADD_NORM epilogue (_store_tile) instead: residual += the result, out = T(residual * w), ss
    [T, NUM_N] fp32 the tiles' sums of squares (residual and out contiguous, out's shape)."""
    t, h = x.shape
    n = w_kv.shape[0]
    tma = cfg.tma and tma_ok(x, w_kv)
    num_m, num_n = triton.cdiv(t, cfg.bm), triton.cdiv(n, cfg.bn)
    xo, wo = _operands(x, w_kv, cfg.bm, cfg.bn, cfg.bk, tma)
    b = bias if bias is not None else out
    res, nw, ss = add_norm if add_norm is not None else (out, out, out)
    nss = ss.shape[1] if add_norm is not None else 1
    if cfg.split > 1 or cfg.serial:
        # K slices of whole BLOCK_K steps; trailing slices may be empty (they add zeros)
        ks = triton.cdiv(triton.cdiv(h, cfg.split), cfg.bk) * cfg.bk
        if cfg.serial:
            part = cnt = out  # not read
        else:
            part = torch.empty((cfg.split, num_m * cfg.bm, num_n * cfg.bn),
                               dtype=torch.float32, device=x.device)
            cnt = _tile_counters(x.device, num_m * num_n)
        pdl = pdl_kwargs(x.device)
        _proj_splitk_kernel[(num_m * num_n,) if cfg.serial else (num_m * num_n, cfg.split)](
            xo, wo, w_kv, b, out, part, cnt, res, nw, ss, t, n, h, ks, x.stride(0), x.stride(1),
            w_kv.stride(0), w_kv.stride(1), bias.stride(0) if bias is not None else 0,
            out.stride(0), num_m, num_n, nss, SPLIT=cfg.split, SERIAL=cfg.serial, TMA=tma,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk,
            GROUP_M=cfg.gm, ADD_NORM=add_norm is not None,
            PREFETCH=prefetch_bytes(w_kv, ks) if pdl["PDL"] else 0, num_warps=cfg.warps,
            num_stages=cfg.stages, **pdl)
        return
    _kv_proj_kernel[(_grid(num_m * num_n, cfg.persistent, x.device),)](
        xo, wo, b, out, res, nw, ss, t, n, h, x.stride(0), x.stride(1), w_kv.stride(0),
        w_kv.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0), num_m, num_n,
        nss, 0.0, TMA=tma, PERSISTENT=cfg.persistent, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.gm,
        EVEN_K=h % cfg.bk == 0, GLU=False, LIBDEVICE_EXP=False, ADD_NORM=add_norm is not None,
        RSTD=False, NSSP=1, num_warps=cfg.warps, num_stages=cfg.stages, **pdl_kwargs(x.device))


def proj_add_norm_(x, w, bias, residual, norm_weight, *, cfg: ProjCfg):
    """A GEMM and the residual add + RMSNorm after it, with the norm's row scale left to the
    next GEMM: ``residual += x @ w^T + bias`` (each rounded as the GEMM's output and as
    ``fused_add_rms_norm_``'s sum), returns (u, ss): u = T(residual * norm_weight) [T, N] and
    ss [T, NUM_N] fp32, the row's sum of squares in NUM_N partials. ``glu_proj(u, ..., rstd=
    (ss, eps))`` then computes the normed input's GEMM: rstd(row) * (u @ w^T). The bits differ
    from the unfused chain (one rounding of the normed row fewer, rstd applied after the sum):
    the tolerance rule, not bit equality. residual: [T, N] contiguous, x's dtype."""
    t, h = x.shape
    n = w.shape[0]
    num_n = triton.cdiv(n, cfg.bn)
    u = torch.empty((t, n), dtype=x.dtype, device=x.device)
    ss = torch.empty((t, num_n), dtype=torch.float32, device=x.device)
    if t and n:
        launch_proj(x, w, bias, u, cfg, add_norm=(residual, norm_weight, ss))
    return u, ss


def glu_tile(cfg: ProjCfg) -> ProjCfg:
    """The SwiGLU launch of a gate | up GEMM's table config: half the N tile (a program then
    streams the same weight rows as the plain GEMM's program, half gate and half up), one
    split (glu_proj has no split-K)."""
    return cfg._replace(bn=max(16, cfg.bn // 2), split=1, serial=False)


def glu_proj(x, w_gu, bias=None, *, cfg: ProjCfg, rstd=None):
    """``silu_mul(x @ w_gu^T + bias)`` in one launch: w_gu [2I, H] holds the gate rows then the
    up rows (the models' gate_up), the result is [T, I]. Each program computes a gate and an up
    tile of the same I columns in one K loop, rounds both to the dtype (the GEMM's output) and
    applies triton/act.py's silu and product, so the result is bit for bit ``silu_mul`` of
    ``kv_proj`` with the same tile (``cfg`` as given: see ``glu_tile``). ``rstd`` = (ss, eps):
    x is ``proj_add_norm_``'s u and each row's sums times rsqrt(sum(ss[row]) / H + eps) before
    the rounding (the folded RMSNorm)."""
    t, h = x.shape
    n = w_gu.shape[0] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if h == 0:  # silu(bias_g) * bias_u, or zeros
        from .act import silu_mul
        src = bias.expand(t, 2 * n) if bias is not None else x.new_zeros((t, 2 * n))
        return out.copy_(silu_mul(src.contiguous()))
    tma = cfg.tma and tma_ok(x, w_gu)
    num_m, num_n = triton.cdiv(t, cfg.bm), triton.cdiv(n, cfg.bn)
    xo, wo = _operands(x, w_gu, cfg.bm, cfg.bn, cfg.bk, tma)
    b = bias if bias is not None else out
    ss, eps = rstd if rstd is not None else (out, 0.0)
    nss = ss.shape[1] if rstd is not None else 1
    _kv_proj_kernel[(_grid(num_m * num_n, cfg.persistent, x.device),)](
        xo, wo, b, out, out, out, ss, t, n, h, x.stride(0), x.stride(1), w_gu.stride(0),
        w_gu.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0), num_m, num_n,
        nss, float(eps), TMA=tma, PERSISTENT=cfg.persistent, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.gm,
        EVEN_K=h % cfg.bk == 0, GLU=True, LIBDEVICE_EXP=not _interpreting(),
        ADD_NORM=False, RSTD=rstd is not None, NSSP=triton.next_power_of_2(nss),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_kwargs(x.device))
    return out


def kv_proj(x, w_kv, bias=None, *, cfg: Optional[ProjCfg] = None):
    t, h = x.shape
    n = w_kv.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if h == 0:
        return out.copy_(bias.expand(t, n)) if bias is not None else out.zero_()
    launch_proj(x, w_kv, bias, out, cfg or proj_config(t, n, h, x.element_size()))
    return out


def context_kv_(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                v_caches, eps, is_neox, hidden_norm_weight=None, hidden_rms=False, *,
                cfg: Optional[CtxCfg] = None) -> None:
    t, h = x.shape
    n_layers, (num_blocks, block_size, hkv, d) = len(k_caches), k_caches[0].shape
    if t == 0:
        return
    # the table first: it raises (before any kernel) when first seen during graph capture
    try:
        table, align = _kv._layer_table(k_caches, v_caches)
    except (RuntimeError, ValueError) as e:  # the shared helper names store_kv_
        raise type(e)(str(e).replace("store_kv_", "context_kv_")) from None
    cfg = cfg or context_config(t, d, x.element_size())
    if hidden_rms and hidden_norm_weight is None:  # the weight is in w_kv: a norm of ones
        hidden_norm_weight = torch.ones(h, dtype=x.dtype, device=x.device)
    if hidden_norm_weight is not None:  # the norm pass reads rows and the weight with unit stride
        w = hidden_norm_weight
        x = _rms_norm(x if x.stride(1) == 1 else x.contiguous(),
                      w if w.stride(0) == 1 else w.contiguous(), eps)
    if cfg.split:  # the GEMM, then the epilogue alone over its output
        kv = kv_proj(x, w_kv, bias)
        src, tma, bias = kv, False, None
    else:
        src, tma = x, cfg.tma and h > 0 and tma_ok(x, w_kv)
    r = cos_sin_cache.shape[1]
    num_m, num_n = triton.cdiv(t, cfg.bm), n_layers * 2 * hkv
    xo, wo = (src, w_kv) if cfg.split else _operands(x, w_kv, cfg.bm, d, cfg.bk, tma)
    b = bias if bias is not None else k_weight
    _context_kv_kernel[(num_m * num_n,)](
        xo, wo, b, k_weight, positions, cos_sin_cache,
        slot_mapping, k_caches[0], v_caches[0], table, t, w_kv.shape[0], h, hkv, n_layers,
        src.stride(0), src.stride(1), w_kv.stride(0), w_kv.stride(1),
        bias.stride(0) if bias is not None else 0,
        k_weight.stride(0), k_weight.stride(1), positions.stride(0), cos_sin_cache.shape[0],
        cos_sin_cache.stride(0), cos_sin_cache.stride(1), slot_mapping.stride(0),
        num_blocks * block_size, block_size, eps, num_m, num_n, TMA=tma, FROM_KV=cfg.split, D=d,
        R=r, IS_NEOX=bool(is_neox),
        GATHER=bool(is_neox) and (r & (r - 1)) != 0, HAS_BIAS=bias is not None, BLOCK_M=cfg.bm,
        BLOCK_K=cfg.bk, GROUP_M=cfg.gm, EVEN_K=h > 0 and h % cfg.bk == 0, ALIGN=align,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_kwargs(x.device))


dispatch.register_backend("kv_proj", "triton", kv_proj)
dispatch.register_backend("context_kv_", "triton", context_kv_)
