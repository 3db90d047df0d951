"""RMSNorm ops: ``rms_norm`` and ``fused_add_rms_norm_``.

Numerics follow HF Qwen3RMSNorm: normalise in fp32, cast to the input dtype, then multiply by
the weight in the input dtype.

Weights: ``[D]`` for every row, or ``[G, D]`` (a batched per-layer norm). With a 2-D weight, x
is ``[T, *inner, D]`` (rank >= 3): the rows of one token, taken in order, are G equal groups and
row ``r`` of the ``R = prod(inner)`` uses ``weight[r // (R // G)]``. So the K-norm of all L
layers, ``k[T, L, Hkv, D]`` (or ``[T, L*Hkv, D]``) with ``wk[L, D]``, is one call.
"""
from __future__ import annotations

import torch

from .. import dispatch
from . import _checks as C

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


dispatch.define_op(
    "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    validate=_check_rms_norm, reference=rms_norm_ref,
    fake=lambda x, weight, eps: torch.empty(x.shape, dtype=x.dtype, device=x.device))

dispatch.define_op(
    "fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    validate=_check_fused_add, reference=_fused_add_rms_norm_ref,
    fake=lambda x, residual, weight, eps: None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = RMSNorm(x) * weight over the last dim; see the module docstring for 2-D weights."""
    return torch.ops.dflash.rms_norm.default(x, weight, eps)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6) -> None:
    """In place: residual += x; x = RMSNorm(residual) * weight."""
    torch.ops.dflash.fused_add_rms_norm_.default(x, residual, weight, eps)
