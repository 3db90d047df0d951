"""DFlash 2's grouped dynamic causal convolution: ``grouped_dyn_conv``.

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
"""
from __future__ import annotations

import torch

from .. import dispatch
from . import _checks as C
from ._samples import META, Maker, rnd, set_, strided_last, to

__all__ = ["grouped_dyn_conv"]

_OP = "grouped_dyn_conv"


def _check(x, dynamic, base, group_size, block_size):
    op = _OP
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

    return {_OP: {"k2-g16": case(30, 3, 4, 64, 2, 16),
                  "k3-projection-half": case(31, 2, 5, 48, 3, 8, strided=True),
                  "k2-one-row-blocks": case(32, 4, 1, 32, 2, 32),
                  "k4-block-shorter-than-k": case(33, 2, 3, 32, 4, 4)}}


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
    ]}
