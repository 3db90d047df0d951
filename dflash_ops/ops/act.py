"""Activation ops: ``silu_mul`` (SwiGLU, fused).

``x[..., 2*I]`` holds the gate in ``x[..., :I]`` and the up projection in ``x[..., I:]`` (what
``gate, up = gate_up.chunk(2, -1)`` gives); the result is a new contiguous ``[..., I]`` tensor of
x's dtype equal bit for bit to ``F.silu(gate) * up`` as PyTorch computes it in that dtype:

    s = T(silu(float(g)))       silu(g) = g / (1 + exp(-g)) in fp32; T() rounds to x's dtype
    y = T(float(s) * float(u))

x may have a row stride larger than ``2*I`` (a slice of a wider GEMM output): its leading dims
must merge into one strided dim of rows.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from .. import dispatch
from . import _checks as C
from ._samples import Maker, rnd, set_, strided_last, to

__all__ = ["silu_mul"]

_OP = "silu_mul"


def rows_of(x: torch.Tensor, op: str = _OP, xname: str = "x") -> Tuple[int, int]:
    """(rows, row_stride) of x seen as ``[rows, 2*I]`` rows, row r at ``r * row_stride``
    elements; ValueError when the leading dims do not merge into one strided dim."""
    d = x.shape[-1]
    if x.numel() == 0 and d:  # a zero-size leading dim: no rows
        return 0, d
    sizes, strides = C.merged_leading_dims(x)
    if len(sizes) > 1:
        C.fail(op, f"{xname} must be viewable as [rows, {d}] with one row stride (leading dims "
                   f"that merge), got shape {list(x.shape)} with strides {list(x.stride())}; "
                   f"pass {xname}.contiguous()")
    if not sizes:
        return 1, d
    return sizes[0], strides[0]


def check_silu_mul_args(x: torch.Tensor, op: str = _OP) -> Tuple[int, int]:
    """Validates x; returns (rows, row_stride) as ``rows_of``."""
    C.tensor(op, "x", x, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    if x.dim() < 1:
        C.fail(op, "x must have rank >= 1, got a 0-d tensor")
    d = x.shape[-1]
    if d % 2 != 0 or d == 0:
        C.fail(op, f"x must have an even last dim 2*I with I >= 1 (gate then up), got {d} "
                   f"(shape {list(x.shape)})")
    return rows_of(x, op)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up with the rounding order spelled out (fp32 math, two roundings)."""
    gate, up = x.chunk(2, dim=-1)
    s = F.silu(gate.float()).to(x.dtype)
    return (s.float() * up.float()).to(x.dtype).contiguous()


def _check_silu_mul(x):
    check_silu_mul_args(x)


def _fake(x):
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


# Eager calls: the C++ kernel (8-16 us of host time against 65-120 us for a Triton launch).
# Default triton (bf16; sum of kernel times in the models' steps): verify B 32 S 8192, 36 calls:
# triton 344 vs cuda 382 us; drafter B 64 S 4096, 5 calls: 96.6 vs 92.9 us; decode B 1, 36
# calls: 95.6 vs 60.2 us (one-token rows: launch-bound, where the cuda kernel is shorter).
dispatch.define_op("silu_mul(Tensor x) -> Tensor", validate=_check_silu_mul,
                   reference=silu_mul_ref, fake=_fake, default="triton",
                   eager="cuda")


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(x[..., :I]) * x[..., I:] as a new contiguous [..., I] tensor."""
    return torch.ops.dflash.silu_mul.default(x)


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    m = Maker(20, device, dtype)
    return {_OP: {"3d": dict(x=m.rnd(5, 3, 2 * 32)), "contiguous": dict(x=m.rnd(7, 2 * 40)),
                  # rows wider than 2*I: the gate/up part of a wider GEMM output
                  "rowstride-3d": dict(x=m.rnd(3, 4, 2 * 24 + 8)[:, :, :2 * 24])}}


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``)."""
    return {_OP: [
        ("x-int", to("x", dtype=torch.int32), "x"),
        ("x-float64", to("x", dtype=torch.float64), "x"),
        ("x-0d", set_(x=torch.tensor(1.0)), "x"),
        ("x-odd-last-dim", set_(x=rnd(5, 3, 63)), "x"),
        ("x-zero-last-dim", set_(x=rnd(5, 3, 0)), "x"),
        ("x-last-stride", set_(x=strided_last(5, 3, 64)), "x"),
        ("x-leading-dims-do-not-merge", set_(x=lambda kw: kw["x"].transpose(0, 1)), "x"),
    ]}
