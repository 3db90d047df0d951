"""The CUDA and Triton ``qk_norm_rope_store_`` kernels against the PyTorch reference on the GPU.

Every test is ``@pytest.mark.gpu`` and parametrised over backend in (cuda, triton); a backend
without the op is skipped with the reason. Grid (each value covered, not the cartesian product):
T 1/7/16/257/4096, Hq/Hkv, D 64/128/256, full and partial rotary, NeoX and GPT-J, QK-norm and
RoPE alone, bf16/fp16/fp32, caches as separate tensors and as vLLM's nhd / hnd views, block sizes
1/5/16, slot mappings with padding and out-of-range values, positions out of the table.

q, k and v are slices of one fused QKV output. Checks: q (in place) and the cache rows written
with k within tests/test_rope_kernels.py's tolerance rule of the reference; the v rows bit for
bit; every cache element of a slot not written, and k and v themselves, unchanged bit for bit.
positions and slot_mapping are strided views (element stride 2).
"""
from __future__ import annotations

import pytest
import torch

import dflash_ops
from tests import test_opcheck as opcheck_cases
from tests.test_kv_kernels import _cache_buffers, _cache_views, _slots
from tests.test_rope_kernels import (BF16, DEV, EPS, FP16, FP32, GPU_BACKENDS, _bits, _case_id,
                                     _check_close, _dt, _f32, _need, _rand, _run, _table,
                                     _weight)

pytestmark = pytest.mark.gpu
OP = "qk_norm_rope_store_"

# T, Hq, Hkv, D, R, neox, dtype, norm, cache layout, block size, slots, positions out of range
CASES = [
    (1, 32, 8, 128, 128, True, BF16, True, "separate", 16, "shuffled", False),
    (1, 1, 1, 64, 64, False, FP16, False, "hnd", 16, "shuffled", True),
    (1, 32, 8, 128, 128, True, BF16, True, "nhd", 16, "all_pad", False),
    (7, 16, 4, 128, 64, True, BF16, True, "hnd", 5, "mixed", True),
    (7, 8, 1, 256, 128, False, BF16, False, "separate", 16, "mixed", True),
    (16, 32, 8, 128, 128, True, BF16, True, "nhd", 1, "mixed", True),
    (16, 4, 4, 256, 256, False, FP32, True, "hnd", 16, "shuffled", True),
    (16, 8, 2, 64, 32, True, FP16, False, "nhd", 16, "mixed", False),
    (257, 32, 8, 128, 128, True, BF16, True, "hnd", 16, "mixed", True),
    (257, 8, 8, 64, 64, False, FP16, True, "separate", 5, "shuffled", True),
    (257, 16, 4, 128, 128, True, FP32, False, "nhd", 16, "mixed", True),
    (4096, 32, 8, 128, 128, True, BF16, True, "nhd", 16, "mixed", True),
    (4096, 8, 4, 256, 128, False, FP16, True, "hnd", 16, "shuffled", False),
]


def _params():
    return [pytest.param(*c, id=_case_id(T=c[0], Hq=c[1], Hkv=c[2], D=c[3], R=c[4], neox=c[5],
                                         dtype=c[6], norm="norm" if c[7] else "rope",
                                         cache=c[8], bs=c[9], slots=c[10], oob=c[11]))
            for c in CASES]


def _strided(idx: torch.Tensor) -> torch.Tensor:
    """idx as a view with element stride 2 (the other elements a valid-looking 3: a kernel
    that ignores the stride reads them)."""
    buf = torch.full((2 * idx.numel(),), 3, dtype=idx.dtype, device=idx.device)
    buf[::2] = idx
    return buf[::2]


def _written(slots: torch.Tensor, nb: int, bs: int) -> torch.Tensor:
    """[nb, bs] bool: the cache rows the op may write (slots in [0, nb * bs))."""
    m = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
    ok = (slots >= 0) & (slots < nb * bs)
    m[slots[ok]] = True
    return m.view(nb, bs)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("t, hq, hkv, d, r, neox, dtype, norm, layout, bs, slot_kind, oob",
                         _params())
def test_qk_norm_rope_store(backend, t, hq, hkv, d, r, neox, dtype, norm, layout, bs, slot_kind,
                            oob):
    _need(OP, backend)
    what = (f"{backend} {OP} T={t} Hq={hq} Hkv={hkv} D={d} R={r} {'neox' if neox else 'gptj'} "
            f"{_dt(dtype)} {'norm' if norm else 'rope'} {layout} bs={bs} {slot_kind}")
    qkv = _rand((t, hq + 2 * hkv, d), dtype, scale=3.0)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    kv0 = _bits(qkv[:, hq:]).clone()
    wq, wk = (_weight(d, dtype), _weight(d, dtype)) if norm else (None, None)
    w32 = (wq.float(), wk.float()) if norm else (None, None)
    pos, cos_sin, _ = _table(t, r, oob)
    nb = -(-(t * 3 // 2 + 8) // bs)  # room for every token and untouched slots
    slots = _slots(t, nb * bs, slot_kind)
    pos, slots = _strided(pos), _strided(slots)  # index tensors with element stride 2
    bufs = _cache_buffers(layout, 1, nb, bs, hkv, d, dtype)
    bufs0 = [b.clone() for b in bufs]
    ref = [b.clone() for b in bufs]
    ref32 = [b.float() for b in bufs]
    qd, q32 = q.clone(), _f32(q)

    def caches(bs_):
        kcs, vcs = _cache_views(layout, bs_, 1, d)
        return kcs[0], vcs[0]

    _run(OP, "torch", qd, k, v, wq, wk, pos, cos_sin, EPS, neox, *caches(ref), slots)
    _run(OP, "torch", q32, _f32(k), _f32(v), *w32, pos, cos_sin, EPS, neox, *caches(ref32), slots)
    _run(OP, backend, q, k, v, wq, wk, pos, cos_sin, EPS, neox, *caches(bufs), slots)

    _check_close(q, qd, q32, what + " (q)")
    assert torch.equal(_bits(qkv[:, hq:]), kv0), f"{what}: k or v was written"
    kc, vc = caches(bufs)
    kr, vr = caches(ref)
    k32, _ = caches(ref32)
    wr = _written(slots, nb, bs)
    if wr.any():  # (all_pad: none)
        _check_close(kc[wr], kr[wr], k32[wr], what + " (k_cache rows)")
        assert torch.equal(_bits(vc[wr]), _bits(vr[wr])), f"{what}: v_cache rows differ from v"
    kc0, vc0 = caches(bufs0)
    for name, c, c0 in (("k_cache", kc, kc0), ("v_cache", vc, vc0)):
        assert torch.equal(_bits(c[~wr]), _bits(c0[~wr])), \
            f"{what}: {name} rows of slots not in slot_mapping were written"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [c for op, c in opcheck_cases.CASES if op == OP])
def test_opcheck(backend, case, dtype):
    """opcheck on the op's sample cases (tests/test_opcheck.py) with each backend forced."""
    _need(OP, backend)
    with dflash_ops.use_backend(backend, ops=[OP]):
        opcheck_cases.opcheck(OP, case, dtype, DEV)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope"])
def test_cuda_graph(backend, norm):
    """Capture one call, then change q/k/v, positions, slots and the caches in place and
    replay: each replay equals an eager run of the same backend bit for bit."""
    _need(OP, backend)
    t, hq, hkv, d, bs, nb, p, dtype = 48, 32, 8, 128, 16, 8, 300, BF16
    from dflash_ops.ops.rope import make_cos_sin_cache
    cos_sin = make_cos_sin_cache(p, d, device=DEV)
    qkv = _rand((t, hq + 2 * hkv, d), dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    wq, wk = (_weight(d, dtype), _weight(d, dtype)) if norm else (None, None)
    pos = torch.randint(0, p, (t,), device=DEV)
    slots = _slots(t, nb * bs, "mixed")
    bufs = _cache_buffers("nhd", 1, nb, bs, hkv, d, dtype)
    kc, vc = (x[0] for x in _cache_views("nhd", bufs, 1, d))
    fn = torch.ops.dflash.qk_norm_rope_store_.default
    with dflash_ops.use_backend(backend, ops=[OP]):
        fn(q, k, v, wq, wk, pos, cos_sin, EPS, True, kc, vc, slots)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(q, k, v, wq, wk, pos, cos_sin, EPS, True, kc, vc, slots)
        for rnd, kind in enumerate(("mixed", "shuffled", "all_pad")):
            qkv.copy_(_rand(qkv.shape, dtype))
            pos.copy_(torch.randint(0, p, (t,), device=DEV))
            slots.copy_(_slots(t, nb * bs, kind))
            for b in bufs:
                b.copy_(_rand(b.shape, dtype))
            eq, ebufs = qkv.clone(), [b.clone() for b in bufs]
            ekc, evc = (x[0] for x in _cache_views("nhd", ebufs, 1, d))
            fn(eq[:, :hq], eq[:, hq:hq + hkv], eq[:, hq + hkv:], wq, wk, pos, cos_sin, EPS, True,
               ekc, evc, slots)
            graph.replay()
            torch.cuda.synchronize()
            what = f"{backend} {OP} graph replay {rnd} ({kind})"
            assert torch.equal(_bits(qkv), _bits(eq)), f"{what}: q differs from the eager run"
            for b, eb in zip(bufs, ebufs):
                assert torch.equal(_bits(b), _bits(eb)), f"{what}: caches differ from eager"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_huge_slot_numbers(backend):
    """num_blocks * block_size >= 2^31 (64-bit slot math) without the memory: caches whose
    block stride is 0 (every block aliases block 0), so slot s lands on row s % block_size;
    the expected caches: the reference into a one-block cache at slots s % block_size (-1 for
    the ones past the cache)."""
    _need(OP, backend)
    nb, bs, hq, hkv, d, dtype = 2**30, 16, 4, 2, 64, FP16
    slots = torch.tensor([2**31 + 3, -1, 5 * 2**31 + 7, nb * bs, 2**33 + 12, nb * bs - 1],
                         device=DEV)
    t = len(slots)
    small = torch.where((slots >= 0) & (slots < nb * bs), slots % bs, -1)
    qkv = _rand((t, hq + 2 * hkv, d), dtype, scale=3.0)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    wq, wk = _weight(d, dtype), _weight(d, dtype)
    pos, cos_sin, _ = _table(t, d, False)
    base = _rand((2, 1, bs, hkv, d), dtype)
    want, want32 = base.clone(), base.float()
    qd, q32 = q.clone(), _f32(q)
    _run(OP, "torch", qd, k, v, wq, wk, pos, cos_sin, EPS, True, want[0], want[1], small)
    _run(OP, "torch", q32, _f32(k), _f32(v), wq.float(), wk.float(), pos, cos_sin, EPS, True,
         want32[0], want32[1], small)
    kc, vc = (base[i].expand(nb, bs, hkv, d) for i in range(2))
    _run(OP, backend, q, k, v, wq, wk, pos, cos_sin, EPS, True, kc, vc, slots)
    what = f"{backend} {OP} slots past 2^31"
    _check_close(q, qd, q32, what + " (q)")
    _check_close(base[0], want[0], want32[0], what + " (k_cache)")
    assert torch.equal(_bits(base[1]), _bits(want[1])), f"{what}: v_cache differs"
