"""Context K/V suite: ``knorm_rope_``, ``qk_norm_rope_`` and ``store_kv_`` standalone, and the
full context K/V path ``context_kv_`` (GEMM + K-norm + RoPE + paged cache writes), our backends
against the baselines.

Shapes of the standalone ops: the Qwen3-8B drafter (L 5, Hkv 8, D 128) and gpt-oss-20b-DFlash
(L 8, Hkv 8, D 64); the QKV buffer has Hq = 32 for both; T = 1 ... 16384 tokens; bf16; NeoX rotary
over the whole head, positions a contiguous run (a prefill chunk) at a random offset of a
32768-row fp32 cos/sin table.

Tables, one per op and model:
* ``knorm_rope_`` in place on k = kv[:, :, 0] of the K/V GEMM output [T, L, 2, Hkv, D], wk[L, D].
* ``qk_norm_rope_`` in place on the q and k slices of a fused QKV output [T, (Hq + 2*Hkv) * D].
* ``store_kv_`` of kv[:, :, 0] / kv[:, :, 1] into L caches [num_blocks, 16, Hkv, D], views of one
  vLLM-style [num_blocks, 2, 16, Hkv, D] tensor per layer; slots are a prefill's: shuffled blocks,
  consecutive rows (every slot valid).
Columns: our ``cuda`` and ``triton`` (n/a when the kernel is missing), the PyTorch reference eager,
torch.compile of it (in-place ops: a compiled function that does the out-of-place math and copies
back), unfused chains of our own kernels (what a serving engine runs: per-tensor RMSNorm + RoPE;
vLLM-style per-layer cache writes as index_put), Liger-Kernel (RMSNorm + LigerRopeFunction), a
copy of the same bytes, and the floor. Every column is checked against the reference on the
benchmark's own inputs before it is timed (store_kv_: bit-exact caches).

Bytes (the floor's numerator): knorm_rope_ reads and writes T*L*Hkv*D elements (+ T cos/sin rows,
positions, weights); qk_norm_rope_ T*(Hq + Hkv)*D in and out (+ the same extras); store_kv_ reads
2*T*L*Hkv*D and writes as many (+ slots).

``context_kv_`` tables (``_ctx_table``), one per model of ``CTX_MODELS`` (name: H, L, Hkv, D):
Qwen3-8B (4096, 5, 8, 128), Qwen3-4B (2560, 5, 8, 128), Qwen3.8-27B-DFlash2 (5120, 5, 8, 128),
gpt-oss-20b-DFlash (2880, 8, 8, 64); plus one ``context_kv_+hidden_norm`` table for Qwen3-8B at
QUICK_TS (the RMSNorm of x before the GEMM). x[T, H] @ w_kv[N, H]^T with N = L*2*Hkv*D (the
stacked layer-major weight, randn * H**-0.5, so K/V values are ~N(0, 1)), K RMSNorm with
k_weight[L, D] (1 + 0.5 * randn), NeoX RoPE over the whole head, eps 1e-6, no bias; every layer's
K and V written into L vLLM-style [num_blocks, 2, 16, Hkv, D] caches (K = [:, 0], V = [:, 1]) at a
prefill's slots (shuffled blocks, consecutive rows; the store_kv_ layout). Columns:
* ``eager chain``: the unfused path as a vLLM engine runs it in eager PyTorch (``_kv_chain``):
  (hidden RMSNorm,) F.linear, view [T, L, 2, Hkv, D], K permuted to [L, T, Hkv, D] contiguous
  (one block per layer), per-layer HF RMSNorm with k_weight[i], one NeoX RoPE over all L*T rows
  (positions repeated per layer, fp32 math, cos/sin gathered from the table), then per layer
  ``cache[:, 0][block, row] = k_i`` and ``cache[:, 1][block, row] = v_i`` (index_put). Timed
  twice: CUDA-graph replay like every column, and ``eager chain (events, no graph)``: per-call
  CUDA events (do_bench), where the host's launch gaps count, what an eager server pays.
* ``compiled chain``: ``torch.compile(_kv_chain, dynamic=False)`` (the in-place index_put into
  the caches compiled as is, like the store_kv_ table's compiled column), graph-captured;
  skipped under ``--quick`` (one compile per shape; ``DFLASH_OPS_BENCH_COMPILE=1`` keeps it,
  ``=0`` drops it from a full run too). Its note gives the compile + first-call seconds.
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
  ``x F.linear`` (time / the F.linear column's time of that T). Targets (the issue):
  context_kv_ <= 1.1x F.linear and <= 1.3x floor; the eager chain >= 10x slower at T <= 256.
Checks: every column but F.linear runs once on clones of the first input set and its caches are
compared with those of the torch reference (``context_kv_ref``: fp32 GEMM rounded to bf16) over
the whole caches: max abs error <= 0.05 * max |reference| for the K caches and for the V caches
(see ``CTX_TOL``). Inputs: (x, w_kv) rotate over 2-3 sets (``rotating``'s rule, >= 2x L2: w_kv
alone is 47-105 MB, gpt-oss's and Qwen3-4B's fit or nearly fit in the H200's 50 MB L2, so the
weight rotates too; at most 2 x 168 MB of x and 2 x 105 MB of w_kv at T = 16384), sharing one
set of caches (disjoint slots per set, as in the store_kv_ table).

The host-overhead table (Qwen3-8B shapes, T = 16) has a context_kv_ row per backend too (H =
4096; not the torch reference, which synchronises).

``DFLASH_OPS_BENCH_MODELS`` (comma-separated names of ``MODELS`` / ``CTX_MODELS``) restricts the
models and ``DFLASH_OPS_BENCH_TABLES`` (comma-separated names of ``TABLES``: knorm_rope_,
qk_norm_rope_, store_kv_, context_kv_, context_kv_hidden_norm, host) the tables; the results of
a restricted run are written as ``context_kv-<models>[-<tables>].md/.json/.png`` (e.g.
``context_kv-Qwen3-8B.md``; ``context_kv-Qwen3-8B-context_kv_.md`` with
``DFLASH_OPS_BENCH_TABLES=context_kv_``), so a partial run never overwrites a fuller one.
``benchmarks/bench_context_kv.py --models ... --tables ...`` sets both.

Run time on the H200 (estimates; the context_kv_ tables have not been run yet): the standalone
tables and the host table of both models ~10 minutes, ``--quick`` ~half. The context_kv_ tables
in a full run: ~2-4 minutes a model (7 T x 7 columns, ~2 s a T for the timing at T <= 1024; at
T = 16384 ``ours unfused`` with the torch kv_proj default runs an fp32 GEMM, ~30 ms a call, ~15 s
of timing; first Triton JIT compiles; and the compiled chain, one torch.compile per T, guessed at
10-25 s each, the largest part), so ~10-17 minutes for the four models and the hidden_norm
table (4 T); ``--quick`` (4 T, no compiled chain, shorter timing) ~1 minute a model. Memory: at
most ~5 GB at T = 16384 (rotating sets, the caches, a pristine copy, the reference's caches and
its fp32 GEMM, one column's copy).
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from .. import dispatch
from ..ops.kv import context_kv_ref, store_kv_ref
from ..ops.norm import rms_norm_ref
from ..ops.rope import make_cos_sin_cache, rope_values
from .columns import Impl, compile_static, forced, host_table, measure, msg, table
from .harness import Results, floor_us, l2_bytes, measure_floors, rotating

EPS = 1e-6
HQ = 32
BLOCK_SIZE = 16
MAX_POS = 32768
MODELS = {"Qwen3-8B": (5, 8, 128), "gpt-oss-20b-DFlash": (8, 8, 64)}  # name: (L, Hkv, D)
# the context_kv_ tables; name: (H, L, Hkv, D)
CTX_MODELS = {"Qwen3-8B": (4096, 5, 8, 128), "Qwen3-4B": (2560, 5, 8, 128),
              "Qwen3.8-27B-DFlash2": (5120, 5, 8, 128), "gpt-oss-20b-DFlash": (2880, 8, 8, 64)}
HN_MODEL = "Qwen3-8B"  # the one context_kv_ table with hidden_norm (at QUICK_TS)
TABLES = ("knorm_rope_", "qk_norm_rope_", "store_kv_", "context_kv_", "context_kv_hidden_norm",
          "host")
TS = (1, 16, 64, 256, 1024, 4096, 16384)
QUICK_TS = (1, 256, 4096, 16384)
GRAPH = True  # CUDA-graph replay at every size, as the norm suite (launch-bound small T)
# context_kv_ check, K and V caches each: max abs err <= CTX_TOL * max |reference|. 0.05 is ~6.4
# bf16 ulps of the largest value. V is one GEMM rounding, but cuBLAS may reduce split-K partials
# in bf16 (torch's allow_bf16_reduced_precision_reduction is on by default), an ulp or so more.
# K is rounded to bf16 up to four times (GEMM output, normed, times k_weight, rotated), each of
# which a backend may round the other way (or, fused/compiled, not at all), and the rotation
# adds the errors of two such values. A layout error (wrong slot, layer, head or K/V half, a
# missing norm or rotation) is an error of the order of the values themselves, >= ~20x this.
CTX_TOL = 0.05
BF16 = torch.bfloat16
DEVICE = "cuda"


def _env_list(var: str, known, what: str) -> list:
    want = [m.strip() for m in os.environ.get(var, "").split(",") if m.strip()]
    unknown = [m for m in want if m not in known]
    if unknown:
        raise ValueError(f"{var}: unknown {unknown}; {what} are {list(known)}")
    return [m for m in known if m in want] if want else list(known)


def _models() -> list:
    """Model names of ``DFLASH_OPS_BENCH_MODELS`` (default all of MODELS and CTX_MODELS)."""
    return _env_list("DFLASH_OPS_BENCH_MODELS", dict.fromkeys([*MODELS, *CTX_MODELS]), "models")


def _tables() -> list:
    """Table names of ``DFLASH_OPS_BENCH_TABLES`` (default all of TABLES)."""
    return _env_list("DFLASH_OPS_BENCH_TABLES", TABLES, "tables")


def _rnd(*shape):
    return torch.randn(*shape, dtype=BF16, device=DEVICE)  # never zeros


def _positions(t: int) -> torch.Tensor:
    start = int(torch.randint(0, MAX_POS - t + 1, (1,)))
    return torch.arange(start, start + t, dtype=torch.int64, device=DEVICE)


def _liger():
    """(LigerRMSNormFunction.apply, LigerRopeFunction.apply, why missing)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as RN
        from liger_kernel.ops.rope import LigerRopeFunction as RP
        return RN.apply, RP.apply, None
    except Exception as e:  # noqa: BLE001 - not installed, or an import-time failure
        return None, None, f"liger-kernel unavailable ({msg(e)})"


def _liger_rope(rope, q, k, cache, pos):
    """Liger's NeoX rope on q[T, Hq, D] and k[T, Hkv, D], both contiguous: viewed as [1, H, T, D]
    (its layout; contiguous after its internal transpose, so no copy), rotated in place. cos/sin:
    the table rows gathered per token, first R/2 columns each (rotary_dim = R passed)."""
    t, d = q.shape[0], q.shape[-1]
    r = cache.shape[1]
    cs = cache[pos]
    qo, ko = rope(q.view(1, t, -1, d).transpose(1, 2), k.view(1, t, -1, d).transpose(1, 2),
                  cs[:, :r // 2], cs[:, r // 2:], None, 1, r)
    return qo.transpose(1, 2)[0], ko.transpose(1, 2)[0]


def _chain_name(*ops) -> str:
    return " + ".join(f"{op}[{dispatch.resolve(op)}]" for op in ops)


# ----------------------------------------------------------------------------- knorm_rope_
def _knorm_math(kv, w, pos, cache):
    """The reference's math, out of place, copied back into k = kv[:, :, 0] (for torch.compile)."""
    k = kv[:, :, 0]
    k.copy_(rope_values(rms_norm_ref(k, w, EPS), pos, cache, True))


def _knorm_impls(n_layers, hkv, d, w, cache, dummy_k):
    op = "knorm_rope_"
    ref_ = dispatch.ops()[op].impls["torch"]

    def ref(kv, pos):
        k = kv[:, :, 0]
        ref_(k, w, pos, cache, EPS, True)
        return k

    def ours(kv, pos):
        k = kv[:, :, 0]
        torch.ops.dflash.knorm_rope_.default(k, w, pos, cache, EPS, True)
        return k

    compiled = compile_static(_knorm_math)

    def comp(kv, pos):
        compiled(kv, w, pos, cache)
        return kv[:, :, 0]

    def chain(kv, pos):  # one batched norm (per-layer weight rows) + one rope over L*Hkv heads
        y = torch.ops.dflash.rms_norm.default(kv[:, :, 0], w, EPS).contiguous()
        torch.ops.dflash.rope_.default(y.view(y.shape[0], -1, d), pos, cache, True)
        return y

    def per_layer(kv, pos):  # vLLM's per-layer attention: k_norm, then rotary, layer by layer
        outs = []
        for i in range(n_layers):
            y = torch.ops.dflash.rms_norm.default(kv[:, i, 0], w[i], EPS)
            torch.ops.dflash.rope_.default(y, pos, cache, True)
            outs.append(y)
        return tuple(outs)

    def per_layer_ref(kv, pos):
        return tuple(ref(kv, pos).unbind(1))

    rn, rp, why = _liger()
    w0 = w[0].contiguous()  # Liger's RMSNorm takes one weight row: same bytes
    w0_all = w0.expand(n_layers, d)

    def liger(kv, pos):
        t = kv.shape[0]
        y = rn(kv[:, :, 0].reshape(-1, d), w0, EPS, 0.0, "llama", False)  # reshape: a copy
        yo, _ = _liger_rope(rp, y.view(t, -1, d), dummy_k[:t], cache, pos)
        return yo.reshape(t, n_layers, hkv, d)

    def liger_ref(kv, pos):
        k = kv[:, :, 0]
        ref_(k, w0_all, pos, cache, EPS, True)
        return k

    return [forced(op, "cuda", ours, ref), forced(op, "triton", ours, ref),
            Impl("torch eager", ref, ref), Impl("torch.compile", comp, ref),
            Impl(f"unfused: {_chain_name('rms_norm', 'rope_')}", chain, ref),
            Impl(f"vllm-style per layer: {n_layers} x ({_chain_name('rms_norm', 'rope_')})",
                 per_layer, per_layer_ref),
            Impl("liger: reshape copy + RMSNorm + rope", liger, liger_ref, missing=why),
            Impl("copy (same bytes)", lambda kv, pos: kv[:, :, 0].clone(), None)]


# ----------------------------------------------------------------------------- qk_norm_rope_
def _split_qkv(qkv, hkv, d):
    x = qkv.view(qkv.shape[0], HQ + 2 * hkv, d)
    return x[:, :HQ], x[:, HQ:HQ + hkv]


def _qk_math(qkv, wq, wk, pos, cache, hkv: int, d: int):
    q, k = _split_qkv(qkv, hkv, d)
    q.copy_(rope_values(rms_norm_ref(q, wq, EPS), pos, cache, True))
    k.copy_(rope_values(rms_norm_ref(k, wk, EPS), pos, cache, True))


def _qk_impls(hkv, d, wq, wk, cache):
    op = "qk_norm_rope_"
    ref_ = dispatch.ops()[op].impls["torch"]

    def ref(qkv, pos):
        q, k = _split_qkv(qkv, hkv, d)
        ref_(q, k, wq, wk, pos, cache, EPS, True)
        return q, k

    def ours(qkv, pos):
        q, k = _split_qkv(qkv, hkv, d)
        torch.ops.dflash.qk_norm_rope_.default(q, k, wq, wk, pos, cache, EPS, True)
        return q, k

    compiled = compile_static(_qk_math)

    def comp(qkv, pos):
        compiled(qkv, wq, wk, pos, cache, hkv, d)
        return _split_qkv(qkv, hkv, d)

    def chain(qkv, pos):  # vLLM: q_norm, k_norm (out of place), then rotary on q and k
        q, k = _split_qkv(qkv, hkv, d)
        qn = torch.ops.dflash.rms_norm.default(q, wq, EPS)
        kn = torch.ops.dflash.rms_norm.default(k, wk, EPS)
        torch.ops.dflash.rope_.default(qn, pos, cache, True)
        torch.ops.dflash.rope_.default(kn, pos, cache, True)
        return qn, kn

    rn, rp, why = _liger()

    def liger(qkv, pos):
        q, k = _split_qkv(qkv, hkv, d)
        qn = rn(q.reshape(-1, d), wq, EPS, 0.0, "llama", False)  # reshape: a copy (strided rows)
        kn = rn(k.reshape(-1, d), wk, EPS, 0.0, "llama", False)
        return _liger_rope(rp, qn.view(q.shape), kn.view(k.shape), cache, pos)

    return [forced(op, "cuda", ours, ref), forced(op, "triton", ours, ref),
            Impl("torch eager", ref, ref), Impl("torch.compile", comp, ref),
            Impl(f"vllm-style: 2 x rms_norm[{dispatch.resolve('rms_norm')}] + 2 x "
                 f"rope_[{dispatch.resolve('rope_')}]", chain, ref),
            Impl("liger: 2 x (reshape copy + RMSNorm) + rope(q, k)", liger, ref, missing=why),
            Impl("copy (same bytes)",
                 lambda qkv, pos: qkv[:, :(HQ + hkv) * d].clone(), None)]


# ----------------------------------------------------------------------------- store_kv_
def _caches(bufs):
    return [b[:, 0] for b in bufs], [b[:, 1] for b in bufs]


def _store_index_put(kv, slots, bufs):
    """Per layer, K then V: ``cache[block, row] = x`` (index_put, no host sync; every slot valid)."""
    blk, row = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for i, b in enumerate(bufs):
        b[:, 0][blk, row] = kv[:, i, 0]
        b[:, 1][blk, row] = kv[:, i, 1]


def _store_impls():
    op = "store_kv_"

    def ref(kv, slots, *bufs):
        store_kv_ref(kv[:, :, 0], kv[:, :, 1], *_caches(bufs), slots)
        return bufs

    def ours(kv, slots, *bufs):
        torch.ops.dflash.store_kv_.default(kv[:, :, 0], kv[:, :, 1], *_caches(bufs), slots)
        return bufs

    def index_put(kv, slots, *bufs):
        _store_index_put(kv, slots, bufs)
        return bufs

    compiled = compile_static(_store_index_put)

    def comp(kv, slots, *bufs):
        compiled(kv, slots, list(bufs))
        return bufs

    # boolean-mask indexing synchronises: not capturable, event timing
    eager = Impl("torch eager (reference; syncs)", ref, ref, graph=False)
    return [forced(op, "cuda", ours, ref), forced(op, "triton", ours, ref), eager,
            Impl("vllm-style: index_put per layer, K and V (eager)", index_put, ref),
            Impl("torch.compile(index_put per layer)", comp, ref),
            Impl("copy (same bytes)", lambda kv, slots, *bufs: kv.clone(), None)]


# ----------------------------------------------------------------------------- context_kv_
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
        context_kv_ref(x, w, None, k_weight, pos, cache, slots, *_caches(bufs), EPS, True, hn)
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
        torch.ops.dflash.store_kv_.default(kv[:, :, 0], kv[:, :, 1], *_caches(bufs), slots)
        return bufs

    def ours(x, w, pos, slots, *bufs):
        torch.ops.dflash.context_kv_.default(x, w, None, k_weight, pos, cache, slots,
                                             *_caches(bufs), EPS, True, hn)
        return bufs

    op = "context_kv_"
    chain = ("rms_norm",) * (hn is not None) + ("kv_proj", "knorm_rope_", "store_kv_")
    return ref, [Impl("eager chain", eager, ref),
                 Impl("eager chain (events, no graph)", eager, ref, graph=False),
                 Impl("compiled chain", comp, ref, missing=compiled_skip),
                 Impl("F.linear (cuBLAS GEMM alone, baseline)", gemm, None),
                 Impl(f"ours unfused: {_chain_name(*chain)}", unfused, ref),
                 forced(op, "triton", ours, ref, name="context_kv_ triton"),
                 forced(op, "cuda", ours, ref, name="context_kv_ cuda")]


def _ctx_sets(t, h, w, n_layers, hkv, d):
    """Sets (x[T, H], w_kv, positions[T], slots[T], *L caches): x and w_kv rotate (w_kv: the
    same values, one copy a set; it is most of the bytes at small T and 47-105 MB, so one copy
    would sit (partly) in L2), the caches are shared, each set writing its own prefill's slots."""
    n = _n_sets((t * h + w.numel()) * w.element_size())
    bufs, slots = _shared_caches(n, t, n_layers, hkv, d)
    return [(_rnd(t, h), w if j == 0 else w.clone(), _positions(t), slots[j], *bufs)
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


def _ctx_tables(res: Results, model: str, ts, timing: dict, quick: bool, hidden_norm: bool):
    """The context_kv_ table of ``model`` (``hidden_norm``: the table with the hidden RMSNorm)."""
    h, n_layers, hkv, d = CTX_MODELS[model]
    n = n_layers * 2 * hkv * d
    env = os.environ.get("DFLASH_OPS_BENCH_COMPILE", "").strip()
    skip = None
    if env == "0" or (quick and env != "1"):
        skip = ("skipped (--quick or DFLASH_OPS_BENCH_COMPILE=0: one torch.compile per shape; "
                "DFLASH_OPS_BENCH_COMPILE=1 keeps it)")
    cache = make_cos_sin_cache(MAX_POS, d, device=DEVICE)
    w = _rnd(n, h) * h ** -0.5  # K/V values ~N(0, 1)
    k_weight = 1 + 0.5 * _rnd(n_layers, d)
    hn = 1 + 0.5 * _rnd(h) if hidden_norm else None
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


# ----------------------------------------------------------------------------- measuring
def _table(res: Results, title: str, impls, cases, timing: dict, exact: bool = False) -> None:
    """cases: (T, build_sets() -> the rotating input sets, bytes moved per call); ``exact``:
    outputs compared bit for bit (store_kv_)."""
    table(res, title, impls, cases, timing, progress=f"[context_kv] {title.split(' ')[0]}",
          graph=GRAPH, exact=exact)


def _host_table(res: Results) -> None:
    """Host time per eager call of each op and backend, Qwen3-8B shapes at T = 16."""
    n_layers, hkv, d = MODELS["Qwen3-8B"]
    t = 16
    title = f"host overhead per eager call, T={t}, L={n_layers}, Hkv={hkv}, D={d} bf16"
    cache = make_cos_sin_cache(MAX_POS, d, device=DEVICE)
    pos = _positions(t)
    kv = _rnd(t, n_layers, 2, hkv, d)
    qkv = _rnd(t, (HQ + 2 * hkv) * d)
    q, k = _split_qkv(qkv, hkv, d)
    wk, wq, wk1 = 1 + 0.5 * _rnd(n_layers, d), 1 + 0.5 * _rnd(d), 1 + 0.5 * _rnd(d)
    bufs = [_rnd(2, 2, BLOCK_SIZE, hkv, d) for _ in range(n_layers)]
    kcs, vcs = _caches(bufs)
    slots = torch.randperm(2 * BLOCK_SIZE, device=DEVICE)[:t]
    calls = {
        "knorm_rope_": lambda: torch.ops.dflash.knorm_rope_.default(kv[:, :, 0], wk, pos, cache,
                                                                    EPS, True),
        "qk_norm_rope_": lambda: torch.ops.dflash.qk_norm_rope_.default(q, k, wq, wk1, pos, cache,
                                                                        EPS, True),
        "store_kv_": lambda: torch.ops.dflash.store_kv_.default(kv[:, :, 0], kv[:, :, 1], kcs,
                                                                vcs, slots),
    }
    # context_kv_ at the Qwen3-8B drafter's H (the GPU work does not matter, the host's does)
    h = CTX_MODELS["Qwen3-8B"][0]
    x, w_kv = _rnd(t, h), _rnd(n_layers * 2 * hkv * d, h) * h ** -0.5
    calls["context_kv_"] = lambda: torch.ops.dflash.context_kv_.default(
        x, w_kv, None, wk, pos, cache, slots, kcs, vcs, EPS, True, None)
    syncs = ("store_kv_", "context_kv_")  # their torch references synchronise
    rows = [Impl("(calibration) x.mul(2): one aten kernel", lambda: kv.mul(2), None)]
    for op, fn in calls.items():
        if not (op in syncs and dispatch.resolve(op) == "torch"):
            rows.append(Impl(f"dflash.{op} default ({dispatch.resolve(op)})", fn, None))
        for b in ("cuda", "triton", "torch"):
            if op in syncs and b == "torch":
                continue  # the reference synchronises: host time is then the GPU's
            rows.append(forced(op, b, fn, None, name=f"dflash.{op} {b}"))
    host_table(res, title, rows)


def _op_tables(res: Results, model: str, ts, timing: dict, tables) -> None:
    """The knorm_rope_, qk_norm_rope_ and store_kv_ tables of ``model`` (those in ``tables``)."""
    n_layers, hkv, d = MODELS[model]
    cache = make_cos_sin_cache(MAX_POS, d, device=DEVICE)
    extras = lambda t: t * d * 4 + t * 8  # noqa: E731 - a cos/sin row + a position a token
    # knorm_rope_
    w = 1 + 0.5 * _rnd(n_layers, d)
    # Liger rotates q and k together: a zero 1-head k rides along (+ 1/(L*Hkv) bytes)
    dummy_k = torch.zeros(max(ts), 1, d, dtype=BF16, device=DEVICE)
    cases = []
    for t in ts:
        n = t * n_layers * hkv * d * 2
        make = lambda t=t: (_rnd(t, n_layers, 2, hkv, d), _positions(t))  # noqa: E731
        cases.append((t, lambda make=make, b=2 * n: rotating(make, b),
                      2 * n + extras(t) + w.nbytes))
    if "knorm_rope_" in tables:
        _table(res, f"knorm_rope_ {model}: k = kv[:,:,0] of [T,{n_layers},2,{hkv},{d}] "
                    f"bf16, wk[{n_layers},{d}]",
               _knorm_impls(n_layers, hkv, d, w, cache, dummy_k), cases, timing)
    # qk_norm_rope_
    wq, wk = 1 + 0.5 * _rnd(d), 1 + 0.5 * _rnd(d)
    cases = []
    for t in ts:
        n = t * (HQ + hkv) * d * 2
        make = lambda t=t: (_rnd(t, (HQ + 2 * hkv) * d), _positions(t))  # noqa: E731
        cases.append((t, lambda make=make, b=t * (HQ + 2 * hkv) * d * 2: rotating(make, b),
                      2 * n + extras(t) + 2 * wq.nbytes))
    if "qk_norm_rope_" in tables:
        _table(res, f"qk_norm_rope_ {model}: q,k slices of qkv[T,({HQ}+2*{hkv})*{d}] bf16",
               _qk_impls(hkv, d, wq, wk, cache), cases, timing)
    # store_kv_
    cases = []
    for t in ts:
        n = 2 * t * n_layers * hkv * d * 2
        cases.append((t, lambda t=t, b=2 * n: _store_sets(t, n_layers, hkv, d, b),
                      2 * n + t * 8))
    if "store_kv_" in tables:
        _table(res, f"store_kv_ {model}: kv[T,{n_layers},2,{hkv},{d}] bf16 -> {n_layers} x "
                    f"[blocks,2,{BLOCK_SIZE},{hkv},{d}] (vLLM NHD)", _store_impls(), cases,
               timing, exact=True)


_OP_NOTES = [
    "floor = bytes read + written / copy bandwidth of this run; x floor = us / floor; "
    "copy (same bytes) = a clone of the input the op reads (the practical floor at that size)",
    "err = max abs error against the torch reference on the timed inputs (bf16; columns past "
    "2 bf16 ulps of the largest value are not timed); store_kv_: elements that differ (0)",
    "positions: a contiguous run at a random offset of a 32768-row fp32 cos/sin table; NeoX, "
    "rotary over the whole head; eps 1e-6; weights 1 + 0.5 * randn",
    "unfused / vllm-style rows chain our own rms_norm and rope_ kernels (the backend each "
    "resolves to is in brackets): the bytes of separate norm and rope passes, out of place "
    "like vLLM's q_norm/k_norm (the output is a fresh tensor, not written back)",
    "liger: LigerRMSNormFunction (casting_mode='llama', one weight row: liger has no "
    "per-layer weight, same bytes) then LigerRopeFunction (HF NeoX) on [1, H, T, D] views; "
    "strided q/k rows need a reshape copy first (its RMSNorm views rows as [-1, D]); cos/sin "
    "gathered per token (cache[pos], part of the timed call); knorm: a zero 1-head k rides "
    "along since Liger's rope rotates q and k together",
    "torch.compile: default mode, dynamic=False (one static compile per shape); in-place ops "
    "compile the reference math out of place plus a copy back into the view",
    "store_kv_ vllm-style: per layer cache[:, 0][block, row] = k and cache[:, 1][...] = v "
    "(2L index_put, what vLLM's torch fallback does; no -1 handling, the bench's slots are "
    "all valid); the torch reference masks -1 / out-of-range slots with boolean indexing, "
    "which synchronises, hence event timing",
    "host us: CPU time to issue one eager call while the GPU is kept busy (see "
    "dflash_ops.bench.harness.host_overhead_us)",
]
_CTX_NOTES = [
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


def run(quick: bool = False) -> Results:
    """Measure floors, then every table; returns the Results (the caller prints and writes)."""
    floors = measure_floors()
    models, tables = _models(), _tables()
    # a restricted run gets its own result files (context_kv-Qwen3-8B.md,
    # context_kv-Qwen3-8B-context_kv_.md, ...), never overwriting a fuller run's
    suffix = "" if len(models) == len(set(MODELS) | set(CTX_MODELS)) else "-" + "-".join(models)
    suffix += "" if len(tables) == len(TABLES) else "-" + "-".join(tables)
    res = Results("context_kv" + suffix, floors=floors)
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    ts = QUICK_TS if quick else TS
    with torch.no_grad():
        for model in models:
            if model in MODELS:
                _op_tables(res, model, ts, timing, tables)
            if model in CTX_MODELS and "context_kv_" in tables:
                _ctx_tables(res, model, ts, timing, quick, hidden_norm=False)
            if model == HN_MODEL and "context_kv_hidden_norm" in tables:
                _ctx_tables(res, model, QUICK_TS, timing, quick, hidden_norm=True)
        if "host" in tables:
            _host_table(res)
    res.notes += [
        "timing: median per call of CUDA-graph replays (>= 32 calls a graph) at every size; "
        "do_bench events only where capture fails or the column synchronises (said in the note); "
        "inputs rotate over sets totalling >= 2x L2 (<= 1024 sets)",
    ]
    if {"knorm_rope_", "qk_norm_rope_", "store_kv_", "host"} & set(tables):
        res.notes += _OP_NOTES
    if {"context_kv_", "context_kv_hidden_norm"} & set(tables):
        res.notes += _CTX_NOTES
    return res


def _n_sets(set_bytes: int) -> int:
    """How many sets ``harness.rotating`` would make: together 2x L2, 2 to 1024."""
    return min(max(math.ceil(2.0 * l2_bytes() / max(1, set_bytes)), 2), 1024)


def _shared_caches(n: int, t: int, n_layers: int, hkv: int, d: int):
    """(L caches [num_blocks, 2, 16, Hkv, D], n slot vectors [T]): each vector a prefill's slots
    (consecutive rows of its own shuffled blocks), disjoint from the others'."""
    n_blk = -(-t // BLOCK_SIZE)
    nb = n * n_blk + 2
    bufs = tuple(_rnd(nb, 2, BLOCK_SIZE, hkv, d) for _ in range(n_layers))
    perm = torch.randperm(nb, device=DEVICE)
    i = torch.arange(t, device=DEVICE)
    slots = [perm[j * n_blk:(j + 1) * n_blk][i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE
             for j in range(n)]
    return bufs, slots


def _store_sets(t: int, n_layers: int, hkv: int, d: int, set_bytes: int) -> list:
    """Sets (kv[T, L, 2, Hkv, D], slots[T], *L caches [num_blocks, 2, 16, Hkv, D]) that share
    one set of caches, as a server has: each set writes a prefill's slots (consecutive rows of
    its own shuffled blocks) into a disjoint part of them. Shared caches also keep kernels that
    cache per-cache-set state (the Triton kernel's layer table) from rebuilding it in capture."""
    n = _n_sets(set_bytes)
    bufs, slots = _shared_caches(n, t, n_layers, hkv, d)
    return [(_rnd(t, n_layers, 2, hkv, d), slots[j], *bufs) for j in range(n)]
