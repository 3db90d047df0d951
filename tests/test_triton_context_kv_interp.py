"""The Triton ``kv_proj`` and fused ``context_kv_`` kernels on CPU under TRITON_INTERPRET=1
against the PyTorch reference (the default backend on CPU).

TRITON_INTERPRET must be set before triton is imported, so each test runs its checks in a
subprocess (repo root as cwd, no CUDA). fp16/fp32 only (tl.dot on bf16 is wrong in the
interpreter). Tolerance: max error against an fp32 reference at most 2x the error of
the reference run in the test dtype, plus a small atol. For ``context_kv_`` whole cache buffers
are compared: every element no valid token's slot maps to keeps its random value bit for bit,
the V rows equal the fp32 GEMM rounded to the dtype up to one rounding step (the Triton GEMM
sums in another order), the K rows pass the tolerance rule.

The ``check_*`` functions take a device and dtypes, so tests/test_context_kernels.py reuses them.
"""

import pytest
import torch

from tests.conftest import run_interpreted

import dflash_ops
from tests.test_triton_context_interp import (  # shared helpers: tolerance rule, tables, caches
    _backing, _cache_views as cache_views, _table, _tol_check,
    context_kv_rms_chain, rms_path, rms_token_scales)

OPS = torch.ops.dflash
INTERP_DTYPES = (torch.float16, torch.float32)
P = 40  # cos/sin table rows
EPS = 1e-6


def _rnd(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of x's dtype at |x| (as fp32), for 'equal up to one rounding'."""
    finfo = torch.finfo(x.dtype)
    xf = x.float().abs().clamp_min(finfo.tiny)
    return torch.exp2(torch.floor(torch.log2(xf))) * finfo.eps


# ------------------------------------------------------------------------------------ kv_proj
def check_kv_proj(device, dtypes=INTERP_DTYPES,
                  shapes=((1, 48, 40), (7, 128, 96), (33, 40, 200), (70, 64, 72), (5, 36, 48)),
                  strided=True, backend="triton", cfgs=(None,)):
    """kv_proj with ``backend`` forced (or, for each config in ``cfgs`` other than None, the
    Triton kernel with that launch config); H = 36 rows are not 16-byte aligned (no TMA)."""
    gen = torch.Generator().manual_seed(11)
    for dtype in dtypes:
        for t, h, n in shapes:
            for with_bias in (False, True):
                what = f"kv_proj {dtype} T={t} H={h} N={n} bias={with_bias}"
                scale = h ** -0.5
                x = _rnd(gen, t, h, dtype=dtype, device=device)
                if strided:  # x as a column slice of a wider buffer
                    x = torch.cat([x, _rnd(gen, t, 8, dtype=dtype, device=device)], 1)[:, :h]
                w = _rnd(gen, n, h, dtype=dtype, device=device, scale=scale)
                b = _rnd(gen, n, dtype=dtype, device=device) if with_bias else None
                with dflash_ops.use_backend("torch", ops=["kv_proj"]):  # the reference
                    ref = OPS.kv_proj(x, w, b)
                ref32 = torch.nn.functional.linear(x.float(), w.float(),
                                                   None if b is None else b.float())
                for cfg in cfgs:
                    if cfg is None:
                        with dflash_ops.use_backend(backend, ops=["kv_proj"]):
                            out = OPS.kv_proj(x, w, b)
                    else:
                        from dflash_ops.triton.context import kv_proj
                        out = kv_proj(x, w, b, cfg=cfg)
                    assert out.shape == (t, n) and out.dtype == dtype, f"{what} {cfg}"
                    # on CUDA cuBLAS's own rounding (its split-K may reduce in the dtype) joins
                    # the base: the default backend's kv_proj is cuBLAS above 32 rows
                    alt = (torch.nn.functional.linear(x, w, b),) if x.is_cuda else ()
                    _tol_check(out, ref, ref32, f"{what} {cfg}", alt)


# ------------------------------------------------------------------------------------ context_kv_
def _positions(t, gen, device):
    pos = torch.randint(0, P, (t,), generator=gen)
    bad = torch.tensor([-1, P, P + 100, 2**40])
    n = min(len(bad), t // 3)
    if n:
        pos[torch.randperm(t, generator=gen)[:n]] = bad[:n]
    return pos.to(device)


def _slots(t, n_slots, gen):
    """Distinct shuffled slots, with padding (-1) and out-of-range ones mixed in."""
    slots = torch.randperm(max(n_slots, t), generator=gen)[:t]
    slots[slots >= n_slots] = -1
    bad = torch.tensor([-1, n_slots, -1, n_slots + 7, 2**40, -(2**40)])
    n = min(len(bad), t // 3)
    slots[torch.randperm(t, generator=gen)[:n]] = bad[:n]
    return slots


def run_context_case(device, dtype, t, h, n_layers, hkv, d, r, neox, layout, with_bias,
                     hidden_norm, gen, nb=5, bs=4, strided_table=False, impl=None, backend="triton"):
    """One context_kv_ case, checked against the reference; returns nothing, raises on error.
    ``impl``: a function with the op's arguments run instead of the op with ``backend`` forced
    (e.g. the Triton kernel with a given launch config)."""
    what = (f"context_kv_ {dtype} T={t} H={h} L={n_layers} Hkv={hkv} D={d} R={r} neox={neox} "
            f"{layout} bias={with_bias} hidden_norm={hidden_norm}")
    n = n_layers * 2 * hkv * d
    x = _rnd(gen, t, h, dtype=dtype, device=device)
    if hidden_norm == "rms":  # rstd 2x apart from token to token
        x = (x.float() * rms_token_scales(t).to(device)).to(dtype)
    w = _rnd(gen, n, h, dtype=dtype, device=device, scale=h ** -0.5)
    b = _rnd(gen, n, dtype=dtype, device=device, scale=0.5) if with_bias else None
    kw = 1 + 0.1 * _rnd(gen, n_layers, d, dtype=dtype, device=device)
    hw = (1 + 0.1 * _rnd(gen, h, dtype=dtype, device=device)) if hidden_norm else None
    rms = hidden_norm == "rms"  # the norm's weight folded into w's columns, hidden_rms=True
    if rms:
        w = (w.float() * hw.float()[None, :]).to(dtype)
    pos = _positions(t, gen, device)
    cs = _table(r, device, strided_table)
    slots = _slots(t, nb * bs, gen).to(device)
    backing = _backing(layout, n_layers, nb, bs, hkv, d, dtype, device, gen)
    orig = [c.clone() for c in backing]
    want = [c.clone() for c in backing]
    want32 = [c.float() for c in backing]

    def args(bk, f32=False):
        cast = (lambda z: None if z is None else z.float()) if f32 else (lambda z: z)
        return (cast(x), cast(w), cast(b), cast(kw), pos, cs, slots,
                *cache_views(layout, bk, d), EPS, neox, None if rms else cast(hw), rms)

    with dflash_ops.use_backend("torch", ops=["context_kv_"]):
        OPS.context_kv_(*args(want))
        OPS.context_kv_(*args(want32, f32=True))
    alts = []  # hidden_rms: PyTorch at the kernel's rounding points too (the rule's base)
    path = rms_path(backend if impl is None else "triton", dtype, t)
    if rms and dtype != torch.float32:
        alts = [[c.clone() for c in backing]]
        context_kv_rms_chain(path, x, w, b, kw, pos, cs, slots,
                             *cache_views(layout, alts[0], d), EPS, neox)
    if impl is not None:
        impl(*args(backing))
    else:
        with dflash_ops.use_backend(backend, ops=["context_kv_"]):
            OPS.context_kv_(*args(backing))

    n_slots = nb * bs
    keep = (slots >= 0) & (slots < n_slots)
    kept = slots[keep]
    blk, row = kept // bs, kept % bs
    # untouched elements: bit for bit (mark written rows in a mask of each cache view)
    for i, (got, ref, o) in enumerate(zip(backing, want, orig)):
        assert not torch.isnan(got).any(), f"{what}: NaN in backing tensor {i}"
        written = torch.zeros_like(got, dtype=torch.bool)
        for view in (cache_views(layout, [written] * (2 if layout == "separate" else 1), d)):
            for c in view:
                c[blk, row] = True
        assert torch.equal(got[~written], o[~written]), f"{what}: untouched element changed ({i})"
        assert torch.equal(ref[~written], o[~written]), f"{what}: reference touched too much"
    if not bool(keep.any()):
        return
    kc, vc = cache_views(layout, backing, d)
    kr, vr = cache_views(layout, want, d)
    kr32, vr32 = cache_views(layout, want32, d)
    alt_views = [cache_views(layout, a, d) for a in alts]
    for layer in range(n_layers):
        g_k, r_k, r32_k = kc[layer][blk, row], kr[layer][blk, row], kr32[layer][blk, row]
        g_v, r_v, r32_v = vc[layer][blk, row], vr[layer][blk, row], vr32[layer][blk, row]
        _tol_check(g_k, r_k, r32_k, f"{what} K layer {layer}",
                   [a[0][layer][blk, row] for a in alt_views])
        _tol_check(g_v, r_v, r32_v, f"{what} V layer {layer}",
                   [a[1][layer][blk, row] for a in alt_views])
        if alts and path == "fused":
            # V = T(T(GEMM) * rstd + bias) on both sides: within 2 ulps (the GEMMs' summation
            # orders may round T(GEMM) one ulp apart), plus 1e-4 of the row scale for values
            # near a cancellation (the fp32 sums differ by ~1e-6 absolute there: CUDA's fused
            # kernel sums in another order than cuBLAS); far below a wrong rstd
            # With a bias the one-ulp step of T(GEMM) * rstd is the ulp of V - bias, which is
            # larger than V's own where the bias cancels part of it (seen on the H100: T 16,
            # a 4-ulp difference at |V| ~0.7); the ulps are taken at the larger of the two
            a_v = alt_views[0][1][layer][blk, row]
            diff = (g_v.float() - a_v.float()).abs()
            slack = 1e-4 * max(1.0, a_v.float().abs().max().item())
            step = _ulp(a_v)
            if b is not None:
                v0 = layer * 2 * hkv * d + hkv * d
                pre = (a_v.float() - b[v0:v0 + hkv * d].float().view(hkv, d)).to(dtype)
                step = torch.maximum(step, _ulp(pre))
            assert bool((diff <= 2.01 * step + slack).all()), \
                f"{what}: V layer {layer} > 2 ulps from the fused chain (max {diff.max():.3e})"
        if not hidden_norm and dtype != torch.float32:
            # V = round(fp32 GEMM): within one rounding step of the reference (plus the fp32
            # summation-order difference, far below a 16-bit ulp)
            diff = (g_v.float() - r_v.float()).abs()
            slack = 1e-4 * max(1.0, r32_v.abs().max().item())
            assert bool((diff <= _ulp(r_v) * 1.01 + slack).all()), f"{what}: V off by > 1 ulp"


CONTEXT_CASES = [
    # (t, h, L, Hkv, D, R, neox, layout, bias, hidden_norm: False, True or "rms", the norm's
    # weight folded into w and hidden_rms=True)
    (1, 32, 2, 1, 64, 64, True, "separate", False, False),
    (7, 48, 1, 2, 128, 128, False, "nhd2", True, False),
    (13, 40, 2, 1, 64, 32, True, "nhd2", False, True),
    (9, 64, 1, 1, 128, 96, True, "separate", True, True),   # R not a power of two (gather)
    (6, 32, 1, 2, 64, 48, False, "hnd2d", False, False),
    (33, 32, 1, 1, 64, 64, False, "separate", False, True),
    (5, 128, 3, 2, 128, 128, True, "hnd2d", True, False),
    (4, 16, 1, 1, 256, 128, False, "nhd2", False, True),
    (16, 32, 2, 1, 64, 16, True, "nhd2", True, False),
    (130, 32, 1, 1, 64, 64, True, "separate", False, False),  # two row tiles of 128
    (5, 32, 2, 2, 16, 2, True, "nhd2", True, False),  # D 16, R 2
    (3, 32, 1, 1, 32, 6, True, "separate", False, False),  # gather with a tiny R
    (6, 36, 2, 1, 64, 64, True, "nhd2", False, True),  # rows not 16-byte aligned: no TMA
    (7, 48, 1, 2, 128, 128, False, "nhd2", True, "rms"),
    (13, 40, 2, 1, 64, 32, True, "separate", False, "rms"),
]


def check_context_variants(device, dtypes=(torch.float16,)):
    """The Triton launch variants the default configs may not reach at small sizes: pointer
    loads vs TMA, the split path (kv_proj, then the epilogue alone) vs one fused kernel, each on
    a few cases."""
    from dflash_ops.triton import context as tc
    gen = torch.Generator().manual_seed(14)
    for dtype in dtypes:
        for tma, split in ((False, False), (False, True), (True, True), (True, False)):
            for (t, h, n_layers, hkv, d, r, neox, layout, bias, hn) in CONTEXT_CASES[1:4]:
                cfg = tc.context_config(t, d, 2)._replace(tma=tma, split=split)

                def impl(*a, cfg=cfg):
                    tc.context_kv_(*a, cfg=cfg)
                run_context_case(device, dtype, t, h, n_layers, hkv, d, r, neox, layout,
                                 bias, hn, gen, impl=impl)


def check_kv_proj_variants(device):
    from dflash_ops.triton import context as tc
    cfgs = [tc.ProjCfg(16, 32, 32, 8, 4, 2, False), tc.ProjCfg(32, 64, 64, 4, 4, 3, True),
            tc.ProjCfg(64, 128, 32, 1, 8, 2, True), tc.ProjCfg(16, 16, 32, 2, 4, 2, True, True),
            tc.ProjCfg(16, 32, 16, 8, 4, 2, False, True)]
    check_kv_proj(device, (torch.float16,), shapes=((7, 128, 96), (70, 64, 200)), cfgs=cfgs)


def check_kv_proj_split(device):
    """The split-K kernel (ProjCfg.split > 1): slices of whole BLOCK_K steps, empty trailing
    slices (split 5 over two K steps), H not a multiple of BLOCK_K and not 16-byte aligned
    (pointer loads), several M / N tiles, bias; every tile's counter back at zero after each
    call (a counter left behind would leave the next call's tile unwritten)."""
    from dflash_ops.triton import context as tc
    cfgs = [tc.ProjCfg(16, 32, 32, 8, 4, 2, True, False, 2),
            tc.ProjCfg(16, 16, 32, 2, 4, 2, False, False, 3),
            tc.ProjCfg(32, 64, 16, 4, 4, 3, True, False, 5)]
    serial = [c._replace(serial=True) for c in cfgs] + [
        tc.ProjCfg(16, 32, 32, 8, 4, 2, False, False, 1, True)]
    shapes = ((7, 128, 96), (40, 64, 200), (3, 36, 48))
    check_kv_proj(device, (torch.float16, torch.float32), shapes=shapes, cfgs=cfgs + serial)
    for buf in tc._COUNTERS.values():
        assert int(buf.abs().sum()) == 0, "split-K counters not reset"
    # serial (a program a tile walks its slices) gives the parallel launch's bits: exact mode
    # picks either by M, so a row's result must not depend on the pick
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float16, torch.float32):
        for t, h, n in shapes:
            x = torch.randn(t, h, generator=gen).to(dtype).to(device)
            w = (torch.randn(n, h, generator=gen) * h ** -0.5).to(dtype).to(device)
            b = torch.randn(n, generator=gen).to(dtype).to(device)
            for cfg in cfgs:
                outs = []
                for ser in (False, True):
                    out = torch.full((t, n), float("nan"), dtype=dtype, device=device)
                    tc.launch_proj(x, w, b, out, cfg._replace(serial=ser))
                    outs.append(out)
                assert torch.equal(outs[0], outs[1]), (dtype, t, h, n, cfg)
    # a larger call grows the counters; the old buffer stays alive (graphs keep its address)
    old = tc._tile_counters(torch.device(device), 1)
    tc._tile_counters(torch.device(device), old.numel() + 1)
    assert any(r is old for r in tc._RETIRED)


def check_context_kv_huge_slots(device, dtype=torch.float16, d=64, hkv=2, n_layers=2, h=32,
                                backend="triton"):
    """num_blocks * block_size >= 2^31 (64-bit slot math) without the memory: caches whose
    block stride is 0 (every block aliases block 0), so slot s lands on row s % block_size; the
    expected result is the reference on a one-block cache with slots s % block_size."""
    gen = torch.Generator().manual_seed(13)
    nb, bs = 2**30, 16
    slots = torch.tensor([2**31 + 3, -1, 5 * 2**31 + 7, nb * bs, 2**33 + 12, nb * bs - 1])
    t = len(slots)
    small = torch.where((slots >= 0) & (slots < nb * bs), slots % bs, -1).to(device)
    n = n_layers * 2 * hkv * d
    x = _rnd(gen, t, h, dtype=dtype, device=device)
    w = _rnd(gen, n, h, dtype=dtype, device=device, scale=h ** -0.5)
    kw = 1 + 0.1 * _rnd(gen, n_layers, d, dtype=dtype, device=device)
    pos = _positions(t, gen, device)
    cs = _table(d, device)
    base = [_rnd(gen, 2, 1, bs, hkv, d, dtype=dtype, device=device) for _ in range(n_layers)]
    want = [b.clone() for b in base]
    with dflash_ops.use_backend("torch", ops=["context_kv_"]):
        OPS.context_kv_(x, w, None, kw, pos, cs, small, [b[0] for b in want],
                        [b[1] for b in want], EPS, True)
    kc = [b[0].expand(nb, bs, hkv, d) for b in base]
    vc = [b[1].expand(nb, bs, hkv, d) for b in base]
    with dflash_ops.use_backend(backend, ops=["context_kv_"]):
        OPS.context_kv_(x, w, None, kw, pos, cs, slots.to(device), kc, vc, EPS, True)
    for layer in range(n_layers):
        assert not torch.isnan(base[layer]).any(), f"huge-slot context_kv_ layer {layer}: NaN"
        diff = (base[layer].float() - want[layer].float()).abs().max().item()
        tol = 4 * torch.finfo(dtype).eps * max(1.0, want[layer].abs().max().item())
        assert diff <= tol, f"huge-slot context_kv_ layer {layer}: max err {diff:.3e} > {tol:.1e}"



def check_context_kv_col_major(device, dtype=torch.float32, t=13, h=40, n_layers=2, hkv=1,
                               d=64):
    """The Triton context_kv_ on a column-major x [T, H] (unit stride along T), with and
    without the hidden norm, against the reference on the same x (fp32: within 1e-4)."""
    from dflash_ops.ops.context import context_kv_ref
    from dflash_ops.triton.context import context_kv_
    gen = torch.Generator().manual_seed(15)
    x = _rnd(gen, t, h, dtype=dtype, device=device).t().contiguous().t()
    w = _rnd(gen, n_layers * 2 * hkv * d, h, dtype=dtype, device=device, scale=h ** -0.5)
    kw = 1 + 0.1 * _rnd(gen, n_layers, d, dtype=dtype, device=device)
    hw = 1 + 0.1 * _rnd(gen, h, dtype=dtype, device=device)
    pos = torch.randint(0, 32, (t,), generator=gen).to(device)
    cs = dflash_ops.make_cos_sin_cache(d, 32, 10000.0).to(device)
    slots = torch.randperm(20, generator=gen)[:t].to(device)
    for hn in (None, hw):
        caches = [[torch.zeros(5, 4, hkv, d, dtype=dtype, device=device) for _ in range(n_layers)]
                  for _ in range(4)]
        context_kv_ref(x, w, None, kw, pos, cs, slots, caches[0], caches[1], EPS, True, hn)
        context_kv_(x, w, None, kw, pos, cs, slots, caches[2], caches[3], EPS, True, hn)
        err = max((a - b).abs().max().item() for a, b in zip(caches[2] + caches[3],
                                                              caches[0] + caches[1]))
        assert err < 1e-4, f"context_kv_ column-major x, hidden_norm={hn is not None}: {err:.3e}"


def check_context_kv(device, dtypes=INTERP_DTYPES, cases=CONTEXT_CASES):
    gen = torch.Generator().manual_seed(12)
    for dtype in dtypes:
        for i, (t, h, n_layers, hkv, d, r, neox, layout, bias, hn) in enumerate(cases):
            run_context_case(device, dtype, t, h, n_layers, hkv, d, r, neox, layout, bias, hn,
                             gen, strided_table=(i % 2 == 1))


# --------------------------------------------------------------------------------------------
_SCRIPT = r"""
import sys, torch, dflash_ops
import tests.test_triton_context_kv_interp as t
getattr(t, "check_" + sys.argv[1])("cpu")
if sys.argv[1] == "context_kv":
    t.check_context_kv_huge_slots("cpu")
    t.check_context_variants("cpu")
elif sys.argv[1] == "kv_proj":
    t.check_kv_proj_variants("cpu")
print("interp-ok")
"""


@pytest.mark.parametrize("what", ["kv_proj", "kv_proj_split", "context_kv"])
def test_triton_context_kv_interpreter_cpu(what):
    run_interpreted(_SCRIPT, what, timeout=600)


def test_triton_context_kv_column_major_x_interpreter_cpu():
    run_interpreted("import tests.test_triton_context_kv_interp as t\n"
                    "t.check_context_kv_col_major('cpu')\nprint('interp-ok')\n", timeout=300)
