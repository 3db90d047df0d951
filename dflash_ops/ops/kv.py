"""The paged KV-cache write: ``store_kv_`` (``qk_norm_rope_store_``, in ops/rope.py, writes a
layer's K/V too).

Paged caches are ``[num_blocks, block_size, Hkv, D]`` with any strides (unit stride in D), one
tensor per layer: token t goes to block ``slot // block_size``, row ``slot % block_size``.
A slot < 0 (padding) or >= num_blocks * block_size is skipped; ``DFLASH_OPS_DEBUG=1`` makes an
out-of-range slot an error. Slots of valid tokens must be distinct.
"""
from __future__ import annotations

from typing import List

import torch

from .. import dispatch
from . import _checks as C
from ._samples import META, Maker, both, caches, item, rnd, set_, strided_last, to
from .rope import HEAD_DIMS

__all__ = ["store_kv_"]


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

    return {"store_kv_": {"nhd": store(False, 13), "vllm-head-major": store(True, 14)}}


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``)."""
    I32, BF16, F32 = torch.int32, torch.bfloat16, torch.float32
    return {"store_kv_": [
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
