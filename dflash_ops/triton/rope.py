"""Triton rotary kernels: ``rope_``, ``qk_norm_rope_`` and ``knorm_rope_``, in place.

One kernel serves all three. A program takes BLOCK_T tokens x BLOCK_H heads of one tensor (and
one layer, for ``knorm_rope_``): it loads the tokens' positions and cos/sin rows once, then per
head row (optionally) the RMSNorm in fp32 with HF rounding (normalised value rounded to the
dtype, times the weight, rounded again) and the rotation in fp32 on those rounded values,
rounded once. The rotary part is held as pairs (x1, x2) of [BLOCK_T, BLOCK_H, BLOCK_HALF]:
NeoX loads the two halves, GPT-J loads the interleaved pairs as [..., BLOCK_HALF, 2] (16-byte
vectors) and splits them. Dims R..D (partial rotary) are loaded only when normed.

Grid: (cdiv(T, BLOCK_T), groups); ``qk_norm_rope_`` puts q's head blocks then k's on axis 1 (one
launch), ``knorm_rope_`` layer x head block. About 1024 elements a program with 2 warps, as the
norm kernel (benchmarks/sweep_norm.py). Offsets are 32-bit unless a tensor spans >= 2^31
elements; positions outside [0, P) leave the token unrotated (still normed).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dispatch
from ._pdl import early_trigger, pdl_kwargs

_ELEMS = 1024  # elements a program (see config)
_INDEX_32_MAX = 2**31  # offsets below this use 32-bit math (tests lower it)


@triton.jit
def _slot_rows(slot_ptr, slot_st, n_slots, bs, c_st_b, c_st_r, t, tmask):
    """The cache row offsets (int64, [BLOCK_T]) of tokens t and whether each is stored (a slot
    in [0, n_slots))."""
    slot = tl.load(slot_ptr + t * slot_st, mask=tmask, other=-1)
    ok = tmask & (slot >= 0) & (slot < n_slots)
    slot = tl.where(ok, slot, 0).to(tl.int64)
    blk = slot // bs
    return blk * c_st_b + (slot - blk * bs) * c_st_r, ok


@triton.jit
def _norm_rope_tile(x_ptr, w_ptr, pos_ptr, cs_ptr, t0, h0, T, H, st_t, st_h, w_st, pos_st,
                    P, cs_st0, cs_st1, eps, o_ptr, slot_ptr, slot_st, n_slots, bs, o_st_b,
                    o_st_r, o_st_h,
                    D: tl.constexpr, R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr, NORM: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, OFF_64: tl.constexpr,
                    SLOTS: tl.constexpr):
    # x: rows (t, h) at x_ptr + t*st_t + h*st_h, unit stride in D; w: [D] at stride w_st.
    # The result goes back to x, or with SLOTS to the paged cache at o_ptr: token t's row h at
    # (slot // bs) * o_st_b + (slot % bs) * o_st_r + h * o_st_h (tokens whose slot is outside
    # [0, n_slots) are not stored).
    HALF: tl.constexpr = R // 2
    t = t0 + tl.arange(0, BLOCK_T)
    h = h0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    tmask = t < T
    imask = i < HALF
    rmask = (tmask[:, None] & (h < H)[None, :])[:, :, None]  # [BT, BH, 1]
    mask = rmask & imask[None, None, :]
    if OFF_64:
        row = t.to(tl.int64)[:, None] * st_t + h.to(tl.int64)[None, :] * st_h
    else:
        row = t[:, None] * st_t + h[None, :] * st_h
    row = row[:, :, None]  # [BT, BH, 1]
    if SLOTS:
        crow, ok = _slot_rows(slot_ptr, slot_st, n_slots, bs, o_st_b, o_st_r, t, tmask)
        orow = (crow[:, None] + h.to(tl.int64)[None, :] * o_st_h)[:, :, None]
        omask = rmask & ok[:, None, None]
    else:
        o_ptr = x_ptr
        orow = row
        omask = rmask

    # cos/sin once per token; cos = 1, sin = 0 (and the where below) for a bad position
    pos = tl.load(pos_ptr + t * pos_st, mask=tmask, other=0)
    valid = (pos >= 0) & (pos < P)
    cs_row = tl.where(valid, pos, 0) * cs_st0
    # cos/sin (and the weights below) are loaded over the whole tile, in the layout of the data
    # they multiply, as the norm kernel loads its weight: L1 serves the repeats, and no layout
    # conversion (a shared-memory round trip + barrier) is needed.
    cmask = tl.broadcast_to((tmask & valid)[:, None, None] & imask[None, None, :], mask.shape)
    cs_off = tl.broadcast_to(cs_row[:, None, None] + i[None, None, :] * cs_st1, mask.shape)
    cos = tl.load(cs_ptr + cs_off, mask=cmask, other=1.0)
    sin = tl.load(cs_ptr + cs_off + HALF * cs_st1, mask=cmask, other=0.0)

    if IS_NEOX:  # pairs (i, i + R/2)
        x1 = tl.load(x_ptr + row + i[None, None, :], mask=mask, other=0.0)
        x2 = tl.load(x_ptr + row + HALF + i[None, None, :], mask=mask, other=0.0)
    else:  # pairs (2i, 2i + 1): the first R dims loaded flat (16-byte vectors), then split
        c = tl.arange(0, 2 * BLOCK_HALF)
        cmask2 = rmask & (c < R)[None, None, :]
        xp = tl.load(x_ptr + row + c[None, None, :], mask=cmask2, other=0.0)
        x1, x2 = tl.split(tl.reshape(xp, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
    dtype = x1.dtype
    y1 = x1.to(tl.float32)
    y2 = x2.to(tl.float32)

    if NORM:
        ss = tl.sum(y1 * y1 + y2 * y2, axis=2)
        if BLOCK_TAIL > 0:  # partial rotary: dims R..D are normed, not rotated
            k = tl.arange(0, BLOCK_TAIL)
            kmask = k < D - R
            tail_mask = rmask & kmask[None, None, :]
            xt = tl.load(x_ptr + row + R + k[None, None, :], mask=tail_mask, other=0.0)
            xt = xt.to(tl.float32)
            ss += tl.sum(xt * xt, axis=2)
        rstd = (1.0 / tl.sqrt(ss / D + eps))[:, :, None]
        if IS_NEOX:
            w_off = tl.broadcast_to(i[None, None, :] * w_st, mask.shape)
            w1 = tl.load(w_ptr + w_off, mask=mask, other=0.0)
            w2 = tl.load(w_ptr + w_off + HALF * w_st, mask=mask, other=0.0)
        else:
            w_off = tl.broadcast_to(c[None, None, :] * w_st, cmask2.shape)
            wp = tl.load(w_ptr + w_off, mask=cmask2, other=0.0)
            w1, w2 = tl.split(tl.reshape(wp, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        # HF rounding: normed in the dtype, times the weight in the dtype
        y1 = ((y1 * rstd).to(dtype).to(tl.float32) * w1.to(tl.float32))
        y2 = ((y2 * rstd).to(dtype).to(tl.float32) * w2.to(tl.float32))
        y1 = y1.to(dtype).to(tl.float32)
        y2 = y2.to(dtype).to(tl.float32)
        if BLOCK_TAIL > 0:
            wt_off = tl.broadcast_to((R + k)[None, None, :] * w_st, tail_mask.shape)
            wt = tl.load(w_ptr + wt_off, mask=tail_mask, other=0.0).to(tl.float32)
            yt = (xt * rstd).to(dtype).to(tl.float32) * wt
            tl.store(o_ptr + orow + R + k[None, None, :], yt.to(dtype),
                     mask=omask & kmask[None, None, :])

    v = valid[:, None, None]
    o1 = tl.where(v, y1 * cos - y2 * sin, y1).to(dtype)
    o2 = tl.where(v, y2 * cos + y1 * sin, y2).to(dtype)
    if IS_NEOX:
        smask = omask & imask[None, None, :]
        tl.store(o_ptr + orow + i[None, None, :], o1, mask=smask)
        tl.store(o_ptr + orow + HALF + i[None, None, :], o2, mask=smask)
    else:
        out = tl.reshape(tl.join(o1, o2), (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF))
        tl.store(o_ptr + orow + c[None, None, :], out, mask=omask & (c < R)[None, None, :])
    if SLOTS and not NORM and BLOCK_TAIL > 0:  # RoPE alone into a cache: the tail is copied
        k2 = tl.arange(0, BLOCK_TAIL)
        k2mask = (k2 < D - R)[None, None, :]
        xt2 = tl.load(x_ptr + row + R + k2[None, None, :], mask=rmask & k2mask, other=0.0)
        tl.store(o_ptr + orow + R + k2[None, None, :], xt2, mask=omask & k2mask)


@triton.jit
def _rope_kernel(x_ptr, xw_ptr, y_ptr, yw_ptr, pos_ptr, cs_ptr, T, P, cs_st0, cs_st1, pos_st, eps,
                 HX, NXB, x_st_t, x_st_l, x_st_h, xw_st_l, xw_st, NX_PROGS,
                 HY, y_st_t, y_st_h, yw_st,
                 D: tl.constexpr, R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr, NORM: tl.constexpr,
                 HAS_Y: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HX: tl.constexpr,
                 BLOCK_HY: tl.constexpr, OFF_64: tl.constexpr, PDL: tl.constexpr,
                 TRIGGER: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
        if TRIGGER:  # one wave (_pdl.early_trigger): the next grid may start launching
            tl.extra.cuda.gdc_launch_dependents()
    # x: [T, L, HX, D] (L = 1 for rope_ and q), axis 1 = layer * NXB + head block; with HAS_Y,
    # programs NX_PROGS.. of axis 1 take y: [T, HY, D] (qk_norm_rope_'s k).
    t0 = tl.program_id(0) * BLOCK_T
    g = tl.program_id(1)
    if HAS_Y:
        if g >= NX_PROGS:
            _norm_rope_tile(y_ptr, yw_ptr, pos_ptr, cs_ptr, t0, (g - NX_PROGS) * BLOCK_HY, T, HY,
                            y_st_t, y_st_h, yw_st, pos_st, P, cs_st0, cs_st1, eps,
                            y_ptr, pos_ptr, 0, 0, 1, 0, 0, 0,
                            D, R, BLOCK_HALF, BLOCK_TAIL, IS_NEOX, NORM, BLOCK_T, BLOCK_HY, OFF_64,
                            False)
        else:
            _norm_rope_tile(x_ptr, xw_ptr, pos_ptr, cs_ptr, t0, g * BLOCK_HX, T, HX,
                            x_st_t, x_st_h, xw_st, pos_st, P, cs_st0, cs_st1, eps,
                            x_ptr, pos_ptr, 0, 0, 1, 0, 0, 0,
                            D, R, BLOCK_HALF, BLOCK_TAIL, IS_NEOX, NORM, BLOCK_T, BLOCK_HX, OFF_64,
                            False)
    else:
        layer = g // NXB
        hb = g - layer * NXB
        if OFF_64:  # layer * x_st_l can pass 2^31 when L is the outer dim of a big buffer
            layer = layer.to(tl.int64)
        _norm_rope_tile(x_ptr + layer * x_st_l, xw_ptr + layer * xw_st_l, pos_ptr, cs_ptr, t0,
                        hb * BLOCK_HX, T, HX, x_st_t, x_st_h, xw_st, pos_st, P, cs_st0, cs_st1,
                        eps, x_ptr, pos_ptr, 0, 0, 1, 0, 0, 0,
                        D, R, BLOCK_HALF, BLOCK_TAIL, IS_NEOX, NORM, BLOCK_T, BLOCK_HX,
                        OFF_64, False)


@triton.jit
def _rope_store_kernel(q_ptr, qw_ptr, k_ptr, kw_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr,
                       slot_ptr, T, P, cs_st0, cs_st1, pos_st, slot_st, n_slots, bs, eps,
                       HQ, HKV, NQB, NKB, q_st_t, q_st_h, qw_st, k_st_t, k_st_h, kw_st,
                       v_st_t, v_st_h, kc_st_b, kc_st_r, kc_st_h, vc_st_b, vc_st_r, vc_st_h,
                       D: tl.constexpr, R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr,
                       NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HK: tl.constexpr, OFF_64: tl.constexpr, PDL: tl.constexpr,
                       TRIGGER: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
        if TRIGGER:  # one wave (_pdl.early_trigger): the next grid may start launching
            tl.extra.cuda.gdc_launch_dependents()
    # qk_norm_rope_store_: axis 1 = q's head blocks (in place), then k's (into k_cache), then
    # v's (copied into v_cache); tokens whose slot is outside [0, n_slots) store nothing.
    t0 = tl.program_id(0) * BLOCK_T
    g = tl.program_id(1)
    if g < NQB:
        _norm_rope_tile(q_ptr, qw_ptr, pos_ptr, cs_ptr, t0, g * BLOCK_HQ, T, HQ, q_st_t, q_st_h,
                        qw_st, pos_st, P, cs_st0, cs_st1, eps, q_ptr, slot_ptr, 0, 0, 1, 0, 0, 0,
                        D, R, BLOCK_HALF, BLOCK_TAIL, IS_NEOX, NORM, BLOCK_T, BLOCK_HQ, OFF_64,
                        False)
    elif g < NQB + NKB:
        _norm_rope_tile(k_ptr, kw_ptr, pos_ptr, cs_ptr, t0, (g - NQB) * BLOCK_HK, T, HKV,
                        k_st_t, k_st_h, kw_st, pos_st, P, cs_st0, cs_st1, eps, kc_ptr, slot_ptr,
                        slot_st, n_slots, bs, kc_st_b, kc_st_r, kc_st_h,
                        D, R, BLOCK_HALF, BLOCK_TAIL, IS_NEOX, NORM, BLOCK_T, BLOCK_HK, OFF_64,
                        True)
    else:
        t = t0 + tl.arange(0, BLOCK_T)
        h = (g - NQB - NKB) * BLOCK_HK + tl.arange(0, BLOCK_HK)
        dd = tl.arange(0, BLOCK_D)
        tmask = t < T
        crow, ok = _slot_rows(slot_ptr, slot_st, n_slots, bs, vc_st_b, vc_st_r, t, tmask)
        m = (ok[:, None] & (h < HKV)[None, :])[:, :, None] & (dd < D)[None, None, :]
        if OFF_64:
            row = t.to(tl.int64)[:, None] * v_st_t + h.to(tl.int64)[None, :] * v_st_h
        else:
            row = t[:, None] * v_st_t + h[None, :] * v_st_h
        orow = crow[:, None] + h.to(tl.int64)[None, :] * vc_st_h
        x = tl.load(v_ptr + row[:, :, None] + dd[None, None, :], mask=m, other=0.0)
        tl.store(vc_ptr + orow[:, :, None] + dd[None, None, :], x, mask=m)


def config(d: int, heads):
    """(BLOCK_T, [BLOCK_H per tensor], num_warps) for rows of d elements touched: about 1024
    elements a program, 16 a thread; heads first (one cos/sin row serves them all), then tokens."""
    rows = 1 << max(0, (_ELEMS // d).bit_length() - 1)  # a power of two
    blocks_h = [min(triton.next_power_of_2(max(1, h)), rows) for h in heads]
    block_t = max(1, rows // max(blocks_h))
    return block_t, blocks_h, max(1, min(8, block_t * max(blocks_h) * d // 512))


def _span(t: torch.Tensor, pads=()) -> int:
    """An upper bound on the element offsets a program can form in t (masked lanes included)."""
    pads = tuple(pads) + (0,) * (t.dim() - len(pads))
    return sum((s + p) * abs(st) for s, st, p in zip(t.shape, t.stride(), pads))


def _launch(x, xw, y, yw, positions, cos_sin_cache, eps, is_neox, norm):
    """x: [T, L, HX, D] (a view with L = 1 for 3-D tensors); y: [T, HY, D] or None."""
    t, n_layers, hx, d = x.shape
    if t == 0:
        return
    r = cos_sin_cache.shape[1]
    heads = [hx] + ([y.shape[1]] if y is not None else [])
    block_half = triton.next_power_of_2(r // 2)
    block_tail = triton.next_power_of_2(d - r) if (norm and r < d) else 0
    block_t, blocks_h, num_warps = config(2 * block_half + block_tail, heads)  # elements a row
    block_hx = blocks_h[0]
    block_hy = blocks_h[-1]
    nxb = triton.cdiv(hx, block_hx)
    nx_progs = n_layers * nxb
    groups = nx_progs + (triton.cdiv(y.shape[1], block_hy) if y is not None else 0)
    if groups == 0:
        return
    span = _span(x, (block_t, 0, block_hx, d))
    if y is not None:
        span = max(span, _span(y, (block_t, block_hy, d)))
    if xw is None:  # rope_: no weights (never read)
        xw, xw_st_l, xw_st = x, 0, 0
    elif xw.dim() == 2:
        xw_st_l, xw_st = xw.stride()
    else:
        xw_st_l, xw_st = 0, xw.stride(0)
    yy, yw_ = (y, yw) if y is not None else (x, xw)
    launch = pdl_kwargs(x.device)
    grid = (triton.cdiv(t, block_t), groups)
    _rope_kernel[grid](
        x, xw, yy, yw_, positions, cos_sin_cache, t, cos_sin_cache.shape[0],
        cos_sin_cache.stride(0), cos_sin_cache.stride(1), positions.stride(0), eps,
        hx, nxb, x.stride(0), x.stride(1), x.stride(2), xw_st_l, xw_st, nx_progs,
        y.shape[1] if y is not None else 0, yy.stride(0), yy.stride(-2),
        yw.stride(0) if y is not None else 0,
        D=d, R=r, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail,
        IS_NEOX=bool(is_neox), NORM=norm, HAS_Y=y is not None, BLOCK_T=block_t,
        BLOCK_HX=block_hx, BLOCK_HY=block_hy, OFF_64=span >= _INDEX_32_MAX, num_warps=num_warps,
        TRIGGER=early_trigger(launch, x.device, grid[0] * grid[1]), **launch)


def qk_norm_rope_store_(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox,
                        k_cache, v_cache, slot_mapping) -> None:
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return
    norm = q_weight is not None
    r = cos_sin_cache.shape[1]
    block_half = triton.next_power_of_2(r // 2)
    block_tail = triton.next_power_of_2(d - r) if r < d else 0
    block_t, (block_hq, block_hk), num_warps = config(2 * block_half + block_tail, [hq, hkv])
    nqb, nkb = triton.cdiv(hq, block_hq), triton.cdiv(hkv, block_hk)
    span = max(_span(q, (block_t, block_hq, d)), _span(k, (block_t, block_hk, d)),
               _span(v, (block_t, block_hk, d)))
    qw, kw = (q_weight, k_weight) if norm else (q, q)  # no weights: never read
    bs = k_cache.shape[1]
    launch = pdl_kwargs(q.device)
    grid = (triton.cdiv(t, block_t), nqb + 2 * nkb)
    _rope_store_kernel[grid](
        q, qw, k, kw, v, k_cache, v_cache, positions, cos_sin_cache, slot_mapping, t,
        cos_sin_cache.shape[0], cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        positions.stride(0), slot_mapping.stride(0), k_cache.shape[0] * bs, bs, eps,
        hq, hkv, nqb, nkb, q.stride(0), q.stride(1), qw.stride(0) if norm else 0,
        k.stride(0), k.stride(1), kw.stride(0) if norm else 0, v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        D=d, R=r, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail,
        BLOCK_D=triton.next_power_of_2(d), IS_NEOX=bool(is_neox), NORM=norm, BLOCK_T=block_t,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, OFF_64=span >= _INDEX_32_MAX,
        num_warps=num_warps,
        TRIGGER=early_trigger(launch, q.device, grid[0] * grid[1]), **launch)


def rope_(x, positions, cos_sin_cache, is_neox) -> None:
    _launch(x.unsqueeze(1), None, None, None, positions, cos_sin_cache, 0.0, is_neox, False)


def qk_norm_rope_(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox) -> None:
    _launch(q.unsqueeze(1), q_weight, k, k_weight, positions, cos_sin_cache, eps, is_neox, True)


def knorm_rope_(k, k_weight, positions, cos_sin_cache, eps, is_neox) -> None:
    _launch(k, k_weight, None, None, positions, cos_sin_cache, eps, is_neox, True)


dispatch.register_backend("rope_", "triton", rope_)
dispatch.register_backend("qk_norm_rope_", "triton", qk_norm_rope_)
dispatch.register_backend("knorm_rope_", "triton", knorm_rope_)
dispatch.register_backend("qk_norm_rope_store_", "triton", qk_norm_rope_store_)
