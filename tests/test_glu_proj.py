"""The SwiGLU in the gate | up GEMM's epilogue (``triton.context.glu_proj``, reached through
``models.linear.linear_silu_mul``): bit for bit ``silu_mul`` of ``kv_proj`` with the same tile,
and within the tolerance rule of ``F.silu(gate) * up`` in fp32; the routing (fused only where
``linear`` would run the table's unsplit Triton GEMM).

The post-attention norm folded into o_proj's and gate | up's epilogues
(``triton.context.proj_add_norm_`` + ``glu_proj(rstd=...)``, reached through
``models.linear.o_proj_norm_silu_mul``): the residual exactly as ``fused_add_rms_norm_`` leaves
it, the SwiGLU within the tolerance rule of the unfused chain in fp32; the routing.

Under TRITON_INTERPRET=1 on CPU (fp16 / fp32: bf16 dots are wrong in the interpreter) and on the
GPU (bf16 / fp16, graph replay)."""
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
            # the same tile through kv_proj, then silu_mul: the same bits on the GPU. Not in
            # the interpreter: its tl.dot is numpy's matmul, whose BLAS blocks (and rounds) the
            # two kernels' tile products by their shapes, differently on some CPUs (seen on an
            # AMD EPYC without AVX-512: 80 ulps); the fp32 rule below holds there too
            if device != "cpu":
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


# (T, H, Hq*D, I, o_proj cfg (bm, bn, bk, gm, warps, stages, tma, persistent[, split]), o bias,
# gate | up cfg): o_proj plain and split-K, partial tiles, TMA and pointers
FOLD_GRID = [(1, 128, 64, 96, (16, 32, 64, 8, 4, 2, True, False, 2), False,
              (16, 64, 64, 8, 4, 2, True, False)),
             (5, 96, 80, 40, (16, 32, 32, 8, 4, 2, False, False), True,
              (16, 32, 32, 8, 4, 2, False, False)),
             (17, 64, 64, 64, (16, 16, 64, 8, 4, 2, True, True), False,
              (16, 32, 64, 8, 4, 2, True, True)),
             (3, 160, 48, 72, (16, 32, 32, 8, 4, 2, False, False, 3), True,
              (16, 64, 64, 8, 4, 2, False, False)),
             # H not a multiple of o_proj's N tile (garbage columns in the pointer path's last
             # tile must not reach the sums of squares), plain and split-K
             (5, 80, 64, 40, (16, 32, 32, 8, 4, 2, False, False), True,
              (16, 32, 32, 8, 4, 2, False, False)),
             (2, 80, 96, 48, (16, 32, 32, 8, 4, 2, False, False, 2), False,
              (16, 64, 32, 8, 4, 2, False, False))]


def fold_case(t, h, a, i, bias, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(device, dtype)  # noqa
    attn = mk(t, a)
    w_o = mk(h, a, scale=a ** -0.5)
    b_o = mk(h) if bias else None
    res = mk(t, h, scale=2.0)
    nw = (1 + 0.3 * torch.randn(h, generator=g)).to(device, dtype)
    w_gu = mk(2 * i, h, scale=h ** -0.5)
    return attn, w_o, b_o, res, nw, w_gu


def fold_chain(attn, w_o, b_o, res, nw, w_gu, eps, dtype):
    """The unfused chain in ``dtype`` (res updated in place) and in fp32: (act, act fp32)."""
    o = F.linear(attn, w_o, b_o)
    if dtype == torch.float32:
        o32 = o
    else:
        o32 = F.linear(attn.float(), w_o.float(), None if b_o is None else b_o.float())
    r32 = res.float() + o32
    res.add_(o)
    hf = res.float()
    normed = ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * nw)
    y = F.linear(normed, w_gu)
    i = w_gu.shape[0] // 2
    act = (F.silu(y[:, :i].float()).to(dtype).float() * y[:, i:].float()).to(dtype)
    n32 = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps) * nw.float()
    y32 = F.linear(n32, w_gu.float())
    return act, F.silu(y32[:, :i]) * y32[:, i:]


def fold_alt(res, nw, w_gu, eps, dtype):
    """The fold's own rounding points in PyTorch (u = T(res * nw), an fp32 sum, rstd after it),
    from the residual after the add: the tolerance rule's second base."""
    hf = res.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    u = (hf * nw.float()).to(dtype)
    y = (F.linear(u.float(), w_gu.float()) * rstd).to(dtype).float()
    i = w_gu.shape[0] // 2
    return (F.silu(y[:, :i]).to(dtype).float() * y[:, i:]).to(dtype)


def check_fold(device, dtypes, grid=FOLD_GRID, eps=1e-6):
    from dflash_ops.triton.context import ProjCfg, glu_proj, proj_add_norm_

    for dtype in dtypes:
        for n, (t, h, a, i, ocfg, bias, gcfg) in enumerate(grid):
            attn, w_o, b_o, res, nw, w_gu = fold_case(t, h, a, i, bias, dtype, device, 50 + n)
            what = f"fold {dtype} T {t} H {h} A {a} I {i} {ocfg} {gcfg}"
            res_chain = res.clone()
            act_d, act32 = fold_chain(attn, w_o, b_o, res_chain, nw, w_gu, eps, dtype)
            # the same o_proj result as a plain kv_proj of that cfg, then the residual add in the
            # dtype: what the epilogue must have left in res
            from dflash_ops.triton.context import kv_proj
            o_same = kv_proj(attn, w_o, b_o, cfg=ProjCfg(*ocfg))
            want_res = (res.float() + o_same.float()).to(dtype)
            u, ss = proj_add_norm_(attn, w_o, b_o, res, nw, cfg=ProjCfg(*ocfg))
            assert torch.equal(res, want_res), what + ": residual"
            assert torch.equal(u, (want_res.float() * nw.float()).to(dtype)), what + ": u"
            torch.testing.assert_close(ss.sum(1), want_res.float().pow(2).sum(1), rtol=1e-5,
                                       atol=1e-5, msg=what + ": sums of squares")
            got = glu_proj(u, w_gu, cfg=ProjCfg(*gcfg), rstd=(ss, eps))
            # the residual's reference: the chain's (PyTorch's GEMM), not the kernel's own o
            torch.testing.assert_close(want_res.float(), res_chain.float(), rtol=2e-2,
                                       atol=2e-2 * res_chain.float().abs().max().item(),
                                       msg=what + ": o_proj")
            alt = fold_alt(res_chain, nw, w_gu, eps, dtype)
            base = max((act_d.float() - act32).abs().max().item(),
                       (alt.float() - act32).abs().max().item())
            err = (got.float() - act32).abs().max().item()
            assert err <= 2 * base + 1e-5 * max(1.0, act32.abs().max().item()), \
                f"{what}: err {err:.3e} vs the chain's {base:.3e}"


def check_fold_routing(device, dtype):
    """o_proj_norm_silu_mul folds where both GEMMs take the table's Triton launch and gate | up
    has no split; None (the caller's unfused chain) for exact mode, a cuBLAS or C++ entry, a
    split gate | up, a non-contiguous residual or another dtype."""
    from dflash_ops.models import linear as L

    attn, w_o, _, res, nw, w_gu = fold_case(4, 128, 64, 96, False, dtype, device, 9)
    plain = (16, 32, 64, 8, 4, 2, True, False)
    split = (16, 32, 64, 8, 4, 2, True, False, 2, False)
    saved = L.choice
    try:
        def pick(o_cfg, g_cfg):
            L.choice = lambda m, n, k, *a, **kw: o_cfg if n == 128 else g_cfg

        pick(split, plain)
        r = res.clone()
        got = L.o_proj_norm_silu_mul(attn, w_o, None, r, nw, 1e-6, w_gu)
        assert got is not None and got.shape == (4, 96) and not torch.equal(r, res)
        for o_cfg, g_cfg in ((None, plain), (plain, None), (L.CUDA_CFG, plain),
                             (plain, L.CUDA_CFG), (plain, split)):
            pick(o_cfg, g_cfg)
            assert L.o_proj_norm_silu_mul(attn, w_o, None, res, nw, 1e-6, w_gu) is None
        pick(plain, plain)
        assert L.o_proj_norm_silu_mul(attn, w_o, None, res, nw, 1e-6, w_gu, exact=True) is None
        wide = torch.zeros(4, 256, dtype=dtype, device=device)[:, :128]
        assert L.o_proj_norm_silu_mul(attn, w_o, None, wide, nw, 1e-6, w_gu) is None
        assert L.o_proj_norm_silu_mul(attn, w_o, None, res.float(), nw, 1e-6, w_gu) is None
        from dflash_ops import dispatch
        for op in ("silu_mul", "fused_add_rms_norm_"):  # torch forced: nothing fused
            with dispatch.use_backend("torch", ops=(op,)):
                assert L.o_proj_norm_silu_mul(attn, w_o, None, res, nw, 1e-6, w_gu) is None
            with dispatch.use_backend("triton", ops=(op,)):  # exact mode's graph_backends
                r = res.clone()
                assert L.o_proj_norm_silu_mul(attn, w_o, None, r, nw, 1e-6, w_gu) is not None
    finally:
        L.choice = saved


def check_fold_in_layers():
    """A tiny target (fp32; Qwen3 without biases, Llama with an o_proj bias) with the table
    patched to a Triton launch for every linear: the layers take the fold (every call) and
    give the logits and taps of the same model with the fold off, prefill and a second step."""
    from dflash_ops.models import layer as LY, linear as L
    from dflash_ops.models.target import Target, TargetConfig
    from tests.test_target import _hf_dict

    real, saved_choice, calls = LY.o_proj_norm_silu_mul, L.choice, []

    def spy(*a, **k):
        r = real(*a, **k)
        calls.append(r is not None)
        return r

    L.choice = lambda m, n, k, *a, **kw: (16, 32, 32, 8, 4, 2, False, False)
    try:
        for mt, bias in (("qwen3", False), ("llama", True)):
            cfg = TargetConfig.from_hf(_hf_dict(mt, False, bias))
            out = {}
            for fold in (True, False):
                LY.o_proj_norm_silu_mul = spy if fold else (lambda *a, **k: None)
                tgt = Target.random(cfg, seed=3, dtype=torch.float32, num_blocks=40,
                                    block_size=4, max_requests=4, max_len=64)
                tgt.add_request(1)
                tgt.add_request(0)
                ids = torch.randint(0, 101, (9,), generator=torch.Generator().manual_seed(0))
                out[fold] = (tgt.forward(ids, [1, 0], [0, 0], [5, 4], [0, 1]),
                             tgt.forward(ids[:3], [1, 0], [5, 4], [1, 2], [1]))
            assert calls and all(calls), (mt, calls)
            calls.clear()
            for a, b in zip(out[True], out[False]):
                for x, y in zip(a, b):
                    torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    finally:
        LY.o_proj_norm_silu_mul, L.choice = real, saved_choice


_SCRIPT = r"""
import torch
import dflash_ops
import tests.test_glu_proj as t
t.check_glu("cpu", (torch.float32, torch.float16))
t.check_routing("cpu", torch.float16)
t.check_fold("cpu", (torch.float32, torch.float16))
t.check_fold("cpu", (torch.float32,), eps=1.0)  # eps large against the rows' mean square
t.check_fold_routing("cpu", torch.float16)
t.check_fold_in_layers()
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
    monkeypatch.setattr(L, "TABLE_GPUS", None)
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


@pytest.mark.gpu
def test_fold_gpu():
    import dflash_ops  # noqa: F401

    grid = FOLD_GRID + [
        (1, 4096, 4096, 12288, (16, 64, 128, 8, 4, 4, True, False, 4), False,
         (16, 32, 128, 8, 4, 4, True, False)),
        (16, 4096, 4096, 12288, (16, 32, 256, 8, 4, 4, True, False), False,
         (16, 32, 128, 8, 4, 4, True, False))]
    check_fold("cuda", (torch.bfloat16, torch.float16), grid)
    check_fold_routing("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_fold_graph_gpu(monkeypatch, m):
    """A captured o_proj_norm_silu_mul at Qwen3-8B's shapes (the H200 table's o_proj and gate_up
    configs) replays with new inputs: the residual as the chain leaves it, the SwiGLU within
    the tolerance rule."""
    import dflash_ops  # noqa: F401
    from dflash_ops import dispatch
    from dflash_ops.models import linear as L

    o_cfg = (16, 64, 128, 8, 4, 4, True, False, 4, False) if m == 1 else \
        (16, 32, 256, 8, 4, 4, True, False, 1, False)
    monkeypatch.setattr(L, "TABLE", {(4096, 4096): {L.m_bucket(m): o_cfg},
                                     (24576, 4096): {L.m_bucket(m): (16, 64, 128, 8, 4, 4, True,
                                                                     False)}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)
    dt = torch.bfloat16
    attn, w_o, _, res, nw, w_gu = fold_case(m, 4096, 4096, 12288, False, dt, "cuda", 1)
    out = {}
    res0 = res.clone()

    def step():
        res.copy_(res0)
        out["y"] = L.o_proj_norm_silu_mul(attn, w_o, None, res, nw, 1e-6, w_gu)

    graph = dispatch.capture_graph(step)[0]
    for seed in (2, 3):
        new = fold_case(m, 4096, 4096, 12288, False, dt, "cuda", seed)
        attn.copy_(new[0])
        res0.copy_(new[3])
        graph.replay()
        torch.cuda.synchronize()
        assert out["y"] is not None
        from dflash_ops.triton.context import ProjCfg, kv_proj
        o_same = kv_proj(attn, w_o, cfg=ProjCfg(*o_cfg))  # the epilogue's o, then the add
        assert torch.equal(res, (res0.float() + o_same.float()).to(dt))
        act_d, act32 = fold_chain(attn, w_o, None, res0.clone(), nw, w_gu, 1e-6, dt)
        base = max((act_d.float() - act32).abs().max().item(),
                   (fold_alt(res, nw, w_gu, 1e-6, dt).float() - act32).abs().max().item())
        err = (out["y"].float() - act32).abs().max().item()
        assert err <= 2 * base + 1e-5 * max(1.0, act32.abs().max().item()), (err, base)
