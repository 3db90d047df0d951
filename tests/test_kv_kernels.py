"""The CUDA and Triton ``store_kv_`` kernels against the PyTorch reference on the GPU.

Every test is ``@pytest.mark.gpu`` and parametrised over backend in (cuda, triton); a backend
without the op is skipped with the reason. Grid (each value covered, not the cartesian product):
T, L, Hkv, D, block size, caches as separate tensors and as head-major views, k/v as views of a
fused [T, L, 2, Hkv, D] output, slot mappings with padding (-1), out-of-range and shuffled slots.
store_kv_ is exact: whole cache buffers compared bit for bit with the reference's (untouched
slots keep their random values). ``slow``: the > 2^31-element test.
"""
from __future__ import annotations

import pytest
import torch

import dflash_ops
from tests import test_opcheck as opcheck_cases
from tests.test_rope_kernels import (BF16, BIG, DEV, FP16, FP32, GPU_BACKENDS, _bits, _case_id,
                                     _dt, _free_bytes, _need, _rand, _run)

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------------------------ store_kv_
def _cache_buffers(layout: str, n_layers: int, nb: int, bs: int, hkv: int, d: int, dtype,
                   fill: str = "random"):
    """The tensors that own the caches' memory (random, so untouched slots are checkable)."""
    shapes = {"separate": [(nb, bs, hkv, d)] * (2 * n_layers),     # K and V tensors per layer
              "nhd": [(nb, 2, bs, hkv, d)] * n_layers,             # vLLM [blocks, 2, bs, Hkv, D]
              "hnd": [(nb, hkv, bs, 2 * d)] * n_layers,            # vLLM >= 0.33, K|V in last dim
              "stacked": [(n_layers, nb, 2, bs, hkv, d)]}[layout]  # every layer in one tensor
    if fill == "zeros":
        return [torch.zeros(s, dtype=dtype, device=DEV) for s in shapes]
    return [_rand(s, dtype) for s in shapes]


def _cache_views(layout: str, bufs, n_layers: int, d: int):
    """(k_caches, v_caches): per-layer [num_blocks, block_size, Hkv, D] views of ``bufs``."""
    if layout == "separate":
        return list(bufs[:n_layers]), list(bufs[n_layers:])
    if layout == "nhd":
        return [b[:, 0] for b in bufs], [b[:, 1] for b in bufs]
    if layout == "hnd":
        return ([b[..., :d].permute(0, 2, 1, 3) for b in bufs],
                [b[..., d:].permute(0, 2, 1, 3) for b in bufs])
    if layout == "stacked":
        return [bufs[0][i, :, 0] for i in range(n_layers)], [bufs[0][i, :, 1] for i in range(n_layers)]
    raise ValueError(layout)


def _bad_slots(n: int):
    # -(2^32) and 2^32 + 2 become the valid slots 0 and 2 if truncated to 32 bits; 2^31 -> -2^31
    return [-1, n, -1, 2**32 + 2, n + 5, -(2**32), 2**31, -7]


def _slots(t: int, n: int, kind: str) -> torch.Tensor:
    """slot_mapping[T]: distinct shuffled slots of ``n``; "mixed" puts -1 padding and
    out-of-range values on some tokens, "all_pad" makes every token padding."""
    if kind == "all_pad":
        return torch.full((t,), -1, dtype=torch.int64, device=DEV)
    slots = torch.randperm(n, device=DEV)[:t]
    if kind == "mixed" and t > 1:
        m = min(t // 2, max(2, t // 8))
        bad = _bad_slots(n)
        idx = torch.randperm(t, device=DEV)[:m]
        slots[idx] = torch.tensor([bad[i % len(bad)] for i in range(m)], dtype=torch.int64,
                                  device=DEV)
    return slots


def _compare_buffers(bufs, ref_bufs, what: str) -> None:
    for i, (b, rb) in enumerate(zip(bufs, ref_bufs)):
        diff = _bits(b) != _bits(rb)
        if diff.any():
            first = [int(j) for j in torch.unravel_index(diff.flatten().nonzero()[0, 0], b.shape)]
            raise AssertionError(f"{what}: cache buffer {i} {list(b.shape)} differs from the "
                                 f"reference in {int(diff.sum())} elements, first at {first}")


# T, L, Hkv, D, dtype, cache layout, block_size, k/v source, slots
STORE_CASES = [
    (1, 1, 1, 64, BF16, "separate", 16, "contig", "shuffled"),
    (1, 5, 8, 128, BF16, "nhd", 16, "kv", "all_pad"),
    (7, 5, 8, 128, BF16, "hnd", 16, "kv", "mixed"),
    (7, 8, 4, 64, FP16, "nhd", 1, "kv", "mixed"),
    (16, 8, 8, 64, BF16, "hnd", 16, "kv", "mixed"),
    (16, 1, 4, 256, FP32, "separate", 5, "contig", "mixed"),
    (16, 5, 8, 256, BF16, "hnd", 1, "kv", "shuffled"),
    (257, 5, 8, 128, BF16, "nhd", 16, "kv", "mixed"),
    (257, 5, 1, 256, FP16, "hnd", 32, "kv", "mixed"),
    (257, 8, 8, 64, FP32, "stacked", 16, "kv", "shuffled"),
    (4096, 5, 8, 128, BF16, "hnd", 16, "kv", "mixed"),
    (4096, 8, 8, 64, BF16, "nhd", 16, "kv", "shuffled"),
    (4096, 1, 4, 128, FP16, "separate", 16, "contig", "mixed"),
]


def _store_params():
    return [pytest.param(*c, id=_case_id(T=c[0], L=c[1], Hkv=c[2], D=c[3], dtype=c[4],
                                         cache=c[5], bs=c[6], src=c[7], slots=c[8]))
            for c in STORE_CASES]


def _kv_source(src: str, t: int, n_layers: int, hkv: int, d: int, dtype):
    """(k, v, owner tensors): views of one [T, L, 2, Hkv, D] GEMM output, or two tensors."""
    if src == "kv":
        kv = _rand((t, n_layers, 2, hkv, d), dtype)
        return kv[:, :, 0], kv[:, :, 1], [kv]
    k, v = _rand((t, n_layers, hkv, d), dtype), _rand((t, n_layers, hkv, d), dtype)
    return k, v, [k, v]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("t, n_layers, hkv, d, dtype, layout, bs, src, slot_kind", _store_params())
def test_store_kv(backend, t, n_layers, hkv, d, dtype, layout, bs, src, slot_kind):
    op = "store_kv_"
    _need(op, backend)
    what = (f"{backend} {op} T={t} L={n_layers} Hkv={hkv} D={d} {_dt(dtype)} {layout} bs={bs} "
            f"{src} {slot_kind}")
    nb = -(-(t * 3 // 2 + 8) // bs)  # room for every token and untouched slots
    k, v, owners = _kv_source(src, t, n_layers, hkv, d, dtype)
    owners0 = [_bits(o).clone() for o in owners]
    slots = _slots(t, nb * bs, slot_kind)
    bufs = _cache_buffers(layout, n_layers, nb, bs, hkv, d, dtype)
    ref_bufs = [b.clone() for b in bufs]
    _run(op, "torch", k, v, *_cache_views(layout, ref_bufs, n_layers, d), slots)
    _run(op, backend, k, v, *_cache_views(layout, bufs, n_layers, d), slots)
    _compare_buffers(bufs, ref_bufs, what)
    for o, o0 in zip(owners, owners0):
        assert torch.equal(_bits(o), o0), f"{what}: the k/v inputs were written"


@pytest.mark.slow
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_store_kv_int64_offsets(backend, layout):
    """Two layers of bf16 caches of 140247 blocks x 16 x 8 x 128 (x2 for K|V: 4.6e9 elements,
    9.2 GB each): slots near the end and around the 2^31- and 2^32-element boundaries."""
    op = "store_kv_"
    _need(op, backend)
    n_layers, bs, hkv, d, t = 2, 16, 8, 128, 96
    per_block = 2 * bs * hkv * d  # elements of one block of one layer (K and V)
    nb = 2 * BIG // per_block * 107 // 100  # 140247: past the 2^32-element offset too
    need = n_layers * nb * 2 * bs * hkv * d * 2
    if _free_bytes() < need + (4 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    what = f"{backend} {op} int64 offsets {layout}"
    bufs = _cache_buffers(layout, n_layers, nb, bs, hkv, d, BF16, fill="zeros")
    kcs, vcs = _cache_views(layout, bufs, n_layers, d)
    n = nb * bs
    boundary = []
    for e in (BIG, 2 * BIG):  # the blocks either side of element offsets 2^31 and 2^32
        b0 = e // per_block
        boundary += [blk * bs + r for blk in (b0 - 1, b0, b0 + 1) for r in (0, bs - 1)]
    above = (nb - (2 * BIG // per_block + 2)) * bs  # slots past the last boundary block
    end = (n - 1 - torch.randperm(min(16000, above))[:t - len(boundary) - 8]).tolist()
    slots = torch.tensor(boundary + end + _bad_slots(n), dtype=torch.int64)
    slots = slots[torch.randperm(t)].to(DEV)
    kv = _rand((t, n_layers, 2, hkv, d), BF16)
    k, v = kv[:, :, 0], kv[:, :, 1]
    _run(op, backend, k, v, kcs, vcs, slots)
    torch.cuda.synchronize()
    keep = (slots >= 0) & (slots < n)
    blk, row = slots[keep] // bs, slots[keep] % bs
    for layer in range(n_layers):
        for name, cache, src in (("K", kcs[layer], k), ("V", vcs[layer], v)):
            got = cache[blk, row]
            assert torch.equal(_bits(got), _bits(src[keep, layer])), \
                f"{what}: layer {layer} {name} rows at the written slots differ"
            cache[blk, row] = 0
    for i, b in enumerate(bufs):  # nothing else was written (it was all zeros)
        assert not _bits(b).any(), f"{what}: buffer {i} has writes outside the valid slots"
    del bufs, kcs, vcs
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ opcheck
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op, case", [pytest.param(op, case, id=f"{op}-{case}")
                                      for op, case in opcheck_cases.CASES
                                      if op == "store_kv_"])
def test_opcheck(backend, op, case, dtype):
    """opcheck on the ops' sample cases (tests/test_opcheck.py) with each backend forced."""
    _need(op, backend)
    with dflash_ops.use_backend(backend, ops=[op]):
        opcheck_cases.opcheck(op, case, dtype, DEV)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_store_kv_cuda_graph(backend, layout):
    """Capture one store_kv_, then replay with new k/v values, new cache contents and new
    slot_mapping values (other slots, other padding, out-of-range entries)."""
    op = "store_kv_"
    _need(op, backend)
    t, n_layers, hkv, d, bs, nb, dtype = 48, 5, 8, 128, 16, 8, BF16
    kv = _rand((t, n_layers, 2, hkv, d), dtype)
    k, v = kv[:, :, 0], kv[:, :, 1]
    bufs = _cache_buffers(layout, n_layers, nb, bs, hkv, d, dtype)
    kcs, vcs = _cache_views(layout, bufs, n_layers, d)
    slots = _slots(t, nb * bs, "mixed")
    fn = torch.ops.dflash.store_kv_.default
    with dflash_ops.use_backend(backend, ops=[op]):
        fn(k, v, kcs, vcs, slots)  # warm-up before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(k, v, kcs, vcs, slots)
        for rnd, kind in enumerate(("mixed", "shuffled", "mixed", "all_pad")):
            kv.copy_(_rand(kv.shape, dtype))
            for b in bufs:
                b.copy_(_rand(b.shape, dtype))
            slots.copy_(_slots(t, nb * bs, kind))
            ref_bufs = [b.clone() for b in bufs]
            _run(op, "torch", k, v, *_cache_views(layout, ref_bufs, n_layers, d), slots)
            graph.replay()
            torch.cuda.synchronize()
            _compare_buffers(bufs, ref_bufs, f"{backend} {op} {layout} graph replay {rnd} ({kind})")
