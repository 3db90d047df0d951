"""Triton SwiGLU kernel: ``silu_mul``.

A program takes BLOCK_M rows x BLOCK_I columns of the output: it loads the gate tile at columns
[c, c + BLOCK_I) of each row and the up tile I columns further (unit stride, so 16-byte vectors
when the base pointer, the row stride and I allow), computes in fp32 with PyTorch's rounding
order (silu rounded to the dtype, then the product rounded) and stores into the contiguous
output. Grid: (cdiv(rows, BLOCK_M), cdiv(I, BLOCK_I)), fixed by the shapes only, so a CUDA graph
replays it. About 2048 outputs a program with 4 warps (16 a thread).

Exactness: silu is g / (1 + exp(-g)) with libdevice's expf and an IEEE division (``div_rn``),
the operations PyTorch's CUDA kernel compiles to, so the result matches ``F.silu(g) * u`` bit for
bit there. Triton's own ``tl.exp`` (ex2.approx) and ``/`` (div.full) are approximations. The
interpreter has no libdevice, so under TRITON_INTERPRET=1 the kernel uses ``tl.exp`` (numpy's
expf, within 2 ulp of fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import dispatch
from ..ops.act import rows_of
from ._pdl import pdl_kwargs

_ELEMS = 2048  # outputs a program
_MAX_BLOCK_I = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, n_rows, I, row_stride,
                     BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                     OFF_64: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    # x: row r at x_ptr + r * row_stride, gate [0, I), up [I, 2I); y: [n_rows, I] contiguous.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    if OFF_64:
        x_row = rows.to(tl.int64) * row_stride
        y_row = rows.to(tl.int64) * I
    else:
        x_row = rows * row_stride
        y_row = rows * I
    g_ptrs = x_ptr + x_row[:, None] + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gf)
    else:
        e = tl.exp(-gf)
    s = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)
    y = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(y_ptr + y_row[:, None] + cols[None, :], y, mask=mask)


def config(inner: int):
    """(BLOCK_M, BLOCK_I, num_warps) for rows of I outputs: whole rows up to 1024 columns, then
    1024-column blocks; rows added until a program holds about 2048 outputs."""
    block_i = min(triton.next_power_of_2(inner), _MAX_BLOCK_I)
    block_m = max(1, _ELEMS // block_i)
    return block_m, block_i, max(1, min(4, block_m * block_i // 512))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    n_rows, row_stride = rows_of(x)  # x was validated by the dispatcher
    inner = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    block_m, block_i, num_warps = config(inner)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(inner, block_i))
    if grid[1] > 65535:
        raise ValueError(f"dflash.silu_mul: x's last dim {2 * inner} is too large for the triton "
                         f"kernel (at most {2 * 65535 * block_i})")
    # 64-bit offsets once an element offset (or the row index of a program) can reach 2^31
    off_64 = max((n_rows - 1) * row_stride + 2 * inner, n_rows * inner, n_rows + block_m) >= 2**31
    _silu_mul_kernel[grid](x, out, n_rows, inner, row_stride, BLOCK_M=block_m, BLOCK_I=block_i,
                           LIBDEVICE_EXP=not dispatch._interpret(), OFF_64=off_64,
                           num_warps=num_warps, **pdl_kwargs(x.device))
    return out


dispatch.register_backend("silu_mul", "triton", silu_mul)
