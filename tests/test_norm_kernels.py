"""The CUDA and Triton rms_norm / fused_add_rms_norm_ kernels against the PyTorch reference.

GPU tests run every backend over a shape grid (1-D and per-group 2-D weights, strided rows,
odd D, hidden sizes); the Triton kernel also runs on CPU under TRITON_INTERPRET=1 (fp16/fp32).
Tolerance: error vs an fp32 reference <= 2x the error of the same math in PyTorch in
the test dtype, plus a small atol.
"""

import pytest
import torch

from tests.conftest import run_interpreted

import dflash_ops
from dflash_ops.ops.norm import rms_norm_ref

GPU_BACKENDS = ["cuda", "triton"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _tol_check(out, ref_dtype, ref_fp32, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten element?)"
    err = (out.float() - ref_fp32).abs().max().item()
    base = (ref_dtype.float() - ref_fp32).abs().max().item()
    atol = 1e-5 * max(1.0, ref_fp32.abs().max().item())
    assert err <= 2 * base + atol, f"{what}: max err {err:.3e} > 2 * {base:.3e} + {atol:.1e}"


def _cases(device):
    """(name, x, weight) triples; x may be a strided view."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    out = []
    for dtype in DTYPES:
        for t in (1, 7, 257):
            out.append((f"1d-D128-T{t}", rnd(t, 128, dtype=dtype), rnd(128, dtype=dtype)))
            out.append((f"2d-T{t}", rnd(t, 40, 128, dtype=dtype), rnd(5, 128, dtype=dtype)))
            kv = rnd(t, 5, 2, 8, 128, dtype=dtype)
            out.append((f"kview-T{t}", kv[:, :, 0], rnd(5, 128, dtype=dtype)))
        for d in (64, 100, 256, 4096, 5120, 6656):
            out.append((f"1d-D{d}", rnd(33, d, dtype=dtype), rnd(d, dtype=dtype)))
        base = rnd(9, 3, 200, dtype=dtype)
        out.append(("rowstride", base[:, 1, :128], rnd(128, dtype=dtype)))
        out.append(("4d-1dw", rnd(2, 3, 4, 64, dtype=dtype), rnd(64, dtype=dtype)))
    return out


def _poison_allocator(nbytes, device):
    # Fill freed memory with NaN so an unwritten element of a fresh output shows up.
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), device=device)
    del junk


def _run_rms_norm(backend, device, dtypes=DTYPES):
    for name, x, w in _cases(device):
        if x.dtype not in dtypes:
            continue
        ref32 = rms_norm_ref(x.float(), w.float(), 1e-6)
        refd = rms_norm_ref(x, w, 1e-6)
        _poison_allocator(x.numel() * x.element_size() * 2, device)
        with dflash_ops.use_backend(backend, ops=["rms_norm"]):
            y = torch.ops.dflash.rms_norm(x, w, 1e-6)
        assert y.shape == x.shape and y.dtype == x.dtype
        _tol_check(y, refd, ref32, f"{backend} rms_norm {name} {x.dtype}")


def _run_fused_add(backend, device, dtypes=DTYPES):
    for name, x, w in _cases(device):
        if x.dtype not in dtypes:
            continue
        res = torch.randn(x.shape, device=device).to(x.dtype)
        x_k, res_k = x.clone(), res.clone()
        # the reference in the test dtype, and in fp32 from the same rounded sum
        x_d, res_d = x.clone(), res.clone()
        torch.ops.dflash.fused_add_rms_norm_(x_d, res_d, w, 1e-6)
        ref32 = rms_norm_ref(res_d.float(), w.float(), 1e-6)
        with dflash_ops.use_backend(backend, ops=["fused_add_rms_norm_"]):
            torch.ops.dflash.fused_add_rms_norm_(x_k, res_k, w, 1e-6)
        assert torch.equal(res_k, res_d), f"{backend} residual sum differs ({name})"
        _tol_check(x_k, x_d, ref32, f"{backend} fused_add_rms_norm_ {name} {x.dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_rms_norm_gpu(backend):
    _run_rms_norm(backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_fused_add_rms_norm_gpu(backend):
    _run_fused_add(backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_strided_output_in_place_gpu(backend):
    """fused_add on a strided K view writes only that view of the fused buffer."""
    kv = torch.randn(16, 5, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(16, 5, 8, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    v_before = kv[:, :, 1].clone()
    x_ref, r_ref = kv[:, :, 0].clone(), res.clone()
    torch.ops.dflash.fused_add_rms_norm_(x_ref, r_ref, w, 1e-6)  # default backend
    with dflash_ops.use_backend("torch"):
        x_t, r_t = kv[:, :, 0].clone(), res.clone()
        torch.ops.dflash.fused_add_rms_norm_(x_t, r_t, w, 1e-6)
    with dflash_ops.use_backend(backend, ops=["fused_add_rms_norm_"]):
        torch.ops.dflash.fused_add_rms_norm_(kv[:, :, 0], res, w, 1e-6)
    assert torch.equal(kv[:, :, 1], v_before)
    assert torch.equal(res, r_t)
    assert (kv[:, :, 0].float() - x_t.float()).abs().max() <= 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_rms_norm_cuda_graph(backend):
    x = torch.randn(64, 40, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    with dflash_ops.use_backend(backend, ops=["rms_norm"]):
        torch.ops.dflash.rms_norm(x, w, 1e-6)  # warm-up (compilation) before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = torch.ops.dflash.rms_norm(x, w, 1e-6)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            _tol_check(y, rms_norm_ref(x, w, 1e-6), rms_norm_ref(x.float(), w.float(), 1e-6),
                       f"{backend} graph replay")


@pytest.mark.gpu
def test_default_backend_is_measured_fastest():
    assert dflash_ops.backend_for("rms_norm") in ("cuda", "triton")
    assert dflash_ops._ext.STATUS["how"] in ("built", "jit"), dflash_ops._ext.STATUS


_INTERP_SCRIPT = r"""
import torch, dflash_ops, tests.test_norm_kernels as t
t._run_rms_norm("triton", "cpu", dtypes=[torch.float16, torch.float32])
t._run_fused_add("triton", "cpu", dtypes=[torch.float16, torch.float32])
print("interp-ok")
"""


def test_triton_rms_norm_interpreter_cpu():
    """The Triton kernels on CPU under TRITON_INTERPRET=1 (set before triton is imported,
    hence a subprocess). fp16/fp32 only: the interpreter is exact for them."""
    run_interpreted(_INTERP_SCRIPT, timeout=900)
