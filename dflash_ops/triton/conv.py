"""Triton kernels of ``grouped_dyn_conv`` (``ops/conv.py``).

For each tap o < K (a constexpr) a program loads x's rows t - o (masked where t % B < o: no tap
crosses into the previous block), the static taps base[o, c] and the dynamic taps
dynamic[t, o, c // group_size], accumulates in fp32 and stores y once in x's dtype. The bytes are
x (K reads, the later ones from L1/L2), dynamic and y: a streaming kernel.
- A power-of-two group size (4-256; DFlash 2's default is 16): a [16 rows, BLOCK_G groups,
  group_size] tile (BLOCK_G * group_size <= 512 channels), the dynamic tap loaded once per
  (row, group) and broadcast over the group's channels.
- Any other group size: a [BLOCK_T, BLOCK_C] tile with the dynamic tap gathered per channel.
Grids from the shapes only: graph-capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dispatch
from ._pdl import pdl_kwargs


@triton.jit
def _conv_kernel(x_ptr, d_ptr, b_ptr, y_ptr, T, H, B, GS, sx, sd_t, sd_k, sb,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    # any group size: the dynamic tap is gathered per channel
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_t = t < T
    in_c = c < H
    pos = t % B
    grp = c // GS
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for o in tl.static_range(K):
        ok = in_t & (pos >= o)
        m = ok[:, None] & in_c[None, :]
        xv = tl.load(x_ptr + (t - o)[:, None] * sx + c[None, :], mask=m, other=0.0)
        bv = tl.load(b_ptr + o * sb + c, mask=in_c, other=0.0)
        dv = tl.load(d_ptr + t[:, None] * sd_t + o * sd_k + grp[None, :], mask=m, other=0.0)
        acc += (bv.to(tl.float32)[None, :] + dv.to(tl.float32)) * xv.to(tl.float32)
    mo = in_t[:, None] & in_c[None, :]
    tl.store(y_ptr + t[:, None] * H + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=mo)


@triton.jit
def _conv_groups_kernel(x_ptr, d_ptr, b_ptr, y_ptr, T, H, B, G, sx, sd_t, sd_k, sb,
                        K: tl.constexpr, GS: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    # a power-of-two group size: a [BLOCK_T, BLOCK_G, GS] tile, one dynamic load per group
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    gi = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, GS)
    in_t = t < T
    in_g = gi < G
    pos = t % B
    c = gi[:, None] * GS + j[None, :]                       # [BLOCK_G, GS]
    in_c = in_g[:, None] & (j[None, :] < GS)
    acc = tl.zeros((BLOCK_T, BLOCK_G, GS), dtype=tl.float32)
    for o in tl.static_range(K):
        ok = in_t & (pos >= o)
        m2 = ok[:, None] & in_g[None, :]                     # [BLOCK_T, BLOCK_G]
        m3 = m2[:, :, None] & in_c[None, :, :]
        xv = tl.load(x_ptr + (t - o)[:, None, None] * sx + c[None, :, :], mask=m3, other=0.0)
        bv = tl.load(b_ptr + o * sb + c, mask=in_c, other=0.0)
        dv = tl.load(d_ptr + t[:, None] * sd_t + o * sd_k + gi[None, :], mask=m2, other=0.0)
        w = bv.to(tl.float32)[None, :, :] + dv.to(tl.float32)[:, :, None]
        acc += w * xv.to(tl.float32)
    mo = in_t[:, None, None] & in_c[None, :, :]
    tl.store(y_ptr + t[:, None, None] * H + c[None, :, :], acc.to(y_ptr.dtype.element_ty),
             mask=mo)


def grouped_dyn_conv(x, dynamic, base, group_size: int, block_size: int) -> torch.Tensor:
    t, h = x.shape
    y = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return y
    k = base.shape[0]
    args = (x, dynamic, base, y, t, h, block_size)
    strides = (x.stride(0), dynamic.stride(0), dynamic.stride(1), base.stride(0))
    gs = group_size
    if gs & (gs - 1) == 0 and 4 <= gs <= 256:
        groups = h // gs
        block_g = max(1, min(triton.next_power_of_2(groups), 512 // gs))
        block_t = 16
        grid = (triton.cdiv(t, block_t), triton.cdiv(groups, block_g))
        _conv_groups_kernel[grid](*args, groups, *strides, K=k, GS=gs, BLOCK_T=block_t,
                                  BLOCK_G=block_g, num_warps=8, **pdl_kwargs(x.device))
        return y
    block_c = min(256, triton.next_power_of_2(h))
    block_t = max(1, min(16, 2048 // block_c))
    grid = (triton.cdiv(t, block_t), triton.cdiv(h, block_c))
    _conv_kernel[grid](*args, gs, *strides, K=k, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4,
                       **pdl_kwargs(x.device))
    return y


dispatch.register_backend("grouped_dyn_conv", "triton", grouped_dyn_conv)


# ---------------------------------------------------------------------------- conv_add_rms_norm_
# One program a row t. A BLOCK-wide chunk of channels: the convolution of x's rows t - o (as
# above, fp32, rounded to x's dtype), added into the residual row (rounded, stored), its squares
# summed. Rows up to MAX_ONE_CHUNK channels are one chunk held in registers (the output then
# needs no second pass); wider rows loop over chunks, then over the chunks again (the residual
# row back from L1/L2) for the output. RMSNorm's numerics (fp32 rstd, cast, times the weight
# in the dtype). The dynamic taps are gathered per channel (c // group_size): at the drafter's
# few rows a row's taps are 2 * K * G values, L1-resident.
MAX_ONE_CHUNK = 8192


@triton.jit
def _conv_add_chunk(x_ptr, d_ptr, b_ptr, r_ptr, t, pos, c, H, GS, sx, sd_t, sd_k, sb, sr,
                    K: tl.constexpr):
    """The residual chunk c of row t after the add (stored), in the dtype."""
    dt = x_ptr.dtype.element_ty
    in_c = c < H
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for o in tl.static_range(K):
        m = in_c & (pos >= o)
        xv = tl.load(x_ptr + (t - o) * sx + c, mask=m, other=0.0)
        bv = tl.load(b_ptr + o * sb + c, mask=in_c, other=0.0)
        dv = tl.load(d_ptr + t * sd_t + o * sd_k + c // GS, mask=m, other=0.0)
        acc += (bv.to(tl.float32) + dv.to(tl.float32)) * xv.to(tl.float32)
    rv = tl.load(r_ptr + t * sr + c, mask=in_c, other=0.0)
    rv = (rv.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
    tl.store(r_ptr + t * sr + c, rv, mask=in_c)
    return rv


@triton.jit
def _conv_add_norm_kernel(x_ptr, d_ptr, b_ptr, r_ptr, w_ptr, out_ptr, H, B, GS, sx, sd_t, sd_k,
                          sb, sr, so, eps, K: tl.constexpr, BLOCK: tl.constexpr,
                          ONE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    # the row's position in its block, broadcast (the interpreter cannot AND a scalar bool
    # with a block)
    pos = tl.zeros((BLOCK,), dtype=tl.int64) + t % B
    dt = x_ptr.dtype.element_ty
    if ONE_CHUNK:
        c = tl.arange(0, BLOCK)
        wv = tl.load(w_ptr + c, mask=c < H, other=0.0)
        rf = _conv_add_chunk(x_ptr, d_ptr, b_ptr, r_ptr, t, pos, c, H, GS, sx, sd_t, sd_k, sb,
                             sr, K).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / H + eps)
        tl.store(out_ptr + t * so + c, (rf * rstd).to(dt) * wv, mask=c < H)
    else:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, H, BLOCK):
            rf = _conv_add_chunk(x_ptr, d_ptr, b_ptr, r_ptr, t, pos, c0 + tl.arange(0, BLOCK), H,
                                 GS, sx, sd_t, sd_k, sb, sr, K).to(tl.float32)
            sq += rf * rf
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / H + eps)
        for c0 in range(0, H, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            in_c = c < H
            rv = tl.load(r_ptr + t * sr + c, mask=in_c, other=0.0)
            wv = tl.load(w_ptr + c, mask=in_c, other=0.0)
            tl.store(out_ptr + t * so + c, (rv.to(tl.float32) * rstd).to(dt) * wv, mask=in_c)


def conv_add_rms_norm_(x, residual, dynamic, base, group_size: int, block_size: int, weight,
                       eps: float, *, out) -> None:
    t, h = x.shape
    if t == 0 or h == 0:
        return
    one = h <= MAX_ONE_CHUNK
    block = triton.next_power_of_2(h) if one else 2048
    _conv_add_norm_kernel[(t,)](x, dynamic, base, residual, weight, out, h, block_size,
                                group_size, x.stride(0), dynamic.stride(0), dynamic.stride(1),
                                base.stride(0), residual.stride(0), out.stride(0), eps,
                                K=base.shape[0], BLOCK=block, ONE_CHUNK=one,
                                num_warps=16 if block >= 4096 else 8 if block >= 1024 else 4,
                                **pdl_kwargs(x.device))


dispatch.register_backend("conv_add_rms_norm_", "triton", conv_add_rms_norm_)
