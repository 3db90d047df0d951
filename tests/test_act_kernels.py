"""silu_mul (SwiGLU): the reference, the Triton and the CUDA kernels against F.silu(gate) * up.

The op's contract is bit-for-bit ``F.silu(gate) * up`` as PyTorch computes it in the input dtype
(silu in fp32 rounded to the dtype, then the product in fp32 rounded again). Tolerances:
* the torch reference on CPU: exact (torch.equal) against the unfused PyTorch ops;
* the CUDA kernel: exact against the unfused ops on the GPU (expf and the division are the
  precise ones ATen's CUDA silu uses);
* the Triton kernel on the GPU: at most 1 ulp, and a warning when not exact. Exact is expected:
  its sm_90 PTX is nvcc's expf sequence, the same FMA folding the + 1 and div.rn, differing
  only in .ftz on the range reduction (denormal inputs), which the 1 ulp allows;
* the Triton kernel under TRITON_INTERPRET=1, fp16/fp32 only: exact against the same formula
  with numpy's expf (the interpreter has no libdevice, so the kernel's exp is numpy's, within
  2 ulp in fp32), and at most 8 ulp from the unfused ops (torch's CPU silu uses its own fp32
  exp, also within 2 ulp: the two silus can be ~4 ulp apart in fp32, 5 measured, and a change
  of silu's rounded value moves the rounded product by up to about twice as many ulp; fp16
  measured 2). bf16 is not checked there: the interpreter rounds fp32 -> bf16 by truncation.
GPU outputs come from a caching allocator poisoned with NaN first, so an unwritten element shows.
"""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_interpreted

import dflash_ops
from dflash_ops import dispatch
from dflash_ops.ops.act import silu_mul_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INTERP_DTYPES = [torch.float16, torch.float32]
GPU_BACKENDS = ["cuda", "triton"]
MAX_ULP = {"cuda": 0, "triton": 1}


def unfused(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def numpy_exp_formula(x):
    """The kernel's formula with numpy's fp32 exp and division (what the interpreter runs)."""
    gate, up = x.chunk(2, dim=-1)
    g = gate.float().numpy()
    s = torch.from_numpy(g / (np.float32(1.0) + np.exp(-g))).to(x.dtype)
    return (s.float() * up.float()).to(x.dtype).contiguous()


def _ordered(t):
    """t's bit patterns as integers ordered like the floats (adjacent floats differ by 1)."""
    nbits = 32 if t.dtype == torch.float32 else 16
    bits = t.contiguous().view(torch.int32 if nbits == 32 else torch.int16).to(torch.int64)
    mag = bits & ((1 << (nbits - 1)) - 1)
    return torch.where(bits < 0, -mag, mag)


def assert_ulp(out, want, max_ulp, what):
    assert out.shape == want.shape, f"{what}: shape {list(out.shape)} != {list(want.shape)}"
    assert out.dtype == want.dtype, f"{what}: dtype {out.dtype} != {want.dtype}"
    assert out.is_contiguous(), f"{what}: output not contiguous (strides {out.stride()})"
    if out.numel() == 0:
        return 0
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten element?)"
    n = (out != want).sum().item()
    if max_ulp == 0:
        assert n == 0, f"{what}: {n} of {out.numel()} elements differ (exact expected)"
        return n
    d = (_ordered(out) - _ordered(want)).abs().max().item()
    assert d <= max_ulp, f"{what}: {d} ulp apart (at most {max_ulp})"
    return n


def cases(device, dtypes, rows_list=(0, 1, 3, 17, 64), inners=(1, 8, 129, 12288),
          big_rows=3, seed=0):
    """(name, x): x [rows, 2I] contiguous over rows_list x inners (I = 12288 only up to
    ``big_rows`` rows), then strided views: rows wider than 2*I, a 3-D slice whose leading dims
    merge, rows of stride 0 (expand), a view offset by one element (misaligned)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype):
        # scale 3: silu's both tails and its knee, and products that round both ways
        return (3 * torch.randn(*shape, generator=g)).to(dtype=dtype, device=device)

    out = []
    for dtype in dtypes:
        tag = str(dtype).replace("torch.", "")
        for inner in inners:
            for rows in rows_list:
                if inner >= 4096 and rows > big_rows:
                    continue
                out.append((f"{tag}-rows{rows}-I{inner}", rnd(rows, 2 * inner, dtype=dtype)))
        out.append((f"{tag}-rowstride", rnd(9, 2 * 64 + 24, dtype=dtype)[:, :2 * 64]))
        out.append((f"{tag}-rowstride-odd", rnd(5, 2 * 40 + 3, dtype=dtype)[:, :2 * 40]))
        out.append((f"{tag}-3d-merge", rnd(4, 3, 2 * 32 + 16, dtype=dtype)[:, :, :2 * 32]))
        out.append((f"{tag}-3d", rnd(2, 5, 2 * 48, dtype=dtype)))
        out.append((f"{tag}-1d", rnd(2 * 72, dtype=dtype)))
        out.append((f"{tag}-expand", rnd(1, 2 * 64, dtype=dtype).expand(6, 2 * 64)))
        flat = rnd(7 * 2 * 64 + 1, dtype=dtype)
        out.append((f"{tag}-misaligned", flat[1:].view(7, 2 * 64)))
        out.append((f"{tag}-empty-3d", rnd(3, 0, 2 * 16, dtype=dtype)))
    return out


# --------------------------------------------------------------------------------------------
# CPU: the reference and the dispatched op (torch backend)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_ref_equals_unfused_torch_cpu(dtype):
    for name, x in cases("cpu", [dtype]):
        assert_ulp(silu_mul_ref(x), unfused(x).contiguous(), 0, f"ref {name}")


def test_ref_rounding_order_cpu():
    """The reference rounds twice (silu, then the product); one rounding differs somewhere."""
    x = (3 * torch.randn(64, 2 * 512)).to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    once = (F.silu(gate) * up).to(torch.bfloat16)
    assert not torch.equal(silu_mul_ref(x), once)


def test_op_cpu_is_the_reference():
    for name, x in cases("cpu", DTYPES, rows_list=(0, 3), inners=(8, 129)):
        y = torch.ops.dflash.silu_mul(x)
        assert_ulp(y, unfused(x).contiguous(), 0, f"op {name}")
        assert y.shape == (*x.shape[:-1], x.shape[-1] // 2)
    y = dflash_ops.ops.silu_mul(torch.ones(2, 4))
    assert y.shape == (2, 2)


@pytest.mark.parametrize("what, make", [
    ("odd-last-dim", lambda: torch.randn(4, 9)),
    ("zero-last-dim", lambda: torch.randn(4, 0)),
    ("int", lambda: torch.randint(0, 5, (4, 8), dtype=torch.int32)),
    ("float64", lambda: torch.randn(4, 8, dtype=torch.float64)),
    ("last-stride-2", lambda: torch.randn(4, 16)[:, ::2]),
    ("0-d", lambda: torch.tensor(1.0)),
    ("leading-dims-do-not-merge", lambda: torch.randn(4, 3, 8).transpose(0, 1)),
    ("leading-dims-gap", lambda: torch.randn(4, 5, 8)[:, :3]),
])
def test_bad_x_raises_naming_x(what, make):
    x = make()
    with pytest.raises(ValueError, match=r"dflash\.silu_mul: x must") as info:
        torch.ops.dflash.silu_mul(x)
    assert "got" in str(info.value), str(info.value)  # expected vs given


# --------------------------------------------------------------------------------------------
# Triton under TRITON_INTERPRET=1 (set before triton is imported, hence a subprocess)
# --------------------------------------------------------------------------------------------
def check_interpreter():
    grid = cases("cpu", INTERP_DTYPES, rows_list=(0, 1, 3, 17), inners=(1, 8, 129, 1100))
    for name, x in grid:
        with dflash_ops.use_backend("triton", ops=["silu_mul"]):
            y = torch.ops.dflash.silu_mul(x)
        assert_ulp(y, numpy_exp_formula(x), 0, f"triton (interpreter) {name} vs numpy's exp")
        assert_ulp(y, unfused(x).contiguous(), 8, f"triton (interpreter) {name} vs unfused")


_INTERP_SCRIPT = r"""
import tests.test_act_kernels as t
t.check_interpreter()
print("interp-ok")
"""


def test_triton_silu_mul_interpreter_cpu():
    run_interpreted(_INTERP_SCRIPT, timeout=900)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
def _poison_allocator(nbytes, device="cuda"):
    # NaN into freed memory the caching allocator hands out next: an unwritten output shows.
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), device=device)
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_silu_mul_gpu(backend):
    grid = cases("cuda", DTYPES, rows_list=(0, 1, 3, 17, 64, 257, 1024),
                 inners=(1, 8, 129, 1100, 4104, 12288), big_rows=1024)
    inexact = total = 0
    for name, x in grid:
        want = unfused(x).contiguous()
        _poison_allocator(max(want.numel(), 1) * want.element_size() * 2)
        with dflash_ops.use_backend(backend, ops=["silu_mul"]):
            y = torch.ops.dflash.silu_mul(x)
        inexact += assert_ulp(y, want, MAX_ULP[backend], f"{backend} {name}")
        total += want.numel()
        if backend == "cuda":  # the reference on the GPU is the unfused ops as well
            assert_ulp(silu_mul_ref(x), want, 0, f"ref (cuda) {name}")
    if inexact:
        warnings.warn(f"silu_mul [{backend}]: {inexact} of {total} elements 1 ulp from "
                      f"F.silu(gate) * up (within tolerance, but not exact)")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_silu_mul_misaligned_gpu(backend, dtype):
    """Views whose rows are not on 16-byte boundaries (the CUDA kernel's scalar path): offset
    by one element, an odd row stride, an I whose halves are not 16-byte multiples."""
    for rows, inner, shift, pad in ((1, 4096, 1, 0), (33, 128, 1, 0), (17, 128, 0, 1),
                                    (9, 12, 0, 0), (64, 12288, 3, 0)):
        flat = torch.randn(rows * (2 * inner + pad) + shift, device="cuda").mul_(3).to(dtype)
        x = flat[shift:].view(rows, 2 * inner + pad)[:, :2 * inner]
        want = unfused(x).contiguous()
        _poison_allocator(want.numel() * want.element_size() * 2)
        with dflash_ops.use_backend(backend, ops=["silu_mul"]):
            y = torch.ops.dflash.silu_mul(x)
        assert_ulp(y, want, MAX_ULP[backend], f"{backend} rows={rows} I={inner} "
                                              f"shift={shift} pad={pad} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_silu_mul_cuda_graph(backend):
    x = torch.randn(64, 2 * 12288 + 64, device="cuda", dtype=torch.bfloat16)[:, :2 * 12288]
    with dflash_ops.use_backend(backend, ops=["silu_mul"]):
        torch.ops.dflash.silu_mul(x)  # warm-up (compilation) before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = torch.ops.dflash.silu_mul(x)
        for _ in range(2):
            x.copy_(torch.randn_like(x).mul_(3))
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_ulp(y, unfused(x).contiguous(), MAX_ULP[backend], f"{backend} graph replay")


@pytest.mark.gpu
def test_silu_mul_capture_graph_default_backend():
    """dispatch.capture_graph with the default kernel replays for new values."""
    x = torch.randn(16, 2 * 1024, device="cuda", dtype=torch.float16)
    graph, y = dispatch.capture_graph(lambda: torch.ops.dflash.silu_mul(x))
    x.copy_(torch.randn_like(x).mul_(3))
    graph.replay()
    torch.cuda.synchronize()
    assert_ulp(y, unfused(x).contiguous(), MAX_ULP[dflash_ops.backend_for("silu_mul")],
               "capture_graph replay")
