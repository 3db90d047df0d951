"""The Triton rope_ / qk_norm_rope_ / knorm_rope_ / store_kv_ / qk_norm_rope_store_ kernels on CPU under
TRITON_INTERPRET=1 against the PyTorch reference (the default backend on CPU).

TRITON_INTERPRET must be set before triton is imported, so each test runs its checks in a
subprocess (repo root as cwd, no CUDA). fp16/fp32 only (bf16 is wrong in the interpreter).
Tolerance: a kernel's max error against an fp32 reference is at most 2x the error of
the reference run in the test dtype, plus a small atol; store_kv_ must be exact, and every element
outside what an op may write (the V part of a fused QKV buffer, kv[:, :, 1], untouched cache
slots) must keep its random value.

The ``check_*`` functions take a device and dtypes, so a GPU test can reuse them.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_interpreted

import dflash_ops
from dflash_ops.ops.rope import make_cos_sin_cache

OPS = torch.ops.dflash
INTERP_DTYPES = (torch.float16, torch.float32)
P = 40  # cos/sin table rows


def _tol_check(out, ref_dtype, ref_fp32, what, alt=()):
    """The tolerance rule; ``alt``: more PyTorch runs of the same math in the test dtype (other
    rounding points the kernels use): the base is the largest of their errors."""
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    if out.numel() == 0:
        return
    err = (out.float() - ref_fp32).abs().max().item()
    base = max((r.float() - ref_fp32).abs().max().item() for r in (ref_dtype, *alt))
    atol = 1e-5 * max(1.0, ref_fp32.abs().max().item())
    assert err <= 2 * base + atol, f"{what}: max err {err:.3e} > 2 * {base:.3e} + {atol:.1e}"


def rms_path(backend: str, dtype: torch.dtype, t: int) -> str:
    """Where hidden_rms rounds on ``backend``: "fused" (the CUDA epilogue at T <= 256 in bf16 /
    fp32: the GEMM, then T(kv * rstd + bias)) or "norm" (the norm pass of ones first: Triton,
    fp16, T > 256; T(T(x * rstd) @ w_kv^T + bias))."""
    return "fused" if backend == "cuda" and dtype != torch.float16 and t <= 256 else "norm"


def context_kv_rms_chain(path, x, w_kv, bias, k_weight, positions, cos_sin_cache,
                         slot_mapping, k_caches, v_caches, eps, is_neox):
    """context_kv_ with hidden_rms=True done in PyTorch in x's dtype at the rounding points of
    ``path`` (rms_path's), into (k_caches, v_caches). The reference op rounds once (fp32 GEMM,
    scale and bias), so its error alone understates what the same math costs in the dtype:
    the tolerance rule's base takes this run's error too (the kernels' path only)."""
    from dflash_ops.ops.kv import store_kv_ref
    from dflash_ops.ops.norm import rms_norm_ref
    from dflash_ops.ops.rope import rope_values
    t = x.shape[0]
    n_layers, (_, _, hkv, d) = len(k_caches), k_caches[0].shape
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) if x.shape[1] else \
        torch.full((t, 1), eps ** -0.5, device=x.device)
    bf = 0.0 if bias is None else bias.float()
    if path == "fused":
        kv = (F.linear(x, w_kv).float() * rstd + bf).to(x.dtype)
    else:
        kv = (F.linear((xf * rstd).to(x.dtype), w_kv).float() + bf).to(x.dtype)
    kv = kv.view(t, n_layers, 2, hkv, d)
    k = rope_values(rms_norm_ref(kv[:, :, 0], k_weight, eps), positions, cos_sin_cache, is_neox)
    store_kv_ref(k, kv[:, :, 1], k_caches, v_caches, slot_mapping)


def rms_token_scales(t: int) -> torch.Tensor:
    """[t, 1] factors 1/2, 1, 2, 4 by token (t mod 4) for hidden_rms tests' x rows: each token's
    rstd then differs by 2x or more from its neighbours', so a kernel that divides a row by
    another token's rms, or by a wrong one, is far outside the tolerance."""
    return torch.exp2(torch.arange(t) % 4 - 1.0)[:, None]


def _positions(t, device, gen, strided=False):
    """Random positions in [0, P) with out-of-range ones mixed in (when t allows)."""
    pos = torch.randint(0, P, (t,), generator=gen)
    bad = torch.tensor([-1, P, P + 100, 2**40, -(2**40)])
    n = min(len(bad), t // 3)
    if n:
        idx = torch.randperm(t, generator=gen)[:n]
        pos[idx] = bad[:n]
    if strided:  # a non-unit-stride view
        return torch.stack([pos, torch.zeros_like(pos)], 1).to(device)[:, 0]
    return pos.to(device)


def _table(r, device, strided=False):
    cs = make_cos_sin_cache(P, r, base=100.0, device="cpu")
    if strided:  # columns of a column-major wider table: strides (1, P)
        cs = torch.cat([cs, torch.full((P, 6), float("nan"))], 1).t().contiguous().t()[:, :r]
    return cs.to(device)


# (D, R, strided positions/table)
ROPE_DIMS = [(16, 16, False), (64, 32, True), (128, 128, False), (128, 96, False)]


def _rnd(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def check_rope(device, dtypes=INTERP_DTYPES):
    gen = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for d, r, strided in ROPE_DIMS + [(256, 256, False)]:
            for neox in (True, False):
                for t, h, fused in ((1, 3, False), (7, 4, True), (9, 1, False)):
                    what = f"rope_ {dtype} D={d} R={r} T={t} H={h} neox={neox} fused={fused}"
                    pos, cs = _positions(t, device, gen, strided), _table(r, device, strided)
                    if fused:  # q of a fused QKV output [T, (H + 2) * D]
                        buf = _rnd(gen, t, (h + 2) * d, dtype=dtype, device=device)
                        view = lambda b: b[:, :h * d].view(t, h, d)  # noqa: E731
                    else:
                        buf = _rnd(gen, t, h, d, dtype=dtype, device=device)
                        view = lambda b: b  # noqa: E731
                    ref, ref32 = buf.clone(), buf.float()
                    OPS.rope_(view(ref), pos, cs, neox)
                    OPS.rope_(view(ref32), pos, cs, neox)
                    with dflash_ops.use_backend("triton", ops=["rope_"]):
                        OPS.rope_(view(buf), pos, cs, neox)
                    if fused:
                        assert torch.equal(buf[:, h * d:], ref[:, h * d:]), f"{what}: K/V touched"
                    # dims R..D are not rotated: kept exactly
                    assert torch.equal(view(buf)[..., r:], view(ref)[..., r:]), f"{what}: tail"
                    _tol_check(view(buf), view(ref), view(ref32), what)


def check_qk_norm_rope(device, dtypes=INTERP_DTYPES):
    gen = torch.Generator().manual_seed(2)
    for dtype in dtypes:
        for d, r, strided in ROPE_DIMS:
            for neox in (True, False):
                for t, hq, hkv in ((1, 4, 1), (7, 8, 1), (5, 3, 3), (6, 4, 2)):
                    what = f"qk_norm_rope_ {dtype} D={d} R={r} T={t} Hq={hq} Hkv={hkv} neox={neox}"
                    pos, cs = _positions(t, device, gen, strided), _table(r, device, strided)
                    # q and k are strided views of a fused QKV output [T, (Hq + 2 Hkv) * D]
                    qkv = _rnd(gen, t, (hq + 2 * hkv) * d, dtype=dtype, device=device)
                    wq = 1 + 0.1 * _rnd(gen, d, dtype=dtype, device=device)
                    wk = 1 + 0.1 * _rnd(gen, d, dtype=dtype, device=device)

                    def views(b):
                        return (b[:, :hq * d].view(t, hq, d),
                                b[:, hq * d:(hq + hkv) * d].view(t, hkv, d))
                    ref, ref32 = qkv.clone(), qkv.float()
                    OPS.qk_norm_rope_(*views(ref), wq, wk, pos, cs, 1e-6, neox)
                    OPS.qk_norm_rope_(*views(ref32), wq.float(), wk.float(), pos, cs, 1e-6, neox)
                    with dflash_ops.use_backend("triton", ops=["qk_norm_rope_"]):
                        OPS.qk_norm_rope_(*views(qkv), wq, wk, pos, cs, 1e-6, neox)
                    v0 = (hq + hkv) * d
                    assert torch.equal(qkv[:, v0:], ref[:, v0:]), f"{what}: V touched"
                    for name, got, want, want32 in zip("qk", views(qkv), views(ref), views(ref32)):
                        _tol_check(got, want, want32, f"{what} {name}")


def check_knorm_rope(device, dtypes=INTERP_DTYPES):
    gen = torch.Generator().manual_seed(3)
    for dtype in dtypes:
        for d, r, strided in ROPE_DIMS:
            for neox in (True, False):
                for t, n_layers, hkv, gemm_view in ((1, 2, 2, True), (7, 3, 2, True),
                                                    (5, 2, 3, False)):
                    what = (f"knorm_rope_ {dtype} D={d} R={r} T={t} L={n_layers} Hkv={hkv} "
                            f"neox={neox} gemm_view={gemm_view}")
                    pos, cs = _positions(t, device, gen, strided), _table(r, device, strided)
                    w = 1 + 0.1 * _rnd(gen, n_layers, d, dtype=dtype, device=device)
                    if gemm_view:  # k = kv[:, :, 0] of the GEMM output [T, L, 2, Hkv, D]
                        buf = _rnd(gen, t, n_layers, 2, hkv, d, dtype=dtype, device=device)
                        view = lambda b: b[:, :, 0]  # noqa: E731
                    else:
                        buf = _rnd(gen, t, n_layers, hkv, d, dtype=dtype, device=device)
                        view = lambda b: b  # noqa: E731
                    ref, ref32 = buf.clone(), buf.float()
                    OPS.knorm_rope_(view(ref), w, pos, cs, 1e-6, neox)
                    OPS.knorm_rope_(view(ref32), w.float(), pos, cs, 1e-6, neox)
                    with dflash_ops.use_backend("triton", ops=["knorm_rope_"]):
                        OPS.knorm_rope_(view(buf), w, pos, cs, 1e-6, neox)
                    if gemm_view:
                        assert torch.equal(buf[:, :, 1], ref[:, :, 1]), f"{what}: V touched"
                    _tol_check(view(buf), view(ref), view(ref32), what)


def _cache_views(layout, backing, d):
    """(k_caches, v_caches): the per-layer [num_blocks, block_size, Hkv, D] views of backing."""
    if layout == "separate":  # 2L tensors [num_blocks, block_size, Hkv, D]: K's then V's
        n = len(backing) // 2
        return backing[:n], backing[n:]
    if layout == "nhd2":  # vLLM [num_blocks, 2, block_size, Hkv, D]
        return [x[:, 0] for x in backing], [x[:, 1] for x in backing]
    if layout == "hnd2d":  # vLLM >= 0.33 [num_blocks, Hkv, block_size, 2*D], K and V side by side
        return ([x[..., :d].permute(0, 2, 1, 3) for x in backing],
                [x[..., d:].permute(0, 2, 1, 3) for x in backing])
    raise ValueError(layout)


def _backing(layout, n_layers, nb, bs, hkv, d, dtype, device, gen):
    shape = {"separate": (nb, bs, hkv, d), "nhd2": (nb, 2, bs, hkv, d),
             "hnd2d": (nb, hkv, bs, 2 * d)}[layout]
    n = 2 * n_layers if layout == "separate" else n_layers
    return [_rnd(gen, *shape, dtype=dtype, device=device) for _ in range(n)]


def _slots(t, n_slots, gen):
    """Distinct shuffled slots, with padding (-1) and out-of-range ones mixed in."""
    slots = torch.randperm(n_slots, generator=gen)[:t]
    bad = torch.tensor([-1, n_slots, -1, n_slots + 7, 2**40, -(2**40)])
    n = min(len(bad), t // 3)
    slots[torch.randperm(t, generator=gen)[:n]] = bad[:n]
    return slots


def check_store_kv(device, dtypes=INTERP_DTYPES):
    gen = torch.Generator().manual_seed(4)
    for dtype in dtypes:
        for layout in ("separate", "nhd2", "hnd2d"):
            for t, n_layers, hkv, d, gemm_view in ((1, 2, 2, 16, False), (9, 3, 2, 64, True),
                                                   (13, 2, 3, 16, True), (5, 1, 1, 128, False)):
                what = f"store_kv_ {dtype} {layout} T={t} L={n_layers} Hkv={hkv} D={d}"
                nb, bs = 5, 4
                backing = _backing(layout, n_layers, nb, bs, hkv, d, dtype, device, gen)
                if gemm_view:  # k, v = kv[:, :, 0], kv[:, :, 1] of [T, L, 2, Hkv, D]
                    kv = _rnd(gen, t, n_layers, 2, hkv, d, dtype=dtype, device=device)
                    k, v = kv[:, :, 0], kv[:, :, 1]
                else:
                    k = _rnd(gen, t, n_layers, hkv, d, dtype=dtype, device=device)
                    v = _rnd(gen, t, n_layers, hkv, d, dtype=dtype, device=device)
                slots = _slots(t, nb * bs, gen).to(device)
                orig = [b.clone() for b in backing]
                want = [b.clone() for b in backing]
                OPS.store_kv_(k, v, *_cache_views(layout, want, d), slots)
                with dflash_ops.use_backend("triton", ops=["store_kv_"]):
                    OPS.store_kv_(k, v, *_cache_views(layout, backing, d), slots)
                for i, (got, ref) in enumerate(zip(backing, want)):
                    assert torch.equal(got, ref), f"{what}: backing tensor {i} differs"
                if bool(((slots >= 0) & (slots < nb * bs)).any()):
                    assert any(not torch.equal(a, b) for a, b in zip(want, orig)), \
                        f"{what}: nothing written"


def check_store_kv_table_cache(device):
    """The per-layer table is built once per set of caches (an LRU of bounded size)."""
    from dflash_ops.triton import kv as tkv
    gen = torch.Generator().manual_seed(5)
    k = _rnd(gen, 3, 2, 1, 16, dtype=torch.float32, device=device)
    slots = torch.tensor([0, 5, -1], device=device)
    backing = _backing("nhd2", 2, 2, 4, 1, 16, torch.float32, device, gen)
    tkv._TABLES.clear()
    with dflash_ops.use_backend("triton", ops=["store_kv_"]):
        OPS.store_kv_(k, k, *_cache_views("nhd2", backing, 16), slots)
        assert len(tkv._TABLES) == 1
        (table, _), = tkv._TABLES.values()
        OPS.store_kv_(k, k, *_cache_views("nhd2", backing, 16), slots)  # fresh views, same caches
        assert len(tkv._TABLES) == 1 and next(iter(tkv._TABLES.values()))[0] is table
        keep = []
        for _ in range(tkv._MAX_TABLES + 3):
            keep.append(_backing("separate", 2, 2, 4, 1, 16, torch.float32, device, gen))
            OPS.store_kv_(k, k, *_cache_views("separate", keep[-1], 16), slots)
        assert len(tkv._TABLES) == tkv._MAX_TABLES


def check_store_kv_huge_slots(device, dtype=torch.float16):
    """num_blocks * block_size >= 2^31 (the 64-bit slot path) without the memory: caches whose
    block stride is 0 (every block aliases one), so slot s lands on row s % block_size."""
    gen = torch.Generator().manual_seed(6)
    nb, bs, hkv, d, n_layers = 2**30, 16, 2, 16, 2
    # base[l][0] backs every block of layer l's K cache, base[l][1] every block of its V cache
    base = [_rnd(gen, 2, bs, hkv, d, dtype=dtype, device=device) for _ in range(n_layers)]
    kc = [b[0].expand(nb, bs, hkv, d) for b in base]
    vc = [b[1].expand(nb, bs, hkv, d) for b in base]
    slots = torch.tensor([2**31 + 3, -1, 5 * 2**31 + 7, nb * bs, 2**33 + 12, nb * bs - 1])
    t = len(slots)
    k = _rnd(gen, t, n_layers, hkv, d, dtype=dtype, device=device)
    v = _rnd(gen, t, n_layers, hkv, d, dtype=dtype, device=device)
    want = [b.clone() for b in base]
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < nb * bs:
            for layer in range(n_layers):
                want[layer][0, s % bs] = k[i, layer]
                want[layer][1, s % bs] = v[i, layer]
    with dflash_ops.use_backend("triton", ops=["store_kv_"]):
        OPS.store_kv_(k, v, kc, vc, slots.to(device))
    for layer in range(n_layers):
        assert torch.equal(base[layer], want[layer]), f"huge-slot store_kv_: layer {layer}"


def check_all(device, dtypes=INTERP_DTYPES):
    check_rope(device, dtypes)
    check_qk_norm_rope(device, dtypes)
    check_knorm_rope(device, dtypes)
    check_store_kv(device, dtypes)


# --------------------------------------------------------------------------------------------
# The interpreter runs (each a subprocess: TRITON_INTERPRET=1 before triton is imported)
# --------------------------------------------------------------------------------------------
_SCRIPT = r"""
import sys, torch, dflash_ops
import tests.test_triton_context_interp as t
from dflash_ops.triton import kv as tkv, rope as trope
what = sys.argv[1]
if what == "index64":  # the 64-bit offset variants of every kernel, on the same cases
    trope._INDEX_32_MAX = tkv._INDEX_32_MAX = 0
    t.check_all("cpu", [torch.float16])
elif what == "qk_norm_rope_store_":  # the GPU test's cases in fp16 / fp32, T <= 257
    import tests.test_kv_kernels as tk, tests.test_rope_kernels as tr
    import tests.test_qk_norm_rope_store_kernels as tq
    tr.DEV = tk.DEV = tq.DEV = "cpu"
    for c in tq.CASES:
        if c[0] <= 257 and c[6] != torch.bfloat16:
            tq.test_qk_norm_rope_store("triton", *c)
    tq.test_huge_slot_numbers("triton")
    trope._INDEX_32_MAX = 0  # the 64-bit offset variant
    tq.test_qk_norm_rope_store("triton", *tq.CASES[1])
elif what == "store_kv_":
    t.check_store_kv("cpu")
    t.check_store_kv_table_cache("cpu")
    t.check_store_kv_huge_slots("cpu")
else:
    getattr(t, "check_" + what)("cpu")
print("interp-ok")
"""


@pytest.mark.parametrize("what", ["rope", "qk_norm_rope", "knorm_rope", "store_kv_",
                                  "qk_norm_rope_store_", "index64"])
def test_triton_context_interpreter_cpu(what):
    run_interpreted(_SCRIPT, what, timeout=600)
