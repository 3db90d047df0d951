"""RMSNorm ops: ``rms_norm`` and ``fused_add_rms_norm_``.

Numerics follow HF Qwen3RMSNorm: normalise in fp32, cast to the input dtype, then multiply by
the weight in the input dtype.

Weights: ``[D]`` for every row, or ``[G, D]`` (a batched per-layer norm). With a 2-D weight, x
is ``[T, *inner, D]`` (rank >= 3): the rows of one token, taken in order, are G equal groups and
row ``r`` of the ``R = prod(inner)`` uses ``weight[r // (R // G)]``. So the K-norm of all L
layers, ``k[T, L, Hkv, D]`` (or ``[T, L*Hkv, D]``) with ``wk[L, D]``, is one call. A 2-D
weight must be contiguous (not a column slice of a wider tensor nor an ``expand``).
"""
from __future__ import annotations

import torch

from .. import dispatch
from . import _checks as C
from ._samples import EPS, META, Maker, both, rnd, set_, strided_last, to

__all__ = ["rms_norm", "fused_add_rms_norm_"]

_OP = "rms_norm"
_OP_ADD = "fused_add_rms_norm_"


def check_norm_args(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, xname="x") -> None:
    C.tensor(op, xname, x, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    if x.dim() < 1:
        C.fail(op, f"{xname} must have rank >= 1, got a 0-d tensor")
    C.tensor(op, "weight", weight, rank=(1, 2), device=x.device, last_contiguous=True)
    C.same_dtype(op, "weight", weight, xname, x)
    d = x.shape[-1]
    if weight.shape[-1] != d:
        C.fail(op, f"weight must have {d} columns (the last dim of {xname}), got shape "
                   f"{list(weight.shape)}")
    if weight.dim() == 2:
        # the Triton kernel reads group g's row at weight + g * D
        C.tensor(op, "weight", weight, contiguous=True)
        if x.dim() < 3:
            C.fail(op, f"a 2-D weight [G, D] needs {xname} of rank >= 3 ([T, *inner, D]), got rank "
                       f"{x.dim()}")
        inner = 1
        for s in x.shape[1:-1]:
            inner *= s
        if weight.shape[0] == 0 or inner % weight.shape[0] != 0:
            C.fail(op, f"weight has G = {weight.shape[0]} groups, which must divide the "
                       f"{inner} rows per token of {xname} (shape {list(x.shape)})")
    C.eps(op, eps)


def expand_weight(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight broadcast to x's shape: [D] as is, [G, D] repeated over each group's rows."""
    if weight.dim() == 1:
        return weight
    t, d, g = x.shape[0], x.shape[-1], weight.shape[0]
    if g == 0:  # no groups: x has no rows per token either (the checks' divisibility rule)
        return weight.new_empty(*x.shape[1:-1], d)
    inner = x[0].numel() // d if t else x.shape[1:-1].numel()
    w = weight.repeat_interleave(inner // g, dim=0)  # [inner, D]
    return w.view(*x.shape[1:-1], d)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed * expand_weight(x, weight)


def _fused_add_rms_norm_ref(x, residual, weight, eps) -> None:
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))


def _check_rms_norm(x, weight, eps):
    check_norm_args(_OP, x, weight, eps)


def _check_fused_add(x, residual, weight, eps):
    check_norm_args(_OP_ADD, x, weight, eps)
    C.tensor(_OP_ADD, "residual", residual, device=x.device, last_contiguous=True)
    C.same_dtype(_OP_ADD, "residual", residual, "x", x)
    if residual.shape != x.shape:
        C.fail(_OP_ADD, f"residual must have the shape of x {list(x.shape)}, got "
                        f"{list(residual.shape)}")


# Eager calls: the C++ kernel (8-16 us of host time against 65-120 us for a Triton launch).
# Default triton (H200, bf16, CUDA-graph replay): K-norm x[T, 40, 128], w[5, 128]: triton 1.36 vs
# cuda 1.61 us at T = 1, 80.5 vs 82.7 us at T = 16384; in the models' steps (sum of kernel times)
# the decode step's 73 norms take 157 us in triton against 173 us for 72 in cuda.
dispatch.define_op(
    "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    validate=_check_rms_norm, reference=rms_norm_ref,
    fake=lambda x, weight, eps: torch.empty(x.shape, dtype=x.dtype, device=x.device),
    default="triton", eager="cuda")

# Eager calls: the C++ kernel (8-16 us of host time against 65-120 us for a Triton launch).
# Default triton: x, residual [T, 4096] bf16, graph replay: triton 1.68 vs cuda 2.06 us at T = 1,
# 4.19 vs 4.67 at T = 256, 35.2 vs 36.0 at T = 4096.
dispatch.define_op(
    "fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    validate=_check_fused_add, reference=_fused_add_rms_norm_ref,
    fake=lambda x, residual, weight, eps: None, default="triton", eager="cuda")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = RMSNorm(x) * weight over the last dim; see the module docstring for 2-D weights."""
    return torch.ops.dflash.rms_norm.default(x, weight, eps)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6) -> None:
    """In place: residual += x; x = RMSNorm(residual) * weight."""
    torch.ops.dflash.fused_add_rms_norm_.default(x, residual, weight, eps)


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    def w1d():
        m = Maker(1, device, dtype)
        return dict(x=m.rnd(4, 3, 64), weight=m.rnd(64), eps=EPS)

    def w2d():  # k[T, L, Hkv, D] with a per-layer weight [L, D]
        m = Maker(2, device, dtype)
        return dict(x=m.rnd(4, 3, 2, 32), weight=m.rnd(3, 32), eps=EPS)

    def w2d_strided():  # the K view of a fused [T, L, 2, Hkv, D] GEMM output
        m = Maker(3, device, dtype)
        return dict(x=m.rnd(4, 2, 2, 2, 64)[:, :, 0], weight=m.rnd(2, 64), eps=EPS)

    def fused_add():
        m = Maker(4, device, dtype)
        return dict(x=m.rnd(5, 64), residual=m.rnd(5, 64), weight=m.rnd(64), eps=EPS)

    return {_OP: {"w1d": w1d(), "w2d": w2d(), "w2d-strided": w2d_strided()},
            _OP_ADD: {"basic": fused_add()}}


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``)."""
    I32, BF16 = torch.int32, torch.bfloat16
    return {
        _OP: [
            ("x-int", to("x", dtype=I32), "x"),
            ("x-0d", set_(x=torch.tensor(1.0)), "x"),
            ("x-last-stride", set_(x=strided_last(4, 3, 64)), "x"),
            ("weight-bf16", to("weight", dtype=BF16), "weight"),
            ("weight-int", to("weight", dtype=I32), "weight"),
            ("weight-rank3", set_(weight=rnd(1, 3, 64)), "weight"),
            ("weight-cols", set_(weight=rnd(32)), "weight"),
            ("weight2d-x2d", set_(x=rnd(4, 64), weight=rnd(2, 64)), "weight"),
            ("weight2d-groups", set_(weight=rnd(2, 64)), "weight"),
            ("weight-meta", to("weight", device=META), "weight"),
            ("eps-negative", set_(eps=-1.0), "eps"),
        ],
        _OP_ADD: [
            ("x-int", both(to("x", dtype=I32), to("residual", dtype=I32),
                           to("weight", dtype=I32)), "x"),
            ("residual-shape", set_(residual=rnd(4, 64)), "residual"),
            ("residual-bf16", to("residual", dtype=BF16), "residual"),
            ("residual-meta", to("residual", device=META), "residual"),
            ("residual-last-stride", set_(residual=strided_last(5, 64)), "residual"),
            ("weight-bf16", to("weight", dtype=BF16), "weight"),
            ("weight-cols", set_(weight=rnd(32)), "weight"),
            ("weight-meta", to("weight", device=META), "weight"),
            ("eps-negative", set_(eps=-1.0), "eps"),
        ],
    }
