"""The Triton and CUDA ``kv_proj`` and ``context_kv_`` on the GPU against the PyTorch reference.

The checks are those of tests/test_triton_context_kv_interp.py (whole cache buffers compared,
untouched elements bit for bit, -1 and out-of-range slots, positions outside the table, K within
2x the torch reference's error in the dtype, V within one rounding of it), run in bf16 (and a
few fp16/fp32) over a grid: T 1/7/8/9/16/32/33/257/4096, L 1/5/8, Hkv 1/4/8, D 64/128/256,
NeoX and GPT-J, full and partial rotary (one R not a power of two: the tl.gather path), caches as
separate tensors and as vLLM views, hidden_norm on and off and folded into w_kv (hidden_rms);
plus a CUDA-graph capture/replay.
Each backend (triton, cuda) is forced in turn; a backend without the op skips with the reason.
"""
from __future__ import annotations

import re

import pytest
import torch

import dflash_ops
from dflash_ops import dispatch
from tests import test_opcheck as opcheck_cases
from tests import test_triton_context_kv_interp as interp

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


BACKENDS = ["triton", "cuda"]


def _need(op: str, backend: str = "triton") -> None:
    if not dispatch.has_backend(op, backend):
        pytest.skip(f"no {backend} kernel for {op} (available: "
                    f"{dispatch.available_backends(op)})")


# (T, H, N): Qwen3-8B / 4B / 27B-DFlash2 / gpt-oss-20b K/V widths, plus ragged ones
PROJ_SHAPES = [(1, 4096, 10240), (7, 2560, 10240), (16, 4096, 10240), (33, 5120, 10240),
               (64, 2880, 8192), (257, 4096, 10240), (4096, 4096, 10240), (100, 72, 200),
               (1000, 1000, 1000)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("shape", PROJ_SHAPES, ids=lambda s: "T{}_H{}_N{}".format(*s))
def test_kv_proj(shape, dtype, backend):
    _need("kv_proj", backend)
    interp.check_kv_proj(DEV, (dtype,), shapes=(shape,), backend=backend)


# kv_proj's CUDA skinny kernel (1-8 rows by default, H % 64 == 0, sm_90; csrc/context.cu
# skinny_plan: 32-row CTAs, two steps in flight): o_proj (2 splits), gate_up (1), down, DFlash
# 2's proj2 (4 splits), N tails (1000, 777, 33000), 2 steps, 10 steps; 1 to 8 rows
SKINNY_SHAPES = [(1, 4096, 4096), (8, 4096, 24576), (7, 12288, 4096), (8, 5120, 1280),
                 (3, 128, 1000), (5, 640, 777), (2, 1024, 33000), (4, 4096, 24576)]


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("shape", SKINNY_SHAPES, ids=lambda s: "T{}_H{}_N{}".format(*s))
def test_kv_proj_skinny(shape, dtype):
    """The CUDA kv_proj takes its skinny kernel at these shapes with its default plan (x a
    column slice of a wider buffer, with and without bias), within the tolerance rule of the
    torch reference; at 9 rows it runs cuBLAS."""
    _need("kv_proj", "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        interp.check_kv_proj(DEV, (dtype,), shapes=(shape,), backend="cuda")
    names = {e.key for e in prof.key_averages() if "skinny_kernel" in e.key}
    assert any(re.search(r"skinny_kernel<[^<>]*\b1, 1, 4, 2>", k) for k in names), names
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        interp.check_kv_proj(DEV, (dtype,), shapes=((9,) + shape[1:],), backend="cuda")
    assert not any("skinny_kernel" in e.key for e in prof.key_averages()), "9 rows: cuBLAS"


# DFLASH_OPS_SKINNY_PLAN (MT, KG, SPLITS, U): every kernel instance the variable can force,
# each at shapes where its row groups, splits and two-step loop have tails: N not a multiple of
# the CTA's rows, steps that do not divide among the splits and row groups, odd step counts,
# more splits x row groups than steps (idle warps)
SKINNY_PLANS = ["2,1,1,1", "2,1,4,2", "1,1,8,1", "1,1,2,2", "1,4,8,1", "1,4,2,2", "1,4,8,2",
                "2,1,8,2"]
SKINNY_PLAN_SHAPES = [(1, 5120, 1280), (9, 704, 1000), (32, 192, 4100), (16, 4096, 4096)]


@pytest.mark.parametrize("plan", SKINNY_PLANS)
@pytest.mark.parametrize("shape", SKINNY_PLAN_SHAPES, ids=lambda s: "T{}_H{}_N{}".format(*s))
def test_kv_proj_skinny_plans(shape, plan, monkeypatch):
    """The skinny kernel under each forced plan (read at each call), bf16 and fp16, with and
    without bias, within the tolerance rule of the torch reference; the profiler sees it run."""
    _need("kv_proj", "cuda")
    monkeypatch.setenv("DFLASH_OPS_SKINNY_PLAN", plan)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        interp.check_kv_proj(DEV, (BF16, FP16), shapes=(shape,), backend="cuda")
    mt, kg, _, u = plan.split(",")
    nt = 1 if shape[0] <= 8 else 2 if shape[0] <= 16 else 4
    want = re.compile(rf"skinny_kernel<[^<>]*\b{mt}, {nt}, {kg}, {u}>")
    names = {e.key for e in prof.key_averages() if "skinny_kernel" in e.key}
    assert any(want.search(k) for k in names), f"not the forced instance: {names}"


@pytest.mark.parametrize("value", ["1,2,8,1", "2,4,1,1", "3,1,1,1", "1,1,3,1", "1,1,1,3",
                                   "1,1,1", "1,1,1,1,", "a"])
def test_kv_proj_skinny_plan_refuses_bad_values(value, monkeypatch):
    _need("kv_proj", "cuda")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the skinny kernel runs on sm_90 only")
    monkeypatch.setenv("DFLASH_OPS_SKINNY_PLAN", value)
    x = torch.randn(2, 128, device=DEV, dtype=BF16)
    w = torch.randn(256, 128, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match=r"DFLASH_OPS_SKINNY_PLAN: expected 'MT,KG,SPLITS,U'.*"
                                         r"got '" + re.escape(value) + "'"):
        torch.ops.dflash_cuda.kv_proj(x, w, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_proj_fp32(backend):
    _need("kv_proj", backend)
    interp.check_kv_proj(DEV, (FP32,), shapes=((7, 256, 384), (300, 128, 256)), backend=backend)


# (T, H, L, Hkv, D, R, neox, layout, bias, hidden_norm)
CONTEXT_CASES = [
    (1, 4096, 5, 8, 128, 128, True, "nhd2", False, False),       # Qwen3-8B, decode-size T
    (7, 2560, 5, 8, 128, 128, True, "separate", False, True),    # Qwen3-4B, hidden_norm
    (16, 4096, 5, 8, 128, 64, False, "hnd2d", True, False),      # GPT-J, partial, bias
    (257, 2880, 8, 4, 64, 64, True, "nhd2", False, True),        # gpt-oss-like D 64, L 8
    (4096, 4096, 5, 8, 128, 128, True, "nhd2", False, False),    # long prefill
    (257, 512, 1, 1, 256, 256, False, "separate", True, False),  # D 256
    (16, 512, 8, 1, 256, 128, True, "nhd2", False, True),
    (7, 1024, 1, 4, 64, 32, False, "hnd2d", False, False),
    (257, 1024, 5, 8, 128, 96, True, "separate", False, False),  # R not a power of two
    (4096, 1024, 8, 4, 64, 64, False, "separate", True, True),
    # hidden_rms (the norm's weight folded into w_kv): the CUDA epilogue's own rstd at T <= 256,
    # a norm pass of ones above
    (1, 4096, 5, 8, 128, 128, True, "nhd2", False, "rms"),       # the plugin's decode shape
    (2, 4096, 5, 8, 128, 128, True, "nhd2", True, "rms"),        # 4 warps a token's x row
    (7, 2560, 5, 8, 128, 128, True, "separate", False, "rms"),   # blocks of 4 and 3 tokens
    (16, 4096, 5, 8, 128, 64, False, "hnd2d", True, "rms"),      # GPT-J, partial, bias
    (33, 2880, 8, 1, 64, 64, True, "separate", True, "rms"),     # Hkv 1: 32 tokens a block
    (100, 1001, 1, 1, 256, 256, False, "separate", True, "rms"),  # D 256, x rows unaligned
    (257, 2880, 8, 4, 64, 64, True, "nhd2", False, "rms"),       # above 256: norm pass
    # the CUDA fused path's edges (T <= 32, D 128): 8 / 9 / 32 tokens (one and four column
    # tiles), 65 steps of 64 over 8 splits, 2 steps (6 idle splits), T 33 (not fused)
    (8, 4160, 2, 3, 128, 128, False, "hnd2d", True, False),
    (9, 128, 1, 1, 128, 128, True, "separate", True, "rms"),
    (32, 1024, 8, 2, 128, 64, True, "nhd2", False, "rms"),
    (33, 1024, 2, 2, 128, 128, True, "nhd2", True, "rms"),
]


def _case_id(c):
    t, h, n_layers, hkv, d, r, neox, layout, bias, hn = c
    return (f"T{t}_H{h}_L{n_layers}_Hkv{hkv}_D{d}_R{r}_{'neox' if neox else 'gptj'}_{layout}"
            f"{'_bias' if bias else ''}{'_rms' if hn == 'rms' else '_hn' if hn else ''}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", CONTEXT_CASES, ids=_case_id)
def test_context_kv(case, dtype, backend):
    _need("context_kv_", backend)
    t, h, n_layers, hkv, d, r, neox, layout, bias, hn = case
    if dtype == FP16 and t * h * n_layers > 4096 * 4096:
        pytest.skip("fp16 covered on the smaller cases")
    bs = 16
    gen = torch.Generator().manual_seed(t * 131 + h)
    interp.run_context_case(DEV, dtype, t, h, n_layers, hkv, d, r, neox, layout, bias, hn, gen,
                            nb=t // bs + 3, bs=bs, strided_table=(t % 2 == 1), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_kv_hidden_rms_zero_width_x(backend):
    """hidden_rms with H = 0 (x [T, 0]): kv is the bias alone (the GEMM's rows are zero and
    rstd = 1 / sqrt(eps)), on the CUDA fused path too (an empty x has no data pointer)."""
    _need("context_kv_", backend)
    g = torch.Generator().manual_seed(3)
    t, n_layers, hkv, d, nb, bs = 5, 2, 2, 64, 2, 4
    n = n_layers * 2 * hkv * d
    args = dict(x=torch.empty(t, 0), w_kv=torch.empty(n, 0), bias=torch.randn(n, generator=g),
                k_weight=1 + 0.1 * torch.randn(n_layers, d, generator=g),
                positions=torch.arange(t), cos_sin_cache=dflash_ops.make_cos_sin_cache(16, d),
                slot_mapping=torch.tensor([0, 3, -1, 6, 7]))
    got, want = {}, {}
    for dev, out, bk in ((DEV, got, backend), ("cpu", want, "torch")):
        a = {k: (v.to(dev, BF16) if v.is_floating_point() and k != "cos_sin_cache" else
                 v.to(dev)) for k, v in args.items()}
        kc = [torch.zeros(nb, bs, hkv, d, dtype=BF16, device=dev) for _ in range(n_layers)]
        vc = [torch.zeros_like(c) for c in kc]
        with dflash_ops.use_backend(bk, ops=["context_kv_"]):
            dflash_ops.context_kv_(*a.values(), kc, vc, 1e-6, True, None, True)
        out["k"], out["v"] = torch.stack(kc).cpu(), torch.stack(vc).cpu()
    assert got["v"].abs().sum() > 0  # the bias reached V
    torch.testing.assert_close(got["v"], want["v"], atol=0, rtol=0)
    torch.testing.assert_close(got["k"].float(), want["k"].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [33, 300])
def test_context_kv_fp32(backend, t):
    _need("context_kv_", backend)
    gen = torch.Generator().manual_seed(7)
    interp.run_context_case(DEV, FP32, t, 256, 2, 2, 128, 128, True, "nhd2", True, True, gen,
                            nb=t // 16 + 3, bs=16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_kv_huge_slots(backend):
    _need("context_kv_", backend)
    interp.check_context_kv_huge_slots(DEV, dtype=BF16, d=128, hkv=8, n_layers=5, h=256,
                                       backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [16, 256])
@pytest.mark.parametrize("hidden_norm", [False, True])
def test_context_kv_cuda_graph(hidden_norm, t, backend):
    """Warm up once (compiles, builds the cache table), capture, then replay with new inputs
    copied into the static buffers (T padded to a bucket; padded rows' slots = -1)."""
    _need("context_kv_", backend)
    h, n_layers, hkv, d, bs = 1024, 5, 8, 128, 16
    nb = t // bs + 4
    dtype, eps, neox = BF16, 1e-6, True
    n = n_layers * 2 * hkv * d
    w = (torch.randn(n, h, device=DEV) * h ** -0.5).to(dtype)
    kw = (1 + 0.1 * torch.randn(n_layers, d, device=DEV)).to(dtype)
    hw = (1 + 0.1 * torch.randn(h, device=DEV)).to(dtype) if hidden_norm else None
    cs = interp._table(d, DEV)
    x = torch.empty(t, h, device=DEV, dtype=dtype)
    pos = torch.zeros(t, device=DEV, dtype=torch.int64)
    slots = torch.full((t,), -1, device=DEV, dtype=torch.int64)
    backing = [torch.randn(nb, 2, bs, hkv, d, device=DEV).to(dtype) for _ in range(n_layers)]
    kc, vc = interp.cache_views("nhd2", backing, d)

    def call():
        torch.ops.dflash.context_kv_.default(x, w, None, kw, pos, cs, slots, kc, vc, eps, neox,
                                             hw)

    def fill(valid: int):
        x.copy_(torch.randn(t, h, device=DEV).to(dtype))
        pos.copy_(torch.randint(0, interp.P, (t,), device=DEV))
        perm = torch.randperm(nb * bs, device=DEV)[:t]
        perm[valid:] = -1  # the bucket's padding rows
        slots.copy_(perm)

    with dflash_ops.use_backend(backend, ops=["context_kv_"]):
        fill(t)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()  # warm-up: compile + the per-layer cache table
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        for rnd, valid in enumerate((t, t // 2 + 1, 1)):
            fill(valid)
            for b in backing:
                b.copy_(torch.randn_like(b, dtype=torch.float32).to(dtype))
            orig = [b.clone() for b in backing]
            want = [b.clone() for b in backing]
            with dflash_ops.use_backend("torch", ops=["context_kv_"]):
                torch.ops.dflash.context_kv_.default(x, w, None, kw, pos, cs, slots,
                                                     *interp.cache_views("nhd2", want, d), eps,
                                                     neox, hw)
            graph.replay()
            torch.cuda.synchronize()
            kept = slots[slots >= 0]
            for i, (got, ref, o) in enumerate(zip(backing, want, orig)):
                assert not torch.isnan(got).any(), f"replay {rnd}: NaN in layer {i}"
                written = torch.zeros_like(got, dtype=torch.bool)
                written[kept // bs, :, kept % bs] = True  # [nb, 2, bs, Hkv, D]: K and V rows
                assert torch.equal(got[~written], o[~written]), \
                    f"replay {rnd} layer {i}: an element outside the valid slots changed"
                # within a few ulps of the reference (K: norm + RoPE; V: one rounding)
                tol = 4 * torch.finfo(dtype).eps * max(1.0, ref.float().abs().max().item())
                err = (got.float() - ref.float()).abs().max().item()
                assert err <= tol, f"replay {rnd} layer {i}: max err {err:.3e} > {tol:.1e}"


# opcheck (schema mutations, fake kernel, AOT dispatch) with each backend forced, on the ops'
# sample cases (tests/test_opcheck.py)
_OPCHECK = [pytest.param(op, case, id=f"{op}-{case}") for op, case in opcheck_cases.CASES
            if op in ("kv_proj", "context_kv_")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op, case", _OPCHECK)
def test_opcheck_backend(op, case, dtype, backend):
    _need(op, backend)
    with dflash_ops.use_backend(backend, ops=[op]):
        opcheck_cases.opcheck(op, case, dtype, DEV)


def test_context_kv_launch_variants():
    """TMA vs pointer loads, the split path vs one fused kernel, persistent vs one program per
    tile (the variants the default configs may not reach), on the interpreter tests' cases."""
    _need("context_kv_")
    interp.check_context_variants(DEV, dtypes=(BF16, FP16))


def test_kv_proj_launch_variants():
    _need("kv_proj")
    interp.check_kv_proj_variants(DEV)
