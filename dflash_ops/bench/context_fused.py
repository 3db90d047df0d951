"""The ``context_kv_`` tables of the context K/V suite (``bench.context_kv``): the full context
K/V path (GEMM + K-norm + RoPE + paged cache writes), fused and unfused, against the GEMM alone.

One table per model of ``CTX_MODELS`` (name: H, L, Hkv, D): Qwen3-8B (4096, 5, 8, 128), Qwen3-4B
(2560, 5, 8, 128), Qwen3.8-27B-DFlash2 (5120, 5, 8, 128), gpt-oss-20b-DFlash (2880, 8, 8, 64);
plus one ``context_kv_+hidden_norm`` table for Qwen3-8B (the RMSNorm of x before the GEMM, the
op's ``hidden_norm`` argument). x[T, H] @ w_kv[N, H]^T with N = L*2*Hkv*D (the stacked
layer-major weight, randn * H**-0.5, so K/V values are ~N(0, 1)), K RMSNorm with k_weight[L, D]
(1 + 0.5 * randn), NeoX RoPE over the whole head, eps 1e-6, no bias; every layer's K and V
written into L vLLM-style [num_blocks, 2, 16, Hkv, D] caches (K = [:, 0], V = [:, 1]) at a
prefill's slots (shuffled blocks, consecutive rows; the store_kv_ layout). Columns:
* ``eager chain``: the unfused path as a vLLM engine runs it in eager PyTorch (``_kv_chain``):
  (hidden RMSNorm,) F.linear, view [T, L, 2, Hkv, D], K permuted to [L, T, Hkv, D] contiguous
  (one block per layer), per-layer HF RMSNorm with k_weight[i], one NeoX RoPE over all L*T rows
  (positions repeated per layer, fp32 math, cos/sin gathered from the table), then per layer
  ``cache[:, 0][block, row] = k_i`` and ``cache[:, 1][block, row] = v_i`` (index_put). Timed
  twice: CUDA-graph replay like every column, and ``eager chain (events, no graph)``: per-call
  CUDA events (do_bench), where the host's launch gaps count, what an eager server pays.
* ``compiled chain``: ``torch.compile(_kv_chain, dynamic=False)`` (the in-place index_put into
  the caches compiled as is, like the store_kv_ table's compiled column), graph-captured; one
  compile per shape, so left out under ``--quick`` unless ``--compiled-chain`` (and out of a
  full run with ``--no-compiled-chain``). Its note gives the compile + first-call seconds.
* ``F.linear``: cuBLAS ``F.linear(x, w_kv)`` alone, the GEMM baseline (checked for its shape
  only; it writes no cache).
* ``ours unfused``: ``kv_proj`` + ``knorm_rope_`` on kv.view(T, L, 2, Hkv, D)[:, :, 0] +
  ``store_kv_`` (default backends, named in the column).
* ``context_kv_ triton`` / ``context_kv_ cuda``: the fused op with that backend forced (n/a when
  the backend lacks it).
* ``floor`` = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate) of this run (``measure_floors``);
  FLOPs = 2*T*H*N; bytes = 2*(T*H + N*H + T*N) (bf16: x read once, w_kv read once, the T*N K/V
  values written once, into the caches; the kv intermediate of an unfused chain is not counted,
  it is what fusion saves) + T*(4*D + 16) (a fp32 cos/sin row, a position and a slot per token)
  + 2*L*D (k_weight) (+ 2*H hidden_norm weight). Besides ``x floor`` every row has
  ``x F.linear`` (time / the F.linear column's time of that T).
Checks: every column but F.linear runs once on clones of the first input set and its caches are
compared with those of the torch reference (``context_kv_ref``: fp32 GEMM rounded to bf16) over
the whole caches: max abs error <= 0.05 * max |reference| for the K caches and for the V caches
(see ``CTX_TOL``). Inputs: (x, w_kv) rotate over 2-3 sets (``rotating``'s rule, >= 2x L2: w_kv
alone is 47-105 MB, gpt-oss's and Qwen3-4B's fit or nearly fit in the H200's 50 MB L2, so the
weight rotates too; at most 2 x 168 MB of x and 2 x 105 MB of w_kv at T = 16384), sharing one
set of caches (disjoint slots per set, as in the store_kv_ table).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from ..ops.context import context_kv_ref
from ..ops.rope import make_cos_sin_cache
from .columns import Impl, compile_static, forced, measure, msg
from .context_ops import (BLOCK_SIZE, DEVICE, EPS, GRAPH, MAX_POS, cache_views, chain_name,
                          n_sets, random_positions, rnd, shared_caches)
from .harness import Results, floor_us

# the context_kv_ tables; name: (H, L, Hkv, D)
CTX_MODELS = {"Qwen3-8B": (4096, 5, 8, 128), "Qwen3-4B": (2560, 5, 8, 128),
              "Qwen3.8-27B-DFlash2": (5120, 5, 8, 128), "gpt-oss-20b-DFlash": (2880, 8, 8, 64)}
HN_MODEL = "Qwen3-8B"  # the one context_kv_ table with hidden_norm

# context_kv_ check, K and V caches each: max abs err <= CTX_TOL * max |reference|. 0.05 is ~6.4
# bf16 ulps of the largest value. V is one GEMM rounding, but cuBLAS may reduce split-K partials
# in bf16 (torch's allow_bf16_reduced_precision_reduction is on by default), an ulp or so more.
# K is rounded to bf16 up to four times (GEMM output, normed, times k_weight, rotated), each of
# which a backend may round the other way (or, fused/compiled, not at all), and the rotation
# adds the errors of two such values. A layout error (wrong slot, layer, head or K/V half, a
# missing norm or rotation) is an error of the order of the values themselves, >= ~20x this.
CTX_TOL = 0.05


def _hf_rms_norm(x, w):
    """HF rounding: T(x.float() * rsqrt(mean(x^2) + eps)) * w, over the last dim."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def _kv_chain(x, w_kv, k_weight, positions, cos_sin_cache, slots, bufs, hn_weight,
              n_layers: int, hkv: int, d: int):
    """The context K/V path as a vLLM engine runs it unfused, in plain PyTorch: (hidden norm,) one
    stacked GEMM, per-layer K norm, one RoPE over every layer's K, per-layer cache writes.
    ``bufs``: L tensors [num_blocks, 2, 16, Hkv, D] (K = [:, 0], V = [:, 1]), written in place."""
    t = x.shape[0]
    if hn_weight is not None:
        x = _hf_rms_norm(x, hn_weight)
    kv = F.linear(x, w_kv).view(t, n_layers, 2, hkv, d)
    k = kv[:, :, 0].permute(1, 0, 2, 3).contiguous()  # [L, T, Hkv, D]: one K block per layer
    k = torch.cat([_hf_rms_norm(k[i], k_weight[i]) for i in range(n_layers)])  # [L*T, Hkv, D]
    cs = cos_sin_cache[positions.repeat(n_layers)]  # NeoX, rotary over the whole head
    half = cs.shape[1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    kf = k.float()
    k1, k2 = kf[..., :half], kf[..., half:]
    k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1).to(x.dtype)
    k = k.view(n_layers, t, hkv, d)
    blk, row = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for i, b in enumerate(bufs):  # one cache write per layer (reshape_and_cache's torch form)
        b[:, 0][blk, row] = k[i]
        b[:, 1][blk, row] = kv[:, i, 1]


def _ctx_impls(n_layers, hkv, d, k_weight, cache, hn, compiled_skip):
    """(the reference, the columns) of a context_kv_ table; a set is (x, w_kv, positions, slots,
    *L caches); every fn returns the caches it wrote (the GEMM baseline: its output). ``ref`` None
    marks the GEMM baseline (shape check only); ``compiled_skip``: why the compiled
    chain is left out (None: it runs)."""
    def ref(x, w, pos, slots, *bufs):
        context_kv_ref(x, w, None, k_weight, pos, cache, slots, *cache_views(bufs), EPS, True, hn)
        return bufs

    def eager(x, w, pos, slots, *bufs):
        _kv_chain(x, w, k_weight, pos, cache, slots, bufs, hn, n_layers, hkv, d)
        return bufs

    compiled = compile_static(_kv_chain)

    def comp(x, w, pos, slots, *bufs):
        compiled(x, w, k_weight, pos, cache, slots, list(bufs), hn, n_layers, hkv, d)
        return bufs

    def gemm(x, w, pos, slots, *bufs):
        return F.linear(x, w)

    def unfused(x, w, pos, slots, *bufs):
        if hn is not None:
            x = torch.ops.dflash.rms_norm.default(x, hn, EPS)
        kv = torch.ops.dflash.kv_proj.default(x, w, None).view(x.shape[0], n_layers, 2, hkv, d)
        torch.ops.dflash.knorm_rope_.default(kv[:, :, 0], k_weight, pos, cache, EPS, True)
        torch.ops.dflash.store_kv_.default(kv[:, :, 0], kv[:, :, 1], *cache_views(bufs), slots)
        return bufs

    def ours(x, w, pos, slots, *bufs):
        torch.ops.dflash.context_kv_.default(x, w, None, k_weight, pos, cache, slots,
                                             *cache_views(bufs), EPS, True, hn)
        return bufs

    op = "context_kv_"
    chain = ("rms_norm",) * (hn is not None) + ("kv_proj", "knorm_rope_", "store_kv_")
    return ref, [Impl("eager chain", eager, ref),
                 Impl("eager chain (events, no graph)", eager, ref, graph=False),
                 Impl("compiled chain", comp, ref, missing=compiled_skip),
                 Impl("F.linear (cuBLAS GEMM alone, baseline)", gemm, None),
                 Impl(f"ours unfused: {chain_name(*chain)}", unfused, ref),
                 forced(op, "triton", ours, ref, name="context_kv_ triton"),
                 forced(op, "cuda", ours, ref, name="context_kv_ cuda")]


def _ctx_sets(t, h, w, n_layers, hkv, d):
    """Sets (x[T, H], w_kv, positions[T], slots[T], *L caches): x and w_kv rotate (w_kv: the
    same values, one copy a set; it is most of the bytes at small T and 47-105 MB, so one copy
    would sit (partly) in L2), the caches are shared, each set writing its own prefill's slots."""
    n = n_sets((t * h + w.numel()) * w.element_size())
    bufs, slots = shared_caches(n, t, n_layers, hkv, d)
    return [(rnd(t, h), w if j == 0 else w.clone(), random_positions(t), slots[j], *bufs)
            for j in range(n)]


def _ctx_check(impl: Impl, args, want, shape) -> tuple:
    """(err, why wrong or None) of one call of ``impl.fn`` on ``args`` (fresh clones): the
    whole K and V caches against ``want`` (the reference's caches), max abs err <= CTX_TOL *
    max |ref| each; the GEMM baseline (``ref`` None): its output's shape only."""
    out = impl.fn(*args)
    if impl.ref is None:
        got = tuple(out.shape)
        return 0.0, None if got == shape else f"shape {list(got)} != {list(shape)}"
    err, why = 0.0, None
    for part, name in ((0, "K"), (1, "V")):
        e = max((g[:, part].float() - r[:, part].float()).abs().max().item()
                for g, r in zip(args[4:], want))
        scale = max(r[:, part].float().abs().max().item() for r in want)
        err = e if e != e else max(err, e)  # keep a NaN
        if not e <= CTX_TOL * scale:
            why = why or f"{name} caches: max abs err {e:.3g} > tol {CTX_TOL * scale:.3g}"
    return err, why


_EVENTS_NOTE = "per-call CUDA events (do_bench), no graph: the host's launch gaps count"


def _ctx_table(res: Results, title: str, ref, impls, cases, timing: dict, n: int) -> None:
    """One context_kv_ table. cases: (T, build_sets(), bytes, FLOPs). Per case: the reference
    once on clones of the first set, every column checked (``_ctx_check``) then timed with
    ``columns.measure`` (graph replay, events where capture fails or the column opts out);
    rows get ``x F.linear``; then the floor row, max(bytes / copy, FLOPs / GEMM rate)."""
    progress = f"[context_kv] {title.split(' ')[0]}"
    for t, build_sets, moved, flops in cases:
        sets = build_sets()
        pristine = tuple(a.clone() for a in sets[0])
        fresh = lambda p=pristine: tuple(a.clone() for a in p)  # noqa: E731
        want = ref(*fresh())  # the reference's caches (context_kv_ref, fp32 GEMM; it syncs)
        floor = floor_us(res.floors, moved, flops)
        rows = []
        for impl in impls:
            err, note, tm = None, impl.missing or "", None
            if not impl.missing:
                with impl.ctx():
                    try:
                        t0 = time.perf_counter()
                        err, why = _ctx_check(impl, fresh(), want, (t, n))
                        first_s = time.perf_counter() - t0
                    except Exception as e:  # noqa: BLE001 - a broken column is reported
                        why = f"failed: {msg(e)}"
                if why:
                    note = why if why.startswith("failed") else f"WRONG: {why}; not timed"
                else:
                    tm, note, _ = measure(Impl(impl.name, impl.fn, None, impl.ctx,
                                               graph=impl.graph), sets, (), timing, graph=GRAPH)
                    if impl.graph is False and tm:
                        note = _EVENTS_NOTE
                    if impl.name == "compiled chain":
                        note = "; ".join(x for x in (note, f"compile + first call "
                                                           f"{first_s:.1f} s") if x)
            rows.append((impl, tm, note, err))
            us = f"{tm['us']:.2f} us ({tm['mode']})" if tm else "n/a"
            print(f"{progress} T={t} {impl.name}: {us} {note}", file=sys.stderr, flush=True)
        base = next((tm["us"] for impl, tm, _, _ in rows if impl.ref is None and tm), None)
        for impl, tm, note, err in rows:
            xf = tm["us"] / base if tm and base else None
            res.add_time(title, f"T={t}", impl.name, tm, bytes_moved=moved, floor=floor,
                         **{"x F.linear": xf}, err=err, note=note, x=t)
        bound = "FLOPs/GEMM" if floor > floor_us(res.floors, moved) else "bytes/copy"
        res.add_time(title, f"T={t}", "floor", {"us": floor, "mode": bound}, bytes_moved=moved,
                     floor=floor, x=t)
        del sets, pristine, fresh, want, rows
        torch.cuda.empty_cache()


def ctx_tables(res: Results, model: str, ts, timing: dict, hidden_norm: bool,
               compiled_chain: bool) -> None:
    """The context_kv_ table of ``model`` (``hidden_norm``: the table with the hidden RMSNorm);
    ``compiled_chain``: run the compiled-chain column (one torch.compile per T)."""
    h, n_layers, hkv, d = CTX_MODELS[model]
    n = n_layers * 2 * hkv * d
    skip = None if compiled_chain else \
        "skipped (one torch.compile per shape; --compiled-chain runs it, default unless --quick)"
    cache = make_cos_sin_cache(MAX_POS, d, device=DEVICE)
    w = rnd(n, h) * h ** -0.5  # K/V values ~N(0, 1)
    k_weight = 1 + 0.5 * rnd(n_layers, d)
    hn = 1 + 0.5 * rnd(h) if hidden_norm else None
    cases = []
    for t in ts:
        moved = 2 * (t * h + n * h + t * n) + t * (4 * d + 16) + 2 * n_layers * d \
            + (2 * h if hidden_norm else 0)
        cases.append((t, lambda t=t: _ctx_sets(t, h, w, n_layers, hkv, d), moved, 2 * t * h * n))
    name = "context_kv_+hidden_norm" if hidden_norm else "context_kv_"
    title = (f"{name} {model}: x[T,{h}] @ w_kv[{n},{h}]^T -> K-norm + RoPE -> {n_layers} x "
             f"[blocks,2,{BLOCK_SIZE},{hkv},{d}] caches, bf16 (CUDA-graph replay; the 'events, "
             f"no graph' row: eager)")
    _ctx_table(res, title, *_ctx_impls(n_layers, hkv, d, k_weight, cache, hn, skip), cases,
               timing, n)


CTX_NOTES = [
    "context_kv_: floor = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both "
    "measured in this run; FLOPs = 2*T*H*N, N = L*2*Hkv*D; bytes = 2*(T*H + N*H + T*N) "
    "(x and w_kv read once, K/V written once into the caches; an unfused chain's kv "
    "intermediate is not counted) + T*(4*D + 16) + 2*L*D (+ 2*H with hidden_norm); the "
    "floor row's timing says which bound; x F.linear = us / the cuBLAS F.linear row's us",
    "context_kv_ inputs: x randn, w_kv randn * H**-0.5 (K/V ~N(0, 1)), k_weight and the "
    "hidden_norm weight 1 + 0.5 * randn; (x, w_kv) rotate over 2-3 sets (>= 2x L2; the "
    "weight too: 47-105 MB, near the L2 size), all sets share one set of caches",
    "context_kv_ check: every column runs once on clones of the first set; the whole K "
    "and the whole V caches are compared with the torch reference's (context_kv_ref, "
    "fp32 GEMM): max abs err <= 0.05 * max |ref| each (~6 bf16 ulps of the largest "
    "value: K is rounded up to 4 times, each backend may round otherwise; cuBLAS may "
    "reduce split-K in bf16); F.linear: its output shape only",
    "eager chain: (hidden RMSNorm,) F.linear, K permuted to [L, T, Hkv, D] contiguous, "
    "per-layer HF RMSNorm, one NeoX RoPE over all L*T rows (fp32, cos/sin gathered at "
    "positions.repeat(L)), per layer index_put of K and V (vLLM's unfused path); timed "
    "with graph replay and, '(events, no graph)', per call with CUDA events (do_bench, "
    "L2 wiped before each call), which includes the host's launch gaps as an eager "
    "server pays them; compiled chain: torch.compile(dynamic=False) of the same function "
    "(in-place index_put compiled as is), graph-captured",
    "ours unfused: our kv_proj, knorm_rope_ and store_kv_ with their default backends "
    "(in brackets); context_kv_ triton / cuda: the fused op with that backend forced",
]
