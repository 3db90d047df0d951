"""DFlash 2's grouped dynamic causal convolution: ``grouped_dyn_conv``, and
``conv_add_rms_norm_`` (the convolution after a sublayer fused with the residual add and the next
RMSNorm).

``x [T, H]`` holds R blocks of B rows (T = R * B, request-major: row t is position t % B of
block t // B); ``dynamic [T, K, G]`` the per-row, per-group dynamic taps (G = H / group_size; the
half of DFlash 2's ``kernel_projection`` output this convolution uses: a strided view of the
``[T, 2, K, G]`` projection is taken as it is); ``base [K, H]`` the per-channel static taps:

    y[t, c] = sum over o < K with t % B >= o of (base[o, c] + dynamic[t, o, c // group_size])
                                                 * x[t - o, c]

so a tap never reaches into the previous block (another request's, or before the block's first
position). fp32 math, one rounding to x's dtype at the end; the ``dflash`` reference rounds
each tap's products in the model dtype, so bf16 parity is to the tolerance rule (fp32: equal to
rounding). The result is a new contiguous ``[T, H]`` tensor. DFlash 2 runs it twice per layer
and sublayer: before the sublayer on its normed input (``base[0]``, ``dynamic[:, 0]``) and after
it on its output (``base[1]``, ``dynamic[:, 1]``, both halves projected from the input).

``conv_add_rms_norm_(x, residual, dynamic, base, group_size, block_size, weight, eps, *, out)`` is
that second convolution and what follows it in the layer, in one pass over the rows: ``c =
grouped_dyn_conv(x, ...)`` (rounded to x's dtype), ``residual += c`` in place, and ``out =
RMSNorm(residual) * weight`` (``fused_add_rms_norm_``'s numerics; out [T, H] must not overlap x
or residual: a row's convolution reads its neighbours' x). It saves a launch and the round trip
of c per sublayer (DFlash 2: two per layer). ``conv_add_rms_norm`` allocates out and returns it.
"""
from __future__ import annotations

import torch

from .. import dispatch
from . import _checks as C
from ._samples import EPS, META, Maker, rnd, set_, strided_last, to

__all__ = ["grouped_dyn_conv", "conv_add_rms_norm_", "conv_add_rms_norm"]

_OP = "grouped_dyn_conv"
_OP_NORM = "conv_add_rms_norm_"


def _check(x, dynamic, base, group_size, block_size, op=_OP):
    C.tensor(op, "x", x, rank=2, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    t, h = x.shape
    if not isinstance(group_size, int) or group_size < 1 or h % group_size:
        C.fail(op, f"group_size must be a positive divisor of H = {h}, got {group_size}")
    if not isinstance(block_size, int) or block_size < 1:
        C.fail(op, f"block_size must be >= 1, got {block_size}")
    if t % block_size:
        C.fail(op, f"x's {t} rows must be whole blocks of block_size = {block_size}")
    C.tensor(op, "base", base, rank=2, device=x.device, last_contiguous=True)
    C.same_dtype(op, "base", base, "x", x)
    k = base.shape[0]
    if k < 1 or base.shape[1] != h:
        C.fail(op, f"base must be [K >= 1, H = {h}], got {list(base.shape)}")
    g = h // group_size
    C.tensor(op, "dynamic", dynamic, rank=3, device=x.device, shape=(t, k, g),
             last_contiguous=True)
    C.same_dtype(op, "dynamic", dynamic, "x", x)


def _check_norm(x, residual, dynamic, base, group_size, block_size, weight, eps, *, out):
    op = _OP_NORM
    _check(x, dynamic, base, group_size, block_size, op=op)
    C.tensor(op, "residual", residual, rank=2, device=x.device, last_contiguous=True)
    C.same_dtype(op, "residual", residual, "x", x)
    if residual.shape != x.shape:
        C.fail(op, f"residual must have the shape of x {list(x.shape)}, got "
                   f"{list(residual.shape)}")
    C.tensor(op, "weight", weight, rank=1, device=x.device, last_contiguous=True)
    C.same_dtype(op, "weight", weight, "x", x)
    if weight.shape[0] != x.shape[1]:
        C.fail(op, f"weight must be [H = {x.shape[1]}], got {list(weight.shape)}")
    C.eps(op, eps)
    C.tensor(op, "out", out, rank=2, device=x.device, last_contiguous=True)
    C.same_dtype(op, "out", out, "x", x)
    if out.shape != x.shape:
        C.fail(op, f"out must have the shape of x {list(x.shape)}, got {list(out.shape)}")
    C.no_overlap(op, "residual", residual, "x", x)
    C.no_overlap(op, "out", out, "x", x)
    C.no_overlap(op, "out", out, "residual", residual)


def grouped_dyn_conv_ref(x, dynamic, base, group_size: int, block_size: int) -> torch.Tensor:
    t, h = x.shape
    k = base.shape[0]
    pos = torch.arange(t, device=x.device) % block_size
    xf = x.float()
    y = torch.zeros_like(xf)
    for o in range(k):
        shifted = torch.zeros_like(xf)
        if o < t:
            shifted[o:] = xf[:t - o]
        shifted = torch.where((pos >= o)[:, None], shifted, torch.zeros_like(shifted))
        w = base[o].float()[None, :] + dynamic[:, o].float().repeat_interleave(group_size, 1)
        y = y + w * shifted
    return y.to(x.dtype)


def conv_add_rms_norm_ref(x, residual, dynamic, base, group_size: int, block_size: int, weight,
                          eps: float, *, out) -> None:
    from .norm import rms_norm_ref
    residual.add_(grouped_dyn_conv_ref(x, dynamic, base, group_size, block_size))
    out.copy_(rms_norm_ref(residual, weight, eps))


def _fake(x, dynamic, base, group_size, block_size):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# Default cuda: on the H200 (2026-12-02, bench dflash2, graph replays, x [T, 5120]) the CUDA
# kernel took 2.85 / 5.78 / 32.7 / 114.5 us at T 64 / 512 / 4096 / 16384 against Triton's
# 3.51 / 7.02 / 38.9 / 142.5.
dispatch.define_op(
    "grouped_dyn_conv(Tensor x, Tensor dynamic, Tensor base, int group_size, int block_size) "
    "-> Tensor", validate=_check, reference=grouped_dyn_conv_ref, fake=_fake, default="cuda")


def grouped_dyn_conv(x, dynamic, base, group_size: int, block_size: int) -> torch.Tensor:
    """DFlash 2's grouped dynamic causal convolution of x [T, H] along each block's B rows."""
    return torch.ops.dflash.grouped_dyn_conv.default(x, dynamic, base, group_size, block_size)


dispatch.define_op(
    "conv_add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor dynamic, Tensor base, "
    "int group_size, int block_size, Tensor weight, float eps, *, Tensor(b!) out) -> ()",
    validate=_check_norm, reference=conv_add_rms_norm_ref,
    # CUDA (H200, x [T, 5120] bf16, graph replay, 2026-12-04): 3.70 / 3.99 / 9.63 / 64.3 us at
    # T 8 / 64 / 512 / 4096, Triton 3.51 / 3.91 / 12.0 / 86.0, the unfused conv +
    # fused_add_rms_norm_ 5.10 / 5.81 / 11.3 / 72.5: CUDA, 0.1-0.2 us behind at T <= 64 and
    # 20-25% ahead from 512 rows (the drafter's batch 64)
    fake=lambda *a, **k: None, default="cuda")


def conv_add_rms_norm_(x, residual, dynamic, base, group_size: int, block_size: int, weight,
                       eps: float, *, out) -> None:
    """residual += grouped_dyn_conv(x, dynamic, base, ...) in place; out = RMSNorm(residual) *
    weight."""
    torch.ops.dflash.conv_add_rms_norm_.default(x, residual, dynamic, base, group_size,
                                                block_size, weight, float(eps), out=out)


def conv_add_rms_norm(x, residual, dynamic, base, group_size: int, block_size: int, weight,
                      eps: float = 1e-6) -> torch.Tensor:
    """``conv_add_rms_norm_`` into a new contiguous [T, H] tensor, returned."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    conv_add_rms_norm_(x, residual, dynamic, base, group_size, block_size, weight, eps, out=out)
    return out


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    def case(seed, r, b, h, k, gs, strided=False):
        m = Maker(seed, device, dtype)
        g = h // gs
        x = m.rnd(r * b, h)
        if strided:  # one half of the [T, 2, K, G] projection, as DFlash 2 passes it
            dyn = m.rnd(r * b, 2, k, g, scale=0.5)[:, 1]
        else:
            dyn = m.rnd(r * b, k, g, scale=0.5)
        return dict(x=x, dynamic=dyn, base=m.rnd(k, h, scale=0.5), group_size=gs, block_size=b)

    def norm_case(seed, r, b, h, k, gs, strided=False):
        kw = case(seed, r, b, h, k, gs, strided)
        m = Maker(seed + 100, device, dtype)
        return dict(x=kw["x"], residual=m.rnd(r * b, h), dynamic=kw["dynamic"], base=kw["base"],
                    group_size=gs, block_size=b, weight=m.rnd(h), eps=EPS, out=m.rnd(r * b, h))

    return {_OP: {"k2-g16": case(30, 3, 4, 64, 2, 16),
                  "k3-projection-half": case(31, 2, 5, 48, 3, 8, strided=True),
                  "k2-one-row-blocks": case(32, 4, 1, 32, 2, 32),
                  "k4-block-shorter-than-k": case(33, 2, 3, 32, 4, 4)},
            _OP_NORM: {"k2-g16": norm_case(34, 3, 4, 64, 2, 16),
                       "k2-projection-half": norm_case(35, 2, 8, 96, 2, 16, strided=True),
                       "k3-g8-odd-h": norm_case(36, 2, 5, 40, 3, 8)}}


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]."""
    return {_OP: [
        ("x-int", to("x", dtype=torch.int32), "x"),
        ("x-rank-3", set_(x=rnd(3, 4, 64)), "x"),
        ("x-last-stride", set_(x=strided_last(12, 64)), "x"),
        ("group-size-not-dividing", set_(group_size=24), "group_size"),
        ("group-size-zero", set_(group_size=0), "group_size"),
        ("block-size-zero", set_(block_size=0), "block_size"),
        ("rows-not-whole-blocks", set_(block_size=5), "block_size"),
        ("base-wrong-h", set_(base=rnd(2, 32)), "base"),
        ("base-dtype", to("base", dtype=torch.float16), "base"),
        ("base-device", to("base", device=META), "base"),
        ("dynamic-wrong-k", set_(dynamic=rnd(12, 3, 4)), "dynamic"),
        ("dynamic-wrong-groups", set_(dynamic=rnd(12, 2, 8)), "dynamic"),
        ("dynamic-last-stride", set_(dynamic=strided_last(12, 2, 4)), "dynamic"),
        ("dynamic-dtype", to("dynamic", dtype=torch.float16), "dynamic"),
    ], _OP_NORM: [
        ("x-int", to("x", dtype=torch.int32), "x"),
        ("rows-not-whole-blocks", set_(block_size=5), "block_size"),
        ("dynamic-wrong-groups", set_(dynamic=rnd(12, 2, 8)), "dynamic"),
        ("residual-shape", set_(residual=rnd(12, 32)), "residual"),
        ("residual-dtype", to("residual", dtype=torch.float16), "residual"),
        ("residual-last-stride", set_(residual=strided_last(12, 64)), "residual"),
        ("weight-shape", set_(weight=rnd(32)), "weight"),
        ("weight-2d", set_(weight=rnd(2, 64)), "weight"),
        ("weight-dtype", to("weight", dtype=torch.float16), "weight"),
        ("eps-negative", set_(eps=-1.0), "eps"),
        ("out-shape", set_(out=rnd(12, 32)), "out"),
        ("out-dtype", to("out", dtype=torch.float16), "out"),
        ("out-last-stride", set_(out=strided_last(12, 64)), "out"),
        ("out-is-x", set_(out=lambda kw: kw["x"]), "out"),
        ("residual-is-x", set_(residual=lambda kw: kw["x"]), "residual"),
        ("out-is-residual", set_(out=lambda kw: kw["residual"]), "out"),
    ]}
