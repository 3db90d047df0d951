"""The context K/V path: ``kv_proj`` (the fused multi-layer K/V GEMM) and ``context_kv_``
(that GEMM, then per-layer K RMSNorm, RoPE and the paged write of every layer's K and V).

The stacked weight ``w_kv[L*2*Hkv*D, H]`` is layer-major, K rows then V rows inside a layer, so
the GEMM output viewed as ``[T, L, 2, Hkv, D]`` gives every layer's K and V. Caches and slots as
in ``ops/kv.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import dispatch
from . import _checks as C
from ._samples import (EPS, META, P, Maker, both, caches, cos_sin, item, positions, rnd, set_,
                       strided_last, to)
from .kv import _debug_slots, store_kv_ref
from .norm import rms_norm_ref
from .rope import HEAD_DIMS, _debug_positions, rope_values

__all__ = ["kv_proj", "context_kv_"]


# kv_proj -----------------------------------------------------------------------------------
def _check_proj(x, w_kv, bias=None, op="kv_proj"):
    C.tensor(op, "x", x, rank=2, dtype=C.FLOAT_DTYPES)
    C.tensor(op, "w_kv", w_kv, rank=2, device=x.device)
    C.same_dtype(op, "w_kv", w_kv, "x", x)
    if w_kv.shape[1] != x.shape[1]:
        C.fail(op, f"w_kv must be [N, H={x.shape[1]}] (H = x's columns), got {list(w_kv.shape)}")
    if bias is not None:
        C.tensor(op, "bias", bias, shape=(w_kv.shape[0],), device=x.device)
        C.same_dtype(op, "bias", bias, "x", x)


def kv_proj_ref(x, w_kv, bias=None):
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w_kv.float(), b).to(x.dtype)


# Default cuda (cuBLAS; x [T, 4096], w_kv [10240, 4096] bf16, graph replay): cuBLAS vs the best
# Triton config 22.5 vs 23.2 us at T = 1, 23.4 vs 26.1 at 64, 33.1 vs 39.9 at 256, 123.0 vs 123.3
# at 1024, 1913 vs 2099 at 16384; Triton ahead only at T = 4096 (436 vs 454 us). Since session
# 27 the C++ op runs its own skinny kernel at 1-32 rows on sm_90 (csrc/context.cu), not yet
# timed against cuBLAS (benchmarks/sweep_linear.py measures both).
dispatch.define_op(
    "kv_proj(Tensor x, Tensor w_kv, Tensor? bias=None) -> Tensor",
    validate=_check_proj, reference=kv_proj_ref,
    fake=lambda x, w_kv, bias=None: x.new_empty((x.shape[0], w_kv.shape[0])), default="cuda")


# context_kv_ -------------------------------------------------------------------------------
def _check_context(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                   v_caches, eps, is_neox, hidden_norm_weight=None, hidden_rms=False):
    op = "context_kv_"
    _check_proj(x, w_kv, bias, op=op)
    if not isinstance(k_caches, (list, tuple)) or len(k_caches) == 0:
        C.fail(op, "k_caches must be a non-empty list of per-layer caches")
    C.tensor(op, "k_caches[0]", k_caches[0], rank=4, dtype=x.dtype, device=x.device)
    n_layers, (_, _, hkv, d) = len(k_caches), k_caches[0].shape
    C.head_dim(op, "k_caches[0]", d, HEAD_DIMS)
    for name, lst in (("k_caches", k_caches), ("v_caches", v_caches)):
        C.caches(op, name, lst, n_layers, num_heads=hkv, head_size=d, dtype=x.dtype,
                 device=x.device)
    n = n_layers * 2 * hkv * d
    if w_kv.shape[0] != n:
        C.fail(op, f"w_kv must have L*2*Hkv*D = {n_layers}*2*{hkv}*{d} = {n} rows (from the "
                   f"caches), got {w_kv.shape[0]}")
    C.tensor(op, "k_weight", k_weight, shape=(n_layers, d), device=x.device)
    C.same_dtype(op, "k_weight", k_weight, "x", x)
    t = x.shape[0]
    C.index_vector(op, "positions", positions, t, x.device)
    C.cos_sin_cache(op, cos_sin_cache, d, x.device)
    C.index_vector(op, "slot_mapping", slot_mapping, t, x.device)
    if k_caches[0].shape[:2] != v_caches[0].shape[:2]:
        C.fail(op, f"v_caches must have the [num_blocks, block_size] of k_caches "
                   f"{list(k_caches[0].shape[:2])}, got {list(v_caches[0].shape[:2])}")
    if hidden_norm_weight is not None:
        C.tensor(op, "hidden_norm_weight", hidden_norm_weight, shape=(x.shape[1],),
                 device=x.device)
        C.same_dtype(op, "hidden_norm_weight", hidden_norm_weight, "x", x)
        if hidden_rms:
            C.fail(op, "hidden_rms must be False when hidden_norm_weight is given (hidden_rms "
                       "is the norm with its weight folded into w_kv), got True")
    C.eps(op, eps)


def context_kv_ref(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                   v_caches, eps, is_neox, hidden_norm_weight=None, hidden_rms=False) -> None:
    n_layers, (_, _, hkv, d) = len(k_caches), k_caches[0].shape
    if hidden_norm_weight is not None:
        x = rms_norm_ref(x, hidden_norm_weight, eps)
    if hidden_rms:  # (x @ w_kv^T) / rms(x) + bias in fp32, one rounding
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) if x.shape[1] else \
            torch.full((x.shape[0], 1), eps ** -0.5, device=x.device)
        kv = F.linear(xf, w_kv.float()) * rstd
        kv = (kv if bias is None else kv + bias.float()).to(x.dtype)
    else:
        kv = kv_proj_ref(x, w_kv, bias)
    kv = kv.view(x.shape[0], n_layers, 2, hkv, d)
    k = rope_values(rms_norm_ref(kv[:, :, 0], k_weight, eps), positions, cos_sin_cache, is_neox)
    store_kv_ref(k, kv[:, :, 1], k_caches, v_caches, slot_mapping)


def _debug_context(x, w, b, kw, positions, cache, slots, kc, vc, eps, neox, hn=None, rms=False):
    _debug_positions("context_kv_", positions, cache)
    _debug_slots("context_kv_", slots, kc[0])


# Default cuda (Qwen3-8B: H 4096, N 10240, bf16, graph replay): cuda vs triton 26.7 vs 30.8 us
# at T = 64, 39.8 vs 48.1 at 256, 542 vs 571 at 4096, 2150 vs 2294 at 16384; triton is ahead
# only at T <= 16 (23.8 vs 25.4 us at T = 1). Since session 27 the CUDA op runs one fused kernel
# (GEMM + epilogue, thread-block clusters) at 1-32 rows on sm_90: csrc/context.cu.
dispatch.define_op(
    "context_kv_(Tensor x, Tensor w_kv, Tensor? bias, Tensor k_weight, Tensor positions, "
    "Tensor cos_sin_cache, Tensor slot_mapping, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "float eps, bool is_neox, Tensor? hidden_norm_weight=None, bool hidden_rms=False) -> ()",
    validate=_check_context, reference=context_kv_ref, fake=lambda *a, **k: None,
    default="cuda", debug_check=_debug_context)


def kv_proj(x, w_kv, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fused multi-layer K/V GEMM: x[T, H] @ w_kv[L*2*Hkv*D, H]^T (+ bias)."""
    return torch.ops.dflash.kv_proj.default(x, w_kv, bias)


def context_kv_(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                v_caches, eps=1e-6, is_neox=True, hidden_norm_weight=None,
                hidden_rms=False) -> None:
    """(hidden_norm) -> GEMM -> per-layer K-norm -> RoPE -> paged write of every layer's K/V.
    ``hidden_rms``: the hidden norm with its weight folded into w_kv's columns by the caller
    (``w_kv * hidden_norm_weight``): each GEMM row is divided by rms(x_t) before the bias, which
    equals ``hidden_norm_weight``'s result up to rounding; the CUDA kernel then needs no norm
    pass at up to 256 tokens (one launch after the GEMM)."""
    torch.ops.dflash.context_kv_.default(x, w_kv, bias, k_weight, positions, cos_sin_cache,
                                         slot_mapping, list(k_caches), list(v_caches), eps,
                                         is_neox, hidden_norm_weight, hidden_rms)


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    def proj(with_bias, seed):
        m = Maker(seed, device, dtype)
        return dict(x=m.rnd(5, 32), w_kv=m.rnd(64, 32),
                    bias=m.rnd(64) if with_bias else None)

    def context(with_bias, with_hidden_norm, seed, is_neox=True, rotary_dim=64,
                hidden_rms=False, strided_norm=False):
        m = Maker(seed, device, dtype)
        n_layers, hkv, d, h = 2, 2, 64, 32
        n = n_layers * 2 * hkv * d
        kc, vc = m.caches(n_layers, 4, 4, hkv, d)
        return dict(x=m.rnd(5, h), w_kv=m.rnd(n, h, scale=0.2),
                    bias=m.rnd(n) if with_bias else None, k_weight=m.rnd(n_layers, d),
                    positions=m.positions(5), cos_sin_cache=m.cos_sin(rotary_dim),
                    slot_mapping=m.ints([3, -1, 0, 9, 15]), k_caches=kc, v_caches=vc, eps=EPS,
                    is_neox=is_neox, hidden_norm_weight=(
                        (m.rnd(2 * h)[::2] if strided_norm else m.rnd(h)) if with_hidden_norm
                        else None), hidden_rms=hidden_rms)

    return {
        "kv_proj": {"bias": proj(True, 15), "nobias": proj(False, 16)},
        "context_kv_": {"bias-hidden_norm": context(True, True, 17),
                        "nobias-no-hidden_norm": context(False, False, 18),
                        "gptj-partial": context(False, True, 19, is_neox=False, rotary_dim=32),
                        "bias-hidden_rms": context(True, False, 20, hidden_rms=True),
                        "gptj-hidden_rms": context(False, False, 21, is_neox=False,
                                                   hidden_rms=True),
                        "strided-hidden_norm": context(True, True, 22, strided_norm=True)},
    }


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``)."""
    I32, BF16 = torch.int32, torch.bfloat16
    rms = set_(hidden_norm_weight=None, hidden_rms=True)  # the case with the weight in w_kv
    return {
        "kv_proj": [
            ("x-rank3", set_(x=rnd(5, 1, 32)), "x"),
            ("x-rank1", set_(x=rnd(32)), "x"),
            ("x-int", both(to("x", dtype=I32), to("w_kv", dtype=I32), to("bias", dtype=I32)),
             "x"),
            ("w_kv-bf16", to("w_kv", dtype=BF16), "w_kv"),
            ("w_kv-cols", set_(w_kv=rnd(64, 16)), "w_kv"),
            ("w_kv-rank1", set_(w_kv=rnd(64 * 32)), "w_kv"),
            ("w_kv-meta", to("w_kv", device=META), "w_kv"),
            ("bias-shape", set_(bias=rnd(32)), "bias"),
            ("bias-rank2", set_(bias=rnd(1, 64)), "bias"),
            ("bias-bf16", to("bias", dtype=BF16), "bias"),
            ("bias-meta", to("bias", device=META), "bias"),
        ],
        "context_kv_": [
            ("x-int", both(to("x", dtype=I32), to("w_kv", dtype=I32)), "x"),
            ("x-rank3", set_(x=rnd(5, 1, 32)), "x"),
            ("w_kv-rows", set_(w_kv=rnd(256, 32), bias=None), "w_kv"),
            ("w_kv-cols", set_(w_kv=rnd(512, 16)), "w_kv"),
            ("w_kv-bf16", to("w_kv", dtype=BF16), "w_kv"),
            ("w_kv-meta", to("w_kv", device=META), "w_kv"),
            ("bias-shape", set_(bias=rnd(256)), "bias"),
            ("bias-bf16", to("bias", dtype=BF16), "bias"),
            ("k_weight-layers", set_(k_weight=rnd(3, 64)), "k_weight"),
            ("k_weight-bf16", to("k_weight", dtype=BF16), "k_weight"),
            ("k_weight-meta", to("k_weight", device=META), "k_weight"),
            ("positions-len", set_(positions=positions(4)), "positions"),
            ("positions-int32", to("positions", dtype=I32), "positions"),
            ("slot_mapping-len", set_(slot_mapping=torch.arange(6)), "slot_mapping"),
            ("slot_mapping-int32", to("slot_mapping", dtype=I32), "slot_mapping"),
            ("slot_mapping-meta", to("slot_mapping", device=META), "slot_mapping"),
            ("cache-odd-cols", set_(cos_sin_cache=rnd(P, 33)), "cos_sin_cache"),
            ("cache-too-many-cols", set_(cos_sin_cache=cos_sin(128)), "cos_sin_cache"),
            ("cache-bf16", to("cos_sin_cache", dtype=BF16), "cos_sin_cache"),
            ("k_caches-empty", set_(k_caches=[]), "k_caches"),
            ("v_caches-too-many", set_(v_caches=caches(3)), "v_caches"),
            ("v_caches-too-few", set_(v_caches=caches(1)), "v_caches"),
            ("k_caches[1]-Hkv", item("k_caches", 1, rnd(4, 4, 4, 64)), "k_caches[1]"),
            ("v_caches[0]-D", item("v_caches", 0, rnd(4, 4, 2, 32)), "v_caches[0]"),
            ("v_caches-num_blocks", set_(v_caches=caches(nb=8)), "v_caches"),
            ("k_caches[0]-last-stride", item("k_caches", 0, strided_last(4, 4, 2, 64)),
             "k_caches[0]"),
            ("k_caches[0]-bf16", item("k_caches", 0, lambda c: c.to(BF16)), "k_caches[0]"),
            ("v_caches[1]-meta", item("v_caches", 1, lambda c: c.to(META)), "v_caches[1]"),
            ("head_dim-96", set_(w_kv=rnd(2 * 2 * 2 * 96, 32), bias=rnd(2 * 2 * 2 * 96),
                                 k_weight=rnd(2, 96), k_caches=caches(d=96),
                                 v_caches=caches(d=96)), "k_caches[0]"),
            ("hidden_norm_weight-shape", set_(hidden_norm_weight=rnd(64)), "hidden_norm_weight"),
            ("hidden_norm_weight-bf16", to("hidden_norm_weight", dtype=BF16),
             "hidden_norm_weight"),
            ("hidden_norm_weight-meta", to("hidden_norm_weight", device=META),
             "hidden_norm_weight"),
            ("hidden_rms-with-hidden_norm_weight", set_(hidden_rms=True), "hidden_rms"),
            # hidden_rms (the CUDA epilogue reads the bias and x itself): a break of another
            # argument is still named
            ("hidden_rms-hidden_norm_weight-shape",
             set_(hidden_rms=True, hidden_norm_weight=rnd(64)), "hidden_norm_weight"),
            ("hidden_rms-hidden_norm_weight-bf16",
             both(set_(hidden_rms=True), to("hidden_norm_weight", dtype=BF16)),
             "hidden_norm_weight"),
            ("hidden_rms-bias-shape", both(rms, set_(bias=rnd(256))), "bias"),
            ("hidden_rms-bias-bf16", both(rms, to("bias", dtype=BF16)), "bias"),
            ("hidden_rms-bias-meta", both(rms, to("bias", device=META)), "bias"),
            ("hidden_rms-x-rank3", both(rms, set_(x=rnd(5, 1, 32))), "x"),
            ("hidden_rms-w_kv-cols", both(rms, set_(w_kv=rnd(512, 16))), "w_kv"),
            ("hidden_rms-eps-negative", both(rms, set_(eps=-1.0)), "eps"),
            ("hidden_rms-eps-nan", both(rms, set_(eps=float("nan"))), "eps"),
            ("eps-negative", set_(eps=-1.0), "eps"),
        ],
    }
