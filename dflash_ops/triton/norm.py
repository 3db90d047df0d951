"""Triton RMSNorm kernels: ``rms_norm`` and ``fused_add_rms_norm_``.

One program normalises BLOCK_M rows of D (BLOCK_D = next power of two >= D) in fp32 with HF
rounding (normalised value rounded to the dtype before the weight multiply). Rows are addressed
through up to three leading dims with their own strides, so strided views (a K view of a fused
``[T, L, 2, Hkv, D]`` GEMM output) are read and written in place without copies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dispatch
from ..ops._checks import merged_leading_dims
from ._pdl import early_trigger, pdl_kwargs


def row_layout(t: torch.Tensor, what: str, op: str):
    """(sizes[3], strides[3]) of t's leading dims after merging the mergeable ones."""
    sizes, strides = merged_leading_dims(t)
    if len(sizes) > 3:
        raise ValueError(f"dflash.{op}: {what} has more than 3 non-mergeable leading dims "
                         f"(shape {list(t.shape)}, strides {list(t.stride())}); make it contiguous")
    # Pad at the inner end: size-1 inner dims arrive as the constant 1 (Triton specialises it),
    # so a row-contiguous tensor costs no division at all.
    pad = 3 - len(sizes)
    return sizes + [1] * pad, strides + [0] * pad


@triton.jit
def _row_offset(r, S1, S2, st0, st1, st2):
    # r: row indices (int32 unless rows >= 2^31); the offset is int64.
    i2 = r % S2
    i1 = (r // S2) % S1
    i0 = r // (S2 * S1)
    return i0.to(tl.int64) * st0 + i1.to(tl.int64) * st1 + i2.to(tl.int64) * st2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, w_ptr, n_rows, D, eps,
                     xS1, xS2, xs0, xs1, xs2,
                     rS1, rS2, rs0, rs1, rs2,
                     oS1, oS2, os0, os1, os2,
                     R, RPG,
                     FUSED_ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     INDEX_64: tl.constexpr, PDL: tl.constexpr,
                     TRIGGER: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
        if TRIGGER:  # one wave (_pdl.early_trigger): the next grid may start launching
            tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INDEX_64:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    else:  # 32-bit index math: a 64-bit division costs tens of instructions a row
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < D)
    x_off = _row_offset(rows, xS1, xS2, xs0, xs1, xs2)
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if FUSED_ADD:
        r_off = _row_offset(rows, rS1, rS2, rs0, rs1, rs2)
        res = tl.load(res_ptr + r_off[:, None] + cols[None, :], mask=mask, other=0.0)
        summed = (xf + res.to(tl.float32)).to(dtype)
        tl.store(res_ptr + r_off[:, None] + cols[None, :], summed, mask=mask)
        xf = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    normed = (xf * rstd[:, None]).to(dtype).to(tl.float32)
    g = (rows % R) // RPG
    w = tl.load(w_ptr + (g * D)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(dtype)
    o_off = _row_offset(rows, oS1, oS2, os0, os1, os2)
    tl.store(out_ptr + o_off[:, None] + cols[None, :], y, mask=mask)


def _groups(x: torch.Tensor, weight: torch.Tensor):
    """(R, RPG): rows per token and rows per weight group (see ops/norm.py)."""
    d = x.shape[-1]
    if weight.dim() == 1:
        return 1, 1
    inner = 1
    for s in x.shape[1:-1]:
        inner *= s
    return inner, inner // weight.shape[0]


def config(d: int, n_rows: int):
    """(BLOCK_M, num_warps): about 1024 elements a program, 16 a thread (two 16-byte bf16
    vectors). From benchmarks/sweep_norm.py on the H200: at D = 128, BLOCK_M 8 with 2 warps beat
    32 rows with 4 warps by 13% at T = 16384 (87% vs 77% of the copy bandwidth)."""
    block_d = triton.next_power_of_2(d)
    block_m = max(1, min(64, 1024 // block_d))
    return block_m, max(1, min(8, block_m * block_d // (16 * 32)))


def _launch(x, residual, out, weight, eps, op, cfg=None):
    d = x.shape[-1]
    n_rows = x.numel() // d if d else 0
    if n_rows == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_m, num_warps = cfg or config(d, n_rows)
    xs, xst = row_layout(x, "x", op)
    os_, ost = row_layout(out, "out", op)
    if residual is not None:
        rs, rst = row_layout(residual, "residual", op)
    else:
        rs, rst = xs, xst
    big, rpg = _groups(x, weight)
    launch = pdl_kwargs(x.device)
    grid = triton.cdiv(n_rows, block_m)
    _rms_norm_kernel[(grid,)](
        x, residual if residual is not None else x, out, weight, n_rows, d, eps,
        xs[1], xs[2], *xst, rs[1], rs[2], *rst, os_[1], os_[2], *ost, big, rpg,
        FUSED_ADD=residual is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        INDEX_64=n_rows + block_m >= 2**31, num_warps=num_warps,
        TRIGGER=early_trigger(launch, x.device, grid), **launch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, out, weight, eps, "rms_norm")
    return out


def fused_add_rms_norm_(x, residual, weight, eps) -> None:
    _launch(x, residual, x, weight, eps, "fused_add_rms_norm_")


dispatch.register_backend("rms_norm", "triton", rms_norm)
dispatch.register_backend("fused_add_rms_norm_", "triton", fused_add_rms_norm_)
