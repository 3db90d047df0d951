"""``grouped_dyn_conv`` (DFlash 2's grouped dynamic causal convolution) and
``conv_add_rms_norm_`` (that convolution, the residual add and the next RMSNorm fused).

The torch reference against the definition written as loops and against the ``dflash``
package's own convolution (``dflash.model._grouped_dynamic_convolve``, run per block: batch =
requests, length = B); the Triton kernel against the reference under TRITON_INTERPRET=1 on CPU
(fp32 / fp16) over a grid of K, group sizes, block sizes (shorter than K included), request
counts, strided dynamic views (a half of the [T, 2, K, G] projection) and channel counts that are
not a power of two; on the GPU in bf16 / fp16 / fp32. ``conv_add_rms_norm_``'s reference against
the unfused ops (``grouped_dyn_conv_ref``, then ``fused_add_rms_norm_``'s reference), its kernels
against the reference (the residual updated in place and the normed output, into a strided out
view too), the drafter's real widths (H 4096 / 5120, T up to 4096) on the GPU, and widths past the CUDA kernel's
register-resident rows (H 36000 / 40960: the loop kernel).
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted

from dflash_ops import dispatch
from dflash_ops.ops.conv import (conv_add_rms_norm, conv_add_rms_norm_, conv_add_rms_norm_ref,
                                 grouped_dyn_conv, grouped_dyn_conv_ref)
from dflash_ops.ops.norm import rms_norm_ref


def case(r, b, h, k, gs, dtype=torch.float32, strided=False, seed=0, device="cpu", pad=0):
    """``pad``: x is a [T, h] slice of a [T, h + pad] tensor (a row stride past H)."""
    g = torch.Generator().manual_seed(seed)
    groups = h // gs
    # moved to the device and dtype before slicing: a copy of a strided view comes out dense
    x = torch.randn(r * b, h + pad, generator=g).to(device, dtype)[:, :h]
    if strided:
        dyn = (torch.randn(r * b, 2, k, groups, generator=g) * 0.5).to(device, dtype)[:, 0]
    else:
        dyn = (torch.randn(r * b, k, groups, generator=g) * 0.5).to(device, dtype)
    base = (torch.randn(k, h, generator=g) * 0.5).to(device, dtype)
    assert x.stride(0) == h + pad and (not strided or dyn.stride(0) == 2 * k * groups)
    return dict(x=x, dynamic=dyn, base=base, group_size=gs, block_size=b)


def by_definition(x, dynamic, base, group_size, block_size):
    t, h = x.shape
    y = torch.zeros(t, h, dtype=torch.float64)
    for row in range(t):
        for c in range(h):
            for o in range(base.shape[0]):
                if row % block_size >= o:
                    w = float(base[o, c]) + float(dynamic[row, o, c // group_size])
                    y[row, c] += w * float(x[row - o, c])
    return y


@pytest.mark.parametrize("r,b,h,k,gs", [(2, 4, 16, 2, 4), (3, 3, 8, 4, 2), (1, 5, 12, 1, 12),
                                        (4, 1, 8, 2, 8)])
def test_reference_is_the_definition(r, b, h, k, gs):
    kw = case(r, b, h, k, gs, seed=r * 7 + k)
    want = by_definition(**kw)
    torch.testing.assert_close(grouped_dyn_conv_ref(**kw).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("k,gs", [(2, 16), (3, 8)])
def test_reference_matches_the_dflash_package(dtype, tol, k, gs):
    dm = pytest.importorskip("dflash.model")
    r, b, h = 3, 16, 64
    kw = case(r, b, h, k, gs, dtype=dtype, seed=k)
    theirs = dm._grouped_dynamic_convolve(kw["x"].view(r, b, h), kw["dynamic"].reshape(r, b, -1),
                                          kw["base"], gs).reshape(r * b, h)
    ours = grouped_dyn_conv_ref(**kw)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=tol, rtol=tol)


def test_no_tap_crosses_a_block_boundary():
    """Changing block 0 never changes block 1's output."""
    kw = case(2, 4, 16, 3, 4, seed=3)
    y0 = grouped_dyn_conv_ref(**kw)
    kw["x"] = kw["x"].clone()
    kw["x"][:4] = 1e3
    y1 = grouped_dyn_conv_ref(**kw)
    assert torch.equal(y0[4:], y1[4:]) and not torch.equal(y0[:4], y1[:4])


# (r, b, h, k, gs, strided dynamic, x row padding): the CUDA kernel's paths too: 16-byte
# vectors whose channels share one group, vectors spanning groups (gs 4), single elements
# (h 20: no 16-byte vectors in bf16 / fp16; a padded row stride), one row a thread (T < 2048)
# and the 8-row walk (T >= 2048: blocks of 5 across walk chunks, a partial last chunk)
GRID = [(3, 16, 64, 2, 16, False, 0), (2, 5, 48, 3, 8, True, 0), (4, 1, 32, 2, 32, False, 0),
        (2, 3, 32, 4, 4, True, 0), (1, 8, 320, 2, 16, True, 0), (5, 2, 24, 1, 24, False, 0),
        (3, 4, 20, 2, 4, True, 0), (2, 8, 64, 3, 16, False, 8), (2, 6, 40, 2, 8, False, 3),
        (420, 5, 32, 3, 8, False, 0), (260, 8, 64, 2, 16, True, 0)]


def check_backend(device, dtypes, backend="triton"):
    for dtype in dtypes:
        for r, b, h, k, gs, strided, pad in GRID:
            kw = case(r, b, h, k, gs, dtype=dtype, strided=strided, seed=r + b + k,
                      device=device, pad=pad)
            want = grouped_dyn_conv_ref(**kw)
            with dispatch.use_backend(backend, ops=("grouped_dyn_conv",)):
                got = grouped_dyn_conv(**kw)
            # the CUDA kernel keeps the reference's rounding order (w = base + dyn, acc + w * x,
            # each rounded to fp32, no FMA; one final rounding): equal, not close
            tol = 0.0 if backend == "cuda" else 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                       msg=lambda m: f"{backend} {dtype} {(r, b, h, k, gs)}: {m}")
            assert got.is_contiguous() and got.dtype == dtype


def norm_case(r, b, h, k, gs, dtype=torch.float32, strided=False, seed=0, device="cpu", pad=0):
    kw = case(r, b, h, k, gs, dtype, strided, seed, device, pad)
    g = torch.Generator().manual_seed(seed + 1000)
    kw["residual"] = torch.randn(r * b, h, generator=g).to(device, dtype)
    kw["weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype)
    kw["eps"] = 1e-6
    return kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_reference_is_conv_then_add_norm(dtype):
    """conv_add_rms_norm_ref = grouped_dyn_conv (rounded), residual += it, RMSNorm: the layer's
    unfused sequence, bit for bit."""
    kw = norm_case(3, 8, 64, 2, 16, dtype=dtype, strided=True, seed=5)
    res0 = kw["residual"].clone()
    conv = by_definition(kw["x"], kw["dynamic"], kw["base"], 16, 8).to(dtype)
    want_res = (res0 + conv)
    want = rms_norm_ref(want_res, kw["weight"], kw["eps"])
    got = torch.empty_like(want)
    conv_add_rms_norm_ref(**kw, out=got)
    tol = 0 if dtype == torch.float32 else 2e-2  # by_definition sums in fp64
    torch.testing.assert_close(kw["residual"].float(), want_res.float(), atol=tol + 1e-5,
                               rtol=tol + 1e-5)
    torch.testing.assert_close(got.float(), want.float(), atol=tol + 1e-5, rtol=tol + 1e-5)
    assert not torch.equal(kw["residual"], res0)


NORM_GRID = [g for g in GRID if g[0] * g[1] < 1000]
NORM_GRID_GPU = GRID + [(1, 8, 5120, 2, 16, True, 0), (8, 8, 5120, 2, 16, True, 0),
                        (512, 8, 5120, 2, 16, True, 0), (256, 16, 4096, 2, 16, True, 0),
                        (3, 4, 1000, 3, 8, False, 24), (2, 4, 40960, 2, 16, True, 0),
                        (2, 4, 36000, 2, 8, False, 8)]


def check_norm_backend(device, dtypes, backend="triton", grid=NORM_GRID):
    for dtype in dtypes:
        for r, b, h, k, gs, strided, pad in grid:
            kw = norm_case(r, b, h, k, gs, dtype=dtype, strided=strided, seed=r + b + k,
                           device=device, pad=pad)
            what = f"{backend} {dtype} {(r, b, h, k, gs, strided, pad)}"
            ref_kw = dict(kw, residual=kw["residual"].clone())
            want = torch.empty_like(kw["x"])
            conv_add_rms_norm_ref(**ref_kw, out=want)
            with dispatch.use_backend(backend, ops=("conv_add_rms_norm_",)):
                if pad:  # out a strided view (rows of H + pad)
                    wide = torch.full((r * b, h + pad), float("nan"), dtype=dtype, device=device)
                    got = wide[:, :h]
                    conv_add_rms_norm_(**kw, out=got)
                    assert wide[:, h:].isnan().all(), what
                else:
                    got = conv_add_rms_norm(**kw)
            # the CUDA kernel's convolution and add round as the reference's do: the residual
            # is equal; the output differs by the rstd's last bits (its own reduction order)
            rtol = 0.0 if backend == "cuda" else 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(kw["residual"].float(), ref_kw["residual"].float(),
                                       atol=rtol, rtol=rtol, msg=lambda m: f"{what} residual: {m}")
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                       msg=lambda m: f"{what} out: {m}")
            assert got.dtype == dtype and got.shape == (r * b, h)


_SCRIPT = r"""
import torch
import tests.test_conv_kernels as t
t.check_backend("cpu", (torch.float32, torch.float16))
t.check_norm_backend("cpu", (torch.float32, torch.float16))
import dflash_ops.triton.conv as tc
tc.MAX_ONE_CHUNK = 16  # the chunk loop (rows wider than one chunk) on the same grid
t.check_norm_backend("cpu", (torch.float32,))
print("interp-ok")
"""


def test_triton_kernel_under_interpreter():
    run_interpreted(_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernels_gpu(backend):
    if not dispatch.has_backend("grouped_dyn_conv", backend):
        pytest.fail(f"no {backend} kernel for grouped_dyn_conv (is dflash_ops._C built?)")
    check_backend("cuda", (torch.bfloat16, torch.float16, torch.float32), backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_norm_kernels_gpu(backend):
    if not dispatch.has_backend("conv_add_rms_norm_", backend):
        pytest.fail(f"no {backend} kernel for conv_add_rms_norm_ (is dflash_ops._C built?)")
    check_norm_backend("cuda", (torch.bfloat16, torch.float16, torch.float32), backend,
                       NORM_GRID_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_graph_replay_gpu(backend):
    """Captured once in a CUDA graph, replayed on new inputs copied into the same buffers."""
    kw = case(3, 8, 64, 2, 16, dtype=torch.bfloat16, device="cuda", strided=True)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) and k != "dynamic" else v)
              for k, v in kw.items()}
    with dispatch.use_backend(backend, ops=("grouped_dyn_conv",)):
        grouped_dyn_conv(**static)  # warm-up: compile before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = grouped_dyn_conv(**static)
    for seed in (1, 2):
        new = case(3, 8, 64, 2, 16, dtype=torch.bfloat16, device="cuda", seed=seed)
        static["x"].copy_(new["x"])
        static["base"].copy_(new["base"])
        static["dynamic"].copy_(new["dynamic"])
        g.replay()
        torch.testing.assert_close(out.float(), grouped_dyn_conv_ref(**static).float(),
                                   atol=2e-2, rtol=2e-2)
