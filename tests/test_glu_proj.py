"""The SwiGLU in the gate | up GEMM's epilogue (``triton.context.glu_proj``, reached through
``models.linear.linear_silu_mul``): bit for bit ``silu_mul`` of ``kv_proj`` with the same tile,
and within the tolerance rule of ``F.silu(gate) * up`` in fp32; the routing (fused only where
``linear`` would run the table's unsplit Triton GEMM). Under TRITON_INTERPRET=1 on CPU (fp16 /
fp32: bf16 dots are wrong in the interpreter) and on the GPU (bf16 / fp16, graph replay)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_interpreted

# (T, I, H, bias, cfg fields bm, bn, bk, gm, warps, stages, tma, persistent): whole and partial
# tiles in T and I, K a multiple of BLOCK_K or not, pointers and TMA, persistent programs
GRID = [(1, 64, 256, False, (16, 32, 128, 8, 4, 2, True, False)),
        (5, 40, 96, True, (16, 32, 64, 8, 4, 2, True, False)),      # I % bn, H % bk, bias
        (17, 96, 128, False, (16, 64, 64, 8, 4, 2, False, False)),  # pointers, T % bm
        (3, 72, 200, True, (16, 32, 64, 8, 4, 2, False, True)),     # pointers, uneven K, persistent
        (33, 128, 64, False, (32, 64, 64, 2, 4, 2, True, True))]


def glu_case(t, i, h, bias, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    w = (torch.randn(2 * i, h, generator=g) / h ** 0.5).to(device, dtype)
    b = torch.randn(2 * i, generator=g).to(device, dtype) if bias else None
    return x, w, b


def check_glu(device, dtypes, grid=GRID):
    from dflash_ops.triton.context import ProjCfg, glu_proj, kv_proj
    from dflash_ops.triton.act import silu_mul

    for dtype in dtypes:
        for n, (t, i, h, bias, cfg) in enumerate(grid):
            x, w, b = glu_case(t, i, h, bias, dtype, device, 30 + n)
            pc = ProjCfg(*cfg)
            got = glu_proj(x, w, b, cfg=pc)
            what = f"glu_proj {dtype} T {t} I {i} H {h} bias {bias} {cfg}"
            assert got.shape == (t, i) and got.dtype == dtype, what
            # the same tile through kv_proj, then silu_mul: the same bits
            want = silu_mul(kv_proj(x, w, b, cfg=pc))
            assert torch.equal(got, want), what + f": max diff {(got - want).abs().max()}"
            # and the math in fp32: within the tolerance rule of the same math in the dtype
            y = F.linear(x.float(), w.float(), None if b is None else b.float())
            ref = F.silu(y[:, :i]) * y[:, i:]
            yd = F.linear(x, w, b) if dtype != torch.float32 else y
            base = (F.silu(yd[:, :i].float()).to(dtype).float() * yd[:, i:].float()
                    ).to(dtype).float().sub(ref).abs().max().item()
            err = (got.float() - ref).abs().max().item()
            assert err <= 2 * base + 1e-5 * max(1.0, ref.abs().max().item()), \
                f"{what}: err {err:.3e} vs base {base:.3e}"


def check_routing(device, dtype):
    """linear_silu_mul: the fused launch where the table names an unsplit Triton GEMM, the two
    calls for a split-K entry, a cuBLAS entry and in exact mode."""
    from dflash_ops.models import linear as L
    from dflash_ops.triton import context as TC

    x, w, _ = glu_case(4, 64, 128, False, dtype, device, 7)
    calls = []
    real = TC.glu_proj

    def spy(*a, **k):
        calls.append(k["cfg"])
        return real(*a, **k)

    TC.glu_proj = spy
    saved = L.choice
    try:
        want = torch.ops.dflash.silu_mul(F.linear(x, w))
        for cfg, fused in (((16, 64, 64, 8, 4, 2, True, False), True),
                           ((16, 64, 64, 8, 4, 2, True, False, 2, False), False),
                           (None, False)):
            calls.clear()
            L.choice = lambda *a, cfg=cfg, **k: cfg
            got = L.linear_silu_mul(x.view(2, 2, 128), w)
            assert got.shape == (2, 2, 64)
            assert len(calls) == int(fused), (cfg, calls)
            if fused:  # half the N tile, so a program streams the table tile's weight rows
                assert calls[0].bn == 32 and calls[0].split == 1
            tol = 2e-3 if dtype == torch.float16 else 1e-5
            torch.testing.assert_close(got.view(4, 64).float(), want.float(), atol=tol, rtol=tol)
        calls.clear()
        L.choice = lambda *a, **k: (16, 64, 64, 8, 4, 2, True, False)
        if device == "cpu":  # exact mode: linear(..., exact=True) is F.linear off CUDA
            L.linear_silu_mul(x, w, exact=True)
            assert not calls
    finally:
        L.choice = saved
        TC.glu_proj = real


_SCRIPT = r"""
import torch
import dflash_ops
import tests.test_glu_proj as t
t.check_glu("cpu", (torch.float32, torch.float16))
t.check_routing("cpu", torch.float16)
print("interp-ok")
"""


def test_glu_proj_under_interpreter():
    run_interpreted(_SCRIPT, timeout=900)


def test_linear_silu_mul_on_cpu_is_the_two_calls():
    import dflash_ops  # noqa: F401
    from dflash_ops.models.linear import linear_silu_mul

    x, w, _ = glu_case(3, 24, 32, False, torch.float32, "cpu", 1)
    y = F.linear(x, w)
    assert torch.equal(linear_silu_mul(x, w), torch.ops.dflash.silu_mul(y))


@pytest.mark.gpu
def test_glu_proj_gpu():
    import dflash_ops  # noqa: F401

    grid = GRID + [(1, 12288, 4096, False, (16, 32, 128, 8, 4, 4, True, False)),
                   (16, 12288, 4096, False, (16, 32, 128, 8, 4, 4, True, False)),
                   (8, 6144, 2560, False, (16, 32, 128, 8, 4, 4, False, False))]
    check_glu("cuda", (torch.bfloat16, torch.float16), grid)
    check_routing("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
def test_linear_silu_mul_graph_gpu(monkeypatch, m):
    """In a captured call at Qwen3-8B's gate_up shape the layer's MLP takes the fused launch
    (a table entry without split) and replays with new inputs: equal to silu_mul of the same
    tile's GEMM, bit for bit."""
    import dflash_ops  # noqa: F401
    from dflash_ops import dispatch
    from dflash_ops.models import linear as L
    from dflash_ops.triton.context import ProjCfg, glu_tile, kv_proj
    from dflash_ops.triton.act import silu_mul

    cfg = (16, 64, 128, 8, 4, 4, True, False)
    monkeypatch.setattr(L, "TABLE", {(24576, 4096): {L.m_bucket(m): cfg}})
    monkeypatch.setattr(L, "TABLE_GPU", None)
    x, w, _ = glu_case(m, 12288, 4096, False, torch.bfloat16, "cuda", 3)
    out = {}

    def step():
        out["y"] = L.linear_silu_mul(x, w)

    graph = dispatch.capture_graph(step)[0]
    for seed in (4, 5):
        x.copy_(glu_case(m, 12288, 4096, False, torch.bfloat16, "cuda", seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = silu_mul(kv_proj(x, w, cfg=glu_tile(ProjCfg(*cfg))))
        assert torch.equal(out["y"], want)
