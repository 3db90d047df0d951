"""The CUDA and Triton kernels of the rope family, ``rope_``, ``qk_norm_rope_`` and
``knorm_rope_``, against the PyTorch reference on the GPU (the shared GPU test helpers live here;
tests/test_kv_kernels.py uses them for ``store_kv_``).

Every test is ``@pytest.mark.gpu`` and parametrised over backend in (cuda, triton); a backend
that has no kernel for the op (``dispatch.has_backend``) is skipped with the reason, so the file
runs whichever kernels exist. The reference runs on clones of the same inputs under
``use_backend("torch", ops=[op])``; the fp32 reference on fp32 copies of them.

Grid (each value covered, not the cartesian product): T 1/7/16/257/4096, L 1/5/8, Hkv 1/4/8,
Hq/Hkv 1/4/8, D 64/128/256, NeoX and GPT-J, full and partial rotary (R = D/2, once D/4), bf16/fp16
and a few fp32. Layouts: q/k slices of a fused QKV buffer, k = kv[:, :, 0] of [T, L, 2, Hkv, D],
rows with a padded head stride, contiguous tensors. Each in-place tensor is a view into a larger
buffer: everything outside the view (NaN guards and the QKV buffer's other parts; kv[:, :, 1]
holds random values) must come back bit for bit, and a NaN in the output means the kernel read
outside its view. Positions include -1, P (one past the table), P + 1000, and values that wrap
to valid ones when truncated to 32 bits; such tokens stay unrotated (still normed for the norm ops).

Tolerance: max |kernel - fp32 reference| <= 2 x max |torch reference in the test dtype
- fp32 reference| + atol, atol = max(eps(dtype) / 4, 1e-5) x max(1, max |fp32 reference|); and the
mean error at most 1.25x the torch reference's (the max rule alone passes rotation done in bf16).
``slow``: the > 2^31-element tests (4-18 GB), left out of compute-sanitizer runs with
``-m "gpu and not slow"``.
"""
from __future__ import annotations

import pytest
import torch

import dflash_ops
from dflash_ops import dispatch
from dflash_ops.ops.rope import make_cos_sin_cache
from tests import test_opcheck as opcheck_cases

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ("cuda", "triton")
ROPE_OPS = ("rope_", "qk_norm_rope_", "knorm_rope_")
DEV = "cuda"
EPS = 1e-6
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
GUARD = 256  # NaN elements either side of a contiguous tensor (keeps 16-byte alignment)
NAN = float("nan")
BIG = 2**31  # element offsets past this overflow int32 (the slow tests cross it, and 2 * BIG)
ATOL_EPS = 0.25  # atol = max(ATOL_EPS * eps(dtype), 1e-5) * max(1, max |fp32 reference|)
MEAN_RATIO = 1.25  # mean |error| at most this x the torch reference's (see _check_close)


# ------------------------------------------------------------------------------------ helpers
def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace(
        "float16", "fp16").replace("float32", "fp32")


def _need(op: str, backend: str) -> None:
    if not dispatch.has_backend(op, backend):
        pytest.skip(f"no {backend} kernel for {op} (available: {dispatch.available_backends(op)})")


def _run(op: str, backend: str, *args) -> None:
    with dflash_ops.use_backend(backend, ops=[op]):
        getattr(torch.ops.dflash, op).default(*args)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers, for bit-exact comparison (NaN payloads included)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _rand(shape, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEV) * scale).to(dtype)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy (``t.float()`` returns t itself when t is already fp32)."""
    return t.to(torch.float32, copy=True)


def _weight(shape, dtype) -> torch.Tensor:
    return (1.0 + 0.5 * torch.randn(shape, device=DEV)).to(dtype)


def _check_close(out, ref_d, ref32, what: str) -> None:
    """The 2x rule: error vs fp32 <= 2x the torch reference's error in out's dtype + atol."""
    out_f = out.float()
    n_nan = int(torch.isnan(out_f).sum())
    assert n_nan == 0, f"{what}: {n_nan} NaN in the output (read outside the view?)"
    diff = (out_f - ref32).abs()
    err = diff.max().item()
    base = (ref_d.float() - ref32).abs().max().item()
    amax = max(1.0, ref32.abs().max().item())
    atol = max(ATOL_EPS * torch.finfo(out.dtype).eps, 1e-5) * amax
    if not err <= 2 * base + atol:
        where = [int(i) for i in torch.unravel_index(diff.flatten().argmax(), diff.shape)]
        raise AssertionError(
            f"{what}: max err {err:.3e} at {where} (got {out_f[tuple(where)].item():.6g}, fp32 "
            f"ref {ref32[tuple(where)].item():.6g}) > 2 * {base:.3e} + {atol:.1e}")
    # The max rule lets arithmetic in the storage dtype through (~1 ulp against 2 x 0.5 ulp); the
    # mean error shows it (bf16 rotation: 1.4-1.7x the reference's mean; round-toward-zero
    # conversions, as in the Triton CPU interpreter: 2x; fp32 math: 0.6-1.0x).
    if out.dtype == torch.float32:
        return  # the torch reference is the fp32 reference: no rounding error to compare with
    mean, mean_base = diff.mean().item(), (ref_d.float() - ref32).abs().mean().item()
    assert mean <= MEAN_RATIO * mean_base + 1e-3 * atol, \
        f"{what}: mean err {mean:.3e} > {MEAN_RATIO} x the torch reference's {mean_base:.3e} " \
        f"(arithmetic in {_dt(out.dtype)} instead of fp32, or truncating conversions?)"


class Embedded:
    """Views ``make(buf)`` of one buffer ("nan" or "random" background); whatever lies outside
    the views must be bit-identical after the op (``check``)."""

    def __init__(self, shape, dtype, makes, background: str = "nan"):
        self.buf = (torch.full(shape, NAN, dtype=dtype, device=DEV) if background == "nan"
                    else _rand(shape, dtype))
        self.views = [m(self.buf) for m in makes]
        inside = torch.zeros(shape, dtype=torch.bool, device=DEV)
        for m in makes:
            m(inside).fill_(True)
        self.outside = ~inside

    def fill(self, scale: float = 1.0):
        for v in self.views:
            v.copy_(_rand(v.shape, v.dtype, scale))
        self.background = _bits(self.buf)[self.outside].clone()
        return self.views

    def check(self, what: str) -> None:
        bad = int((_bits(self.buf)[self.outside] != self.background).sum())
        assert bad == 0, f"{what}: {bad} elements outside the op's tensors were written"


def _flat(shape, offset: int = GUARD):
    """A contiguous ``shape`` at ``offset`` of a flat buffer."""
    n = 1
    for s in shape:
        n *= s
    return lambda b: b[offset:offset + n].view(*shape)


def _heads_layout(layout: str, t: int, h: int, d: int):
    """(buffer shape, make) for x[T, H, D]."""
    if layout == "contig":
        return (GUARD + t * h * d + GUARD,), _flat((t, h, d))
    if layout == "qkv_q":  # q of a fused [T, (H + 2*Hk) * D] QKV output
        hk = max(1, h // 4)
        return (t, (h + 2 * hk) * d), lambda b: b.view(t, h + 2 * hk, d)[:, :h]
    if layout == "qkv_k":  # k of a fused QKV output with Hq = 2H
        return (t, 4 * h * d), lambda b: b.view(t, 4 * h, d)[:, 2 * h:3 * h]
    if layout == "padded":  # head stride D + 32: rows of a wider buffer
        return (t, h, d + 32), lambda b: b[..., :d]
    raise ValueError(layout)


_BAD_POS = (-1, "P", 2**32 + 1, "P+1000", -(2**32) + 3, 2**40)  # 2^32+1 -> 1, -(2^32)+3 -> 3 in int32


def _positions(t: int, p: int, oob: bool) -> torch.Tensor:
    pos = torch.randint(0, p, (t,), dtype=torch.int64)
    if oob:
        n = 1 if t == 1 else min(t // 2, max(2, t // 8))
        idx = torch.randperm(t)[:n]
        vals = [p if v == "P" else p + 1000 if v == "P+1000" else v for v in _BAD_POS]
        if t == 1:
            vals = [p]  # the off-by-one; -1 is covered from T = 7 on
        pos[idx] = torch.tensor([vals[i % len(vals)] for i in range(n)], dtype=torch.int64)
    return pos.to(DEV)


def _table(t: int, r: int, oob: bool):
    p = max(t, 16) + 37
    return _positions(t, p, oob), make_cos_sin_cache(p, r, device=DEV), p


def _case_id(**kw) -> str:
    out = []
    for k, v in kw.items():
        if isinstance(v, torch.dtype):
            out.append(_dt(v))
        elif isinstance(v, bool):
            out.append({"neox": "neox" if v else "gptj", "oob": "oob" if v else ""}[k])
        elif isinstance(v, str):
            out.append(v)
        else:
            out.append(f"{k}{v}")
    return "-".join(x for x in out if x)


# ------------------------------------------------------------------------------------ rope_
# T, H, D, R, neox, dtype, layout, oob
ROPE_CASES = [
    (1, 1, 64, 64, True, BF16, "contig", False),
    (1, 8, 128, 128, False, FP16, "qkv_q", True),
    (7, 4, 128, 64, True, BF16, "qkv_k", True),
    (7, 1, 256, 256, False, BF16, "padded", True),
    (7, 32, 128, 128, True, BF16, "qkv_q", True),
    (16, 8, 64, 32, False, BF16, "contig", True),
    (16, 4, 256, 128, True, FP16, "qkv_q", False),
    (257, 8, 128, 128, True, BF16, "qkv_q", True),
    (257, 4, 64, 64, False, FP32, "contig", True),
    (257, 1, 128, 64, False, FP16, "padded", True),
    (4096, 8, 128, 128, True, BF16, "qkv_k", True),
    (4096, 4, 256, 256, False, BF16, "contig", True),
    (4096, 1, 64, 32, True, FP32, "qkv_q", True),
]


def _rope_params():
    return [pytest.param(*c, id=_case_id(T=c[0], H=c[1], D=c[2], R=c[3], neox=c[4], dtype=c[5],
                                         layout=c[6], oob=c[7])) for c in ROPE_CASES]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("t, h, d, r, neox, dtype, layout, oob", _rope_params())
def test_rope(backend, t, h, d, r, neox, dtype, layout, oob):
    op = "rope_"
    _need(op, backend)
    what = f"{backend} {op} T={t} H={h} D={d} R={r} {'neox' if neox else 'gptj'} {_dt(dtype)} {layout}"
    shape, make = _heads_layout(layout, t, h, d)
    emb = Embedded(shape, dtype, [make])
    (x,) = emb.fill(scale=2.0)
    pos, cache, p = _table(t, r, oob)
    x0, ref_d, ref32 = x.clone(), x.clone(), _f32(x)
    _run(op, "torch", ref_d, pos, cache, neox)
    _run(op, "torch", ref32, pos, cache, neox)
    _run(op, backend, x, pos, cache, neox)
    _check_close(x, ref_d, ref32, what)
    emb.check(what)
    bad = (pos < 0) | (pos >= p)
    assert torch.equal(_bits(x[bad]), _bits(x0[bad])), \
        f"{what}: a token at an out-of-range position was changed (must stay unrotated)"
    if r < d:
        assert torch.equal(_bits(x[..., r:]), _bits(x0[..., r:])), \
            f"{what}: dims R..D (past the rotary part) were changed"


# ------------------------------------------------------------------------------------ qk_norm_rope_
# T, Hq, Hkv, D, R, neox, dtype, layout, oob
QK_CASES = [
    (1, 1, 1, 64, 64, True, BF16, "qkv", False),
    (1, 32, 8, 128, 128, True, BF16, "qkv", True),
    (7, 16, 4, 128, 128, False, FP16, "qkv", True),
    (7, 8, 1, 256, 128, True, BF16, "separate", True),
    (16, 32, 4, 64, 64, True, BF16, "qkv", False),
    (16, 4, 4, 256, 256, False, FP32, "qkv", True),
    (257, 32, 8, 128, 64, False, BF16, "qkv", True),
    (257, 8, 8, 64, 64, True, FP16, "separate", True),
    (257, 8, 1, 128, 128, True, BF16, "padded", True),
    (4096, 32, 8, 128, 128, True, BF16, "qkv", True),
    (4096, 16, 4, 64, 32, True, FP32, "qkv", True),
    (4096, 8, 8, 256, 256, False, FP16, "qkv", True),
]


def _qk_layout(layout: str, t: int, hq: int, hkv: int, d: int):
    if layout == "qkv":  # q and k slices of a fused [T, (Hq + 2*Hkv) * D] QKV output (V: NaN)
        h = hq + 2 * hkv
        return (t, h * d), [lambda b: b.view(t, h, d)[:, :hq],
                            lambda b: b.view(t, h, d)[:, hq:hq + hkv]]
    if layout == "separate":  # two contiguous tensors with NaN guards
        nq = t * hq * d
        return (GUARD + nq + GUARD + t * hkv * d + GUARD,), [
            _flat((t, hq, d)), _flat((t, hkv, d), offset=2 * GUARD + nq)]
    if layout == "padded":  # head stride D + 32 in q and k
        return (t, hq + hkv, d + 32), [lambda b: b[:, :hq, :d], lambda b: b[:, hq:, :d]]
    raise ValueError(layout)


def _qk_params():
    return [pytest.param(*c, id=_case_id(T=c[0], Hq=c[1], Hkv=c[2], D=c[3], R=c[4], neox=c[5],
                                         dtype=c[6], layout=c[7], oob=c[8])) for c in QK_CASES]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("t, hq, hkv, d, r, neox, dtype, layout, oob", _qk_params())
def test_qk_norm_rope(backend, t, hq, hkv, d, r, neox, dtype, layout, oob):
    op = "qk_norm_rope_"
    _need(op, backend)
    what = (f"{backend} {op} T={t} Hq={hq} Hkv={hkv} D={d} R={r} {'neox' if neox else 'gptj'} "
            f"{_dt(dtype)} {layout}")
    shape, makes = _qk_layout(layout, t, hq, hkv, d)
    emb = Embedded(shape, dtype, makes)
    q, k = emb.fill(scale=3.0)
    wq, wk = _weight(d, dtype), _weight(d, dtype)
    pos, cache, _ = _table(t, r, oob)
    qd, kd, q32, k32 = q.clone(), k.clone(), _f32(q), _f32(k)
    _run(op, "torch", qd, kd, wq, wk, pos, cache, EPS, neox)
    _run(op, "torch", q32, k32, wq.float(), wk.float(), pos, cache, EPS, neox)
    _run(op, backend, q, k, wq, wk, pos, cache, EPS, neox)
    _check_close(q, qd, q32, what + " (q)")
    _check_close(k, kd, k32, what + " (k)")
    emb.check(what)


# ------------------------------------------------------------------------------------ knorm_rope_
# T, L, Hkv, D, R, neox, dtype, layout, oob
KNORM_CASES = [
    (1, 1, 1, 64, 64, True, BF16, "kv0", False),
    (1, 5, 8, 128, 128, True, BF16, "kv0", True),
    (7, 8, 8, 64, 64, False, FP16, "kv0", True),
    (7, 5, 4, 256, 128, True, BF16, "padded", True),
    (16, 5, 8, 128, 64, False, BF16, "kv0", True),
    (16, 1, 4, 128, 128, True, FP32, "contig", True),
    (257, 8, 1, 256, 256, True, FP16, "kv0", True),
    (257, 5, 8, 128, 128, True, BF16, "contig", True),
    (257, 1, 8, 64, 32, False, FP32, "kv0", False),
    (4096, 5, 8, 128, 128, True, BF16, "kv0", True),
    (4096, 8, 8, 64, 64, False, BF16, "kv0", True),
    (4096, 8, 4, 256, 128, False, FP16, "padded", True),
]


def _knorm_layout(layout: str, t: int, n_layers: int, hkv: int, d: int):
    """(buffer shape, make, background) for k[T, L, Hkv, D]."""
    if layout == "kv0":  # the K half of the K/V GEMM output [T, L, 2, Hkv, D]; V: random values
        return (t, n_layers, 2, hkv, d), lambda b: b[:, :, 0], "random"
    if layout == "contig":
        return (GUARD + t * n_layers * hkv * d + GUARD,), _flat((t, n_layers, hkv, d)), "nan"
    if layout == "padded":
        return (t, n_layers, hkv, d + 32), lambda b: b[..., :d], "nan"
    raise ValueError(layout)


def _knorm_params():
    return [pytest.param(*c, id=_case_id(T=c[0], L=c[1], Hkv=c[2], D=c[3], R=c[4], neox=c[5],
                                         dtype=c[6], layout=c[7], oob=c[8])) for c in KNORM_CASES]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("t, n_layers, hkv, d, r, neox, dtype, layout, oob", _knorm_params())
def test_knorm_rope(backend, t, n_layers, hkv, d, r, neox, dtype, layout, oob):
    op = "knorm_rope_"
    _need(op, backend)
    what = (f"{backend} {op} T={t} L={n_layers} Hkv={hkv} D={d} R={r} "
            f"{'neox' if neox else 'gptj'} {_dt(dtype)} {layout}")
    shape, make, background = _knorm_layout(layout, t, n_layers, hkv, d)
    emb = Embedded(shape, dtype, [make], background)
    (k,) = emb.fill(scale=3.0)
    w = _weight((n_layers, d), dtype)
    pos, cache, _ = _table(t, r, oob)
    kd, k32 = k.clone(), _f32(k)
    _run(op, "torch", kd, w, pos, cache, EPS, neox)
    _run(op, "torch", k32, w.float(), pos, cache, EPS, neox)
    _run(op, backend, k, w, pos, cache, EPS, neox)
    _check_close(k, kd, k32, what)
    emb.check(what + (" (kv[:, :, 1] must stay bit-exact)" if layout == "kv0" else ""))


# ------------------------------------------------------------------------------------ > 2^31 elements
def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("op", ROPE_OPS)
def test_rope_ops_int64_offsets(backend, op):
    """The in-place tensor is a view into a > 2^31-element bf16 buffer (~4.5 GB); tokens at the
    start, around the 2^31 boundary and at the end are checked against the reference."""
    _need(op, backend)
    hq, hkv, n_layers, d, p = 32, 8, 5, 128, 4096
    per_tok = n_layers * 2 * hkv * d if op == "knorm_rope_" else (hq + 2 * hkv) * d
    t = BIG // per_tok + 4096
    if _free_bytes() < t * per_tok * 2 + (4 << 30):
        pytest.skip(f"needs {t * per_tok * 2 / 2**30:.1f} GiB of free GPU memory")
    what = f"{backend} {op} int64 offsets T={t}"
    buf = torch.randn(t, per_tok, dtype=BF16, device=DEV)
    tb = BIG // per_tok  # the token whose row crosses element offset 2^31
    sel = torch.cat([torch.arange(64), torch.arange(tb - 3, tb + 4), torch.arange(t - 256, t)])
    sel = sel.to(DEV)
    pos = torch.randint(0, p, (t,), device=DEV)
    pos[sel[::9]] = -1
    pos[sel[1::9]] = p
    cache = make_cos_sin_cache(p, d, device=DEV)
    if op == "knorm_rope_":
        kv = buf.view(t, n_layers, 2, hkv, d)
        xs, w = [kv[:, :, 0]], [_weight((n_layers, d), BF16)]
        args = lambda ts, ws, ps: (ts[0], ws[0], ps, cache, EPS, True)  # noqa: E731
    else:
        qkv = buf.view(t, hq + 2 * hkv, d)
        if op == "rope_":  # the K slice: it starts inside the row
            xs, w = [qkv[:, hq:hq + hkv]], []
            args = lambda ts, ws, ps: (ts[0], ps, cache, False)  # noqa: E731
        else:
            xs, w = [qkv[:, :hq], qkv[:, hq:hq + hkv]], [_weight(d, BF16), _weight(d, BF16)]
            args = lambda ts, ws, ps: (ts[0], ts[1], ws[0], ws[1], ps, cache, EPS, True)  # noqa: E731
    rows0 = buf[sel].clone()
    ref_d = [x[sel] for x in xs]
    ref32 = [_f32(x[sel]) for x in xs]
    _run(op, "torch", *args(ref_d, w, pos[sel]))
    _run(op, "torch", *args(ref32, [x.float() for x in w], pos[sel]))
    _run(op, backend, *args(xs, w, pos))
    for i, x in enumerate(xs):
        _check_close(x[sel], ref_d[i], ref32[i], f"{what} (tensor {i})")
    # everything of the checked rows that is not the op's tensors is unchanged
    after = buf[sel].view(len(sel), -1)
    mask = torch.ones(per_tok, dtype=torch.bool, device=DEV)
    if op == "knorm_rope_":
        mask.view(n_layers, 2, hkv, d)[:, 0] = False
    elif op == "rope_":
        mask.view(hq + 2 * hkv, d)[hq:hq + hkv] = False
    else:
        mask.view(hq + 2 * hkv, d)[:hq + hkv] = False
    assert torch.equal(_bits(after[:, mask]), _bits(rows0.view(len(sel), -1)[:, mask])), \
        f"{what}: elements outside the op's tensors were written"
    del buf, xs
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ opcheck
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op, case", [pytest.param(op, case, id=f"{op}-{case}")
                                      for op, case in opcheck_cases.CASES
                                      if op in ROPE_OPS])
def test_opcheck(backend, op, case, dtype):
    """opcheck on the ops' sample cases (tests/test_opcheck.py) with each backend forced."""
    _need(op, backend)
    with dflash_ops.use_backend(backend, ops=[op]):
        opcheck_cases.opcheck(op, case, dtype, DEV)


# ------------------------------------------------------------------------------------ CUDA graphs
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("op", ROPE_OPS)
def test_rope_ops_cuda_graph(backend, op):
    """Warm up, capture one call, then change the tensors and positions in place and replay."""
    _need(op, backend)
    t, hq, hkv, n_layers, d, p, dtype = 48, 32, 8, 5, 128, 300, BF16
    cache = make_cos_sin_cache(p, d, device=DEV)
    pos = torch.randint(0, p, (t,), device=DEV)
    if op == "knorm_rope_":
        kv = _rand((t, n_layers, 2, hkv, d), dtype)
        xs, ws = [kv[:, :, 0]], [_weight((n_layers, d), dtype)]
        args = lambda ts, w: (ts[0], w[0], pos, cache, EPS, True)  # noqa: E731
    else:
        qkv = _rand((t, hq + 2 * hkv, d), dtype)
        if op == "rope_":
            xs, ws = [qkv[:, :hq]], []
            args = lambda ts, w: (ts[0], pos, cache, False)  # noqa: E731
        else:
            xs, ws = [qkv[:, :hq], qkv[:, hq:hq + hkv]], [_weight(d, dtype), _weight(d, dtype)]
            args = lambda ts, w: (ts[0], ts[1], w[0], w[1], pos, cache, EPS, True)  # noqa: E731
    fn = getattr(torch.ops.dflash, op).default
    with dflash_ops.use_backend(backend, ops=[op]):
        fn(*args(xs, ws))  # warm-up: compilation and any autotuning happen here, not in capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args(xs, ws))
        for rnd in range(3):
            for x in xs:
                x.copy_(_rand(x.shape, dtype, 2.0))
            new_pos = torch.randint(0, p, (t,), device=DEV)
            if rnd == 1:
                new_pos[::5], new_pos[1::7] = -1, p
            pos.copy_(new_pos)
            ref_d = [x.clone() for x in xs]
            ref32 = [_f32(x) for x in xs]
            _run(op, "torch", *args(ref_d, ws))
            _run(op, "torch", *args(ref32, [w.float() for w in ws]))
            graph.replay()
            torch.cuda.synchronize()
            for i, x in enumerate(xs):
                _check_close(x, ref_d[i], ref32[i], f"{backend} {op} graph replay {rnd} (tensor {i})")
