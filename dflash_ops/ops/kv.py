"""The paged KV-cache writes: ``store_kv_`` and ``qk_norm_rope_store_``.

Paged caches are ``[num_blocks, block_size, Hkv, D]`` with any strides (unit stride in D), one
tensor per layer: token t goes to block ``slot // block_size``, row ``slot % block_size``.
A slot < 0 (padding) or >= num_blocks * block_size is skipped; ``DFLASH_OPS_DEBUG=1`` makes an
out-of-range slot an error. Slots of valid tokens must be distinct.

``qk_norm_rope_store_`` is a decoder layer's step after its QKV GEMM in one launch:
``qk_norm_rope_`` on q (in place) and k, then ``store_kv_`` of that k and of v, so k and v
are read once and k is never written back (with no weights, ``rope_`` instead of the norms).
"""
from __future__ import annotations

from typing import List

import torch

from .. import dispatch
from . import _checks as C
from ._samples import EPS, META, P, Maker, both, caches, item, positions, rnd, set_, strided_last, to
from .norm import rms_norm_ref
from .rope import HEAD_DIMS, _check_heads, _check_pos, _debug_positions, rope_values

__all__ = ["store_kv_", "qk_norm_rope_store_"]


# store_kv_ ---------------------------------------------------------------------------------
def _check_store(k, v, k_caches, v_caches, slot_mapping, op="store_kv_"):
    C.tensor(op, "k", k, rank=4, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    t, n_layers, hkv, d = k.shape
    if n_layers == 0:
        C.fail(op, f"k must hold at least one layer ([T, L, Hkv, D] with L >= 1) and k_caches "
                   f"one cache per layer, got k {list(k.shape)}")
    C.head_dim(op, "k", d, HEAD_DIMS)
    C.tensor(op, "v", v, shape=tuple(k.shape), device=k.device, last_contiguous=True)
    C.same_dtype(op, "v", v, "k", k)
    for name, lst in (("k_caches", k_caches), ("v_caches", v_caches)):
        C.caches(op, name, lst, n_layers, num_heads=hkv, head_size=d, dtype=k.dtype,
                 device=k.device)
    if k_caches[0].shape[:2] != v_caches[0].shape[:2]:
        C.fail(op, f"v_caches must have the [num_blocks, block_size] of k_caches "
                   f"{list(k_caches[0].shape[:2])}, got {list(v_caches[0].shape[:2])}")
    C.index_vector(op, "slot_mapping", slot_mapping, t, k.device)


def _debug_slots(op, slot_mapping, cache):
    n = cache.shape[0] * cache.shape[1]
    bad = slot_mapping >= n
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        C.fail(op, f"slot_mapping[{i}] = {int(slot_mapping[i])} is past the cache's {n} slots")


def store_kv_ref(k, v, k_caches: List[torch.Tensor], v_caches: List[torch.Tensor],
                 slot_mapping) -> None:
    bs = k_caches[0].shape[1]
    n = k_caches[0].shape[0] * bs
    # Boolean indexing synchronises on CUDA; the reference is the oracle, not the fast path.
    keep = (slot_mapping >= 0) & (slot_mapping < n)
    slots = slot_mapping[keep]
    block, row = slots // bs, slots % bs
    for layer, (kc, vc) in enumerate(zip(k_caches, v_caches)):
        kc[block, row] = k[keep, layer]
        vc[block, row] = v[keep, layer]


# Default cuda (k/v [T, 5, 8, 128] bf16 into 5 paged caches, CUDA-graph replay): cuda 1.80 vs
# triton 2.04 us at T = 1, 43.7 vs 43.7 us at T = 4096, 169.2 vs 168.6 us at T = 16384.
dispatch.define_op(
    "store_kv_(Tensor k, Tensor v, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "Tensor slot_mapping) -> ()",
    validate=_check_store, reference=store_kv_ref, fake=lambda *a: None, default="cuda",
    debug_check=lambda k, v, kc, vc, s: _debug_slots("store_kv_", s, kc[0]))


# qk_norm_rope_store_ -----------------------------------------------------------------------
def _check_qkrs(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, k_cache,
                v_cache, slot_mapping):
    op = "qk_norm_rope_store_"
    _check_heads(op, "q", q, 3)
    _check_heads(op, "k", k, 3, device=q.device)
    C.same_dtype(op, "k", k, "q", q)
    t, d = q.shape[0], q.shape[-1]
    if k.shape[0] != t or k.shape[2] != d:
        C.fail(op, f"k must be [T={t}, Hkv, D={d}] like q, got {list(k.shape)}")
    C.tensor(op, "v", v, shape=tuple(k.shape), device=q.device, last_contiguous=True)
    C.same_dtype(op, "v", v, "q", q)
    if (q_weight is None) != (k_weight is None):
        C.fail(op, "q_weight and k_weight must both be given (QK-norm) or both be None (RoPE "
                   f"alone), got q_weight {'None' if q_weight is None else 'a tensor'} and "
                   f"k_weight {'None' if k_weight is None else 'a tensor'}")
    if q_weight is not None:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            C.tensor(op, name, w, shape=(d,), device=q.device)
            C.same_dtype(op, name, w, "q", q)
    C.eps(op, eps)
    _check_pos(op, positions, cos_sin_cache, t, d, q.device)
    hkv = k.shape[1]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.tensor(op, name, c, rank=4, dtype=q.dtype, device=q.device, last_contiguous=True)
        if c.shape[2] != hkv or c.shape[3] != d:
            C.fail(op, f"{name} must be [num_blocks, block_size, {hkv}, {d}] (Hkv, D of k), "
                       f"got {list(c.shape)}")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        C.fail(op, f"v_cache must have the [num_blocks, block_size] of k_cache "
                   f"{list(k_cache.shape[:2])}, got {list(v_cache.shape[:2])}")
    C.index_vector(op, "slot_mapping", slot_mapping, t, q.device)


def _qkrs_ref(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, k_cache,
              v_cache, slot_mapping):
    if q_weight is not None:
        qn, kn = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    else:
        qn, kn = q, k
    kr = rope_values(kn, positions, cos_sin_cache, is_neox)
    q.copy_(rope_values(qn, positions, cos_sin_cache, is_neox))
    store_kv_ref(kr[:, None], v[:, None], [k_cache], [v_cache], slot_mapping)


def _debug_qkrs(q, k, v, wq, wk, positions, cos_sin_cache, eps, is_neox, k_cache, v_cache,
                slot_mapping):
    _debug_positions("qk_norm_rope_store_", positions, cos_sin_cache)
    _debug_slots("qk_norm_rope_store_", slot_mapping, k_cache)


# Default triton (as qk_norm_rope_'s: a graph-replayed launch is shorter than the C++ kernel's
# at decode sizes); eager calls take the C++ kernel (less host time).
dispatch.define_op(
    "qk_norm_rope_store_(Tensor(a!) q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, "
    "Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox, Tensor(b!) k_cache, "
    "Tensor(c!) v_cache, Tensor slot_mapping) -> ()",
    validate=_check_qkrs, reference=_qkrs_ref, fake=lambda *a: None, default="triton",
    eager="cuda", debug_check=_debug_qkrs)


def qk_norm_rope_store_(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox,
                        k_cache, v_cache, slot_mapping) -> None:
    """q[T, Hq, D] <- RoPE(RMSNorm(q) * q_weight) in place; the paged caches' rows at
    ``slot_mapping`` (-1 skipped) <- RoPE(RMSNorm(k) * k_weight) and v (k, v [T, Hkv, D] are not
    written). q_weight = k_weight = None: RoPE alone (no QK-norm)."""
    torch.ops.dflash.qk_norm_rope_store_.default(q, k, v, q_weight, k_weight, positions,
                                                 cos_sin_cache, eps, is_neox, k_cache, v_cache,
                                                 slot_mapping)


def store_kv_(k, v, k_caches, v_caches, slot_mapping) -> None:
    """Write k/v[T, L, Hkv, D] into every layer's paged cache at ``slot_mapping`` (-1 skipped)."""
    torch.ops.dflash.store_kv_.default(k, v, list(k_caches), list(v_caches), slot_mapping)


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    def store(head_major, seed):
        m = Maker(seed, device, dtype)
        kc, vc = m.caches(2, 4, 4, 2, 64, head_major)
        return dict(k=m.rnd(6, 2, 2, 64), v=m.rnd(6, 2, 2, 64), k_caches=kc, v_caches=vc,
                    slot_mapping=m.ints([0, 5, -1, 14, 3, 7]))

    def qkrs(norm, is_neox, rotary_dim, head_major, seed):
        m = Maker(seed, device, dtype)
        qkv = m.rnd(5, 12, 64)  # q, k and v: views of one fused QKV output
        kc, vc = m.caches(1, 4, 4, 2, 64, head_major)
        return dict(q=qkv[:, :8], k=qkv[:, 8:10], v=qkv[:, 10:12],
                    q_weight=m.rnd(64) if norm else None, k_weight=m.rnd(64) if norm else None,
                    positions=m.positions(5), cos_sin_cache=m.cos_sin(rotary_dim), eps=EPS,
                    is_neox=is_neox, k_cache=kc[0], v_cache=vc[0],
                    slot_mapping=m.ints([0, 5, -1, 14, 3]))

    return {"store_kv_": {"nhd": store(False, 13), "vllm-head-major": store(True, 14)},
            "qk_norm_rope_store_": {"norm-neox": qkrs(True, True, 64, False, 15),
                                    "rope-gptj-partial-head-major": qkrs(False, False, 32, True,
                                                                         16)}}


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``)."""
    I32, BF16, F32 = torch.int32, torch.bfloat16, torch.float32
    qkrs = [
        ("q-rank2", set_(q=rnd(5, 64)), "q"),
        ("q-int", to("q", dtype=I32), "q"),
        ("k-T-differs", set_(k=rnd(4, 2, 64)), "k"),
        ("k-head_dim-differs", set_(k=rnd(5, 2, 32)), "k"),
        ("k-bf16", to("k", dtype=BF16), "k"),
        ("v-shape", set_(v=rnd(5, 1, 64)), "v"),
        ("v-bf16", to("v", dtype=BF16), "v"),
        ("v-last-stride", set_(v=strided_last(5, 2, 64)), "v"),
        ("k_weight-missing", set_(k_weight=None), "k_weight"),
        ("q_weight-shape", set_(q_weight=rnd(32)), "q_weight"),
        ("k_weight-meta", to("k_weight", device=META), "k_weight"),
        ("eps-negative", set_(eps=-1.0), "eps"),
        ("positions-len", set_(positions=positions(6)), "positions"),
        ("positions-int32", to("positions", dtype=I32), "positions"),
        ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 31)), "cos_sin_cache"),
        ("k_cache-Hkv", set_(k_cache=rnd(4, 4, 4, 64)), "k_cache"),
        ("k_cache-rank3", set_(k_cache=rnd(16, 2, 64)), "k_cache"),
        ("k_cache-bf16", to("k_cache", dtype=BF16), "k_cache"),
        ("v_cache-D", set_(v_cache=rnd(4, 4, 2, 32)), "v_cache"),
        ("v_cache-block_size", set_(v_cache=rnd(4, 8, 2, 64)), "v_cache"),
        ("v_cache-meta", to("v_cache", device=META), "v_cache"),
        ("slot_mapping-int32", to("slot_mapping", dtype=I32), "slot_mapping"),
        ("slot_mapping-len", set_(slot_mapping=torch.arange(4)), "slot_mapping"),
    ]
    return {"qk_norm_rope_store_": qkrs, "store_kv_": [
        ("k-rank3", set_(k=rnd(6, 2, 64)), "k"),
        ("k-int", both(to("k", dtype=I32), to("v", dtype=I32)), "k"),
        ("k-head_dim-96", set_(k=rnd(6, 2, 2, 96), v=rnd(6, 2, 2, 96), k_caches=caches(d=96),
                               v_caches=caches(d=96)), "k"),
        ("k-last-stride", set_(k=strided_last(6, 2, 2, 64)), "k"),
        ("v-shape", set_(v=rnd(6, 2, 1, 64)), "v"),
        ("v-bf16", to("v", dtype=BF16), "v"),
        ("v-meta", to("v", device=META), "v"),
        ("k_caches-too-few", item("k_caches", slice(1, None), []), "k_caches"),
        ("v_caches-too-many", set_(v_caches=caches(3)), "v_caches"),
        ("k_caches[1]-Hkv", item("k_caches", 1, rnd(4, 4, 4, 64)), "k_caches[1]"),
        ("v_caches[0]-D", item("v_caches", 0, rnd(4, 4, 2, 32)), "v_caches[0]"),
        ("k_caches[1]-num_blocks", item("k_caches", 1, rnd(5, 4, 2, 64)), "k_caches[1]"),
        ("v_caches-num_blocks", set_(v_caches=caches(nb=8)), "v_caches"),
        ("v_caches-block_size", set_(v_caches=caches(bs=8)), "v_caches"),
        ("k_caches[0]-last-stride", item("k_caches", 0, strided_last(4, 4, 2, 64)),
         "k_caches[0]"),
        ("k_caches[0]-bf16", item("k_caches", 0, lambda c: c.to(BF16)), "k_caches[0]"),
        ("k_caches[0]-rank3", item("k_caches", 0, rnd(16, 2, 64)), "k_caches[0]"),
        ("k_caches[1]-meta", item("k_caches", 1, lambda c: c.to(META)), "k_caches[1]"),
        ("slot_mapping-int32", to("slot_mapping", dtype=I32), "slot_mapping"),
        ("slot_mapping-float", to("slot_mapping", dtype=F32), "slot_mapping"),
        ("slot_mapping-len", set_(slot_mapping=torch.arange(5)), "slot_mapping"),
        ("slot_mapping-rank2", set_(slot_mapping=lambda kw: kw["slot_mapping"].view(6, 1)),
         "slot_mapping"),
        ("slot_mapping-meta", to("slot_mapping", device=META), "slot_mapping"),
    ]}
