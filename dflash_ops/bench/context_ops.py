"""The standalone-op tables of the context K/V suite (``bench.context_kv``): ``knorm_rope_``,
``qk_norm_rope_``, ``qk_norm_rope_store_`` and ``store_kv_``, our backends against the
baselines, and the inputs the context_kv_ tables share (caches, slots, positions).

Shapes: the Qwen3-8B drafter (L 5, Hkv 8, D 128) and gpt-oss-20b-DFlash (L 8, Hkv 8, D 64); the
QKV buffer has Hq = 32 for both; T = 1 ... 16384 tokens; bf16; NeoX rotary over the whole head,
positions a contiguous run (a prefill chunk) at a random offset of a 32768-row fp32 cos/sin table.

Tables, one per op and model:
* ``knorm_rope_`` in place on k = kv[:, :, 0] of the K/V GEMM output [T, L, 2, Hkv, D], wk[L, D].
* ``qk_norm_rope_`` in place on the q and k slices of a fused QKV output [T, (Hq + 2*Hkv) * D].
* ``qk_norm_rope_store_`` (a decoder layer's step after its QKV GEMM): q in place, k normed and
  rotated and v into one layer's cache [num_blocks, 2, 16, Hkv, D], against the chain of
  ``qk_norm_rope_`` + ``store_kv_`` it replaces.
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
positions, weights); qk_norm_rope_ T*(Hq + Hkv)*D in and out (+ the same extras);
qk_norm_rope_store_ T*(Hq + 2*Hkv)*D in and out (+ the extras and slots); store_kv_ reads
2*T*L*Hkv*D and writes as many (+ slots).
"""
from __future__ import annotations

import math

import torch

from .. import dispatch
from ..ops.kv import store_kv_ref
from ..ops.norm import rms_norm_ref
from ..ops.rope import make_cos_sin_cache, rope_values
from .columns import Impl, compile_static, forced, msg, table
from .harness import Results, l2_bytes, rotating

EPS = 1e-6
HQ = 32
BLOCK_SIZE = 16
MAX_POS = 32768
MODELS = {"Qwen3-8B": (5, 8, 128), "gpt-oss-20b-DFlash": (8, 8, 64)}  # name: (L, Hkv, D)
GRAPH = True  # CUDA-graph replay at every size, as the norm suite (launch-bound small T)
BF16 = torch.bfloat16
DEVICE = "cuda"


def rnd(*shape):
    return torch.randn(*shape, dtype=BF16, device=DEVICE)  # never zeros


def random_positions(t: int) -> torch.Tensor:
    """A contiguous run of ``t`` positions (a prefill chunk) at a random offset."""
    start = int(torch.randint(0, MAX_POS - t + 1, (1,)))
    return torch.arange(start, start + t, dtype=torch.int64, device=DEVICE)


def n_sets(set_bytes: int) -> int:
    """How many sets ``harness.rotating`` would make: together 2x L2, 2 to 1024."""
    return min(max(math.ceil(2.0 * l2_bytes() / max(1, set_bytes)), 2), 1024)


def shared_caches(n: int, t: int, n_layers: int, hkv: int, d: int):
    """(L caches [num_blocks, 2, 16, Hkv, D], n slot vectors [T]): each vector a prefill's slots
    (consecutive rows of its own shuffled blocks), disjoint from the others'."""
    n_blk = -(-t // BLOCK_SIZE)
    nb = n * n_blk + 2
    bufs = tuple(rnd(nb, 2, BLOCK_SIZE, hkv, d) for _ in range(n_layers))
    perm = torch.randperm(nb, device=DEVICE)
    i = torch.arange(t, device=DEVICE)
    slots = [perm[j * n_blk:(j + 1) * n_blk][i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE
             for j in range(n)]
    return bufs, slots


def cache_views(bufs):
    """(K cache views, V cache views) of L [num_blocks, 2, 16, Hkv, D] tensors."""
    return [b[:, 0] for b in bufs], [b[:, 1] for b in bufs]


def split_qkv(qkv, hkv, d):
    """The q [T, Hq, D] and k [T, Hkv, D] slices of qkv [T, (Hq + 2*Hkv) * D]."""
    x = qkv.view(qkv.shape[0], HQ + 2 * hkv, d)
    return x[:, :HQ], x[:, HQ:HQ + hkv]


def chain_name(*ops) -> str:
    """``op[backend] + ...``: a chain of our ops and the backend each resolves to."""
    return " + ".join(f"{op}[{dispatch.resolve(op)}]" for op in ops)


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
            Impl(f"unfused: {chain_name('rms_norm', 'rope_')}", chain, ref),
            Impl(f"vllm-style per layer: {n_layers} x ({chain_name('rms_norm', 'rope_')})",
                 per_layer, per_layer_ref),
            Impl("liger: reshape copy + RMSNorm + rope", liger, liger_ref, missing=why),
            Impl("copy (same bytes)", lambda kv, pos: kv[:, :, 0].clone(), None)]


# ----------------------------------------------------------------------------- qk_norm_rope_
def _qk_math(qkv, wq, wk, pos, cache, hkv: int, d: int):
    q, k = split_qkv(qkv, hkv, d)
    q.copy_(rope_values(rms_norm_ref(q, wq, EPS), pos, cache, True))
    k.copy_(rope_values(rms_norm_ref(k, wk, EPS), pos, cache, True))


def _qk_impls(hkv, d, wq, wk, cache):
    op = "qk_norm_rope_"
    ref_ = dispatch.ops()[op].impls["torch"]

    def ref(qkv, pos):
        q, k = split_qkv(qkv, hkv, d)
        ref_(q, k, wq, wk, pos, cache, EPS, True)
        return q, k

    def ours(qkv, pos):
        q, k = split_qkv(qkv, hkv, d)
        torch.ops.dflash.qk_norm_rope_.default(q, k, wq, wk, pos, cache, EPS, True)
        return q, k

    compiled = compile_static(_qk_math)

    def comp(qkv, pos):
        compiled(qkv, wq, wk, pos, cache, hkv, d)
        return split_qkv(qkv, hkv, d)

    def chain(qkv, pos):  # vLLM: q_norm, k_norm (out of place), then rotary on q and k
        q, k = split_qkv(qkv, hkv, d)
        qn = torch.ops.dflash.rms_norm.default(q, wq, EPS)
        kn = torch.ops.dflash.rms_norm.default(k, wk, EPS)
        torch.ops.dflash.rope_.default(qn, pos, cache, True)
        torch.ops.dflash.rope_.default(kn, pos, cache, True)
        return qn, kn

    rn, rp, why = _liger()

    def liger(qkv, pos):
        q, k = split_qkv(qkv, hkv, d)
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
def _store_index_put(kv, slots, bufs):
    """Per layer, K then V: ``cache[block, row] = x`` (index_put, no host sync; every slot valid)."""
    blk, row = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for i, b in enumerate(bufs):
        b[:, 0][blk, row] = kv[:, i, 0]
        b[:, 1][blk, row] = kv[:, i, 1]


def _store_impls():
    op = "store_kv_"

    def ref(kv, slots, *bufs):
        store_kv_ref(kv[:, :, 0], kv[:, :, 1], *cache_views(bufs), slots)
        return bufs

    def ours(kv, slots, *bufs):
        torch.ops.dflash.store_kv_.default(kv[:, :, 0], kv[:, :, 1], *cache_views(bufs), slots)
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


def _store_sets(t: int, n_layers: int, hkv: int, d: int, set_bytes: int) -> list:
    """Sets (kv[T, L, 2, Hkv, D], slots[T], *L caches [num_blocks, 2, 16, Hkv, D]) that share
    one set of caches, as a server has: each set writes a prefill's slots (consecutive rows of
    its own shuffled blocks) into a disjoint part of them. Shared caches also keep kernels that
    cache per-cache-set state (the Triton kernel's layer table) from rebuilding it in capture."""
    n = n_sets(set_bytes)
    bufs, slots = shared_caches(n, t, n_layers, hkv, d)
    return [(rnd(t, n_layers, 2, hkv, d), slots[j], *bufs) for j in range(n)]


# ----------------------------------------------------------------------------- qk_norm_rope_store_
def _qkrs_impls(hkv, d, wq, wk, cache):
    """A decoder layer's step after its QKV GEMM (models.layer): the fused op against the two
    launches it replaces (qk_norm_rope_ + store_kv_, what the layer ran before)."""
    op = "qk_norm_rope_store_"
    ref_ = dispatch.ops()[op].impls["torch"]

    def split(qkv):
        x = qkv.view(qkv.shape[0], HQ + 2 * hkv, d)
        return x[:, :HQ], x[:, HQ:HQ + hkv], x[:, HQ + hkv:]

    def ref(qkv, pos, slots, buf):
        q, k, v = split(qkv)
        ref_(q, k, v, wq, wk, pos, cache, EPS, True, buf[:, 0], buf[:, 1], slots)
        return q, buf

    def ours(qkv, pos, slots, buf):
        q, k, v = split(qkv)
        torch.ops.dflash.qk_norm_rope_store_.default(q, k, v, wq, wk, pos, cache, EPS, True,
                                                     buf[:, 0], buf[:, 1], slots)
        return q, buf

    def chain(qkv, pos, slots, buf):  # q and k normed and rotated in place, then the store
        q, k, v = split(qkv)
        torch.ops.dflash.qk_norm_rope_.default(q, k, wq, wk, pos, cache, EPS, True)
        torch.ops.dflash.store_kv_.default(k[:, None], v[:, None], [buf[:, 0]], [buf[:, 1]],
                                           slots)
        return q, buf

    eager = Impl("torch eager (reference; syncs)", ref, ref, graph=False)
    return [forced(op, "cuda", ours, ref), forced(op, "triton", ours, ref),
            Impl(chain_name("qk_norm_rope_", "store_kv_"), chain, ref), eager,
            Impl("copy (same bytes)", lambda qkv, pos, slots, buf: qkv.clone(), None)]


def _qkrs_sets(t: int, hkv: int, d: int, set_bytes: int) -> list:
    """Sets (qkv[T, (Hq + 2*Hkv) * D], positions[T], slots[T], one layer's cache [num_blocks, 2,
    16, Hkv, D]) sharing the cache, each writing a prefill's slots in its own part of it."""
    n = n_sets(set_bytes)
    bufs, slots = shared_caches(n, t, 1, hkv, d)
    return [(rnd(t, (HQ + 2 * hkv) * d), random_positions(t), slots[j], bufs[0])
            for j in range(n)]


# ----------------------------------------------------------------------------- tables
def _table(res: Results, title: str, impls, cases, timing: dict, exact: bool = False) -> None:
    """cases: (T, build_sets() -> the rotating input sets, bytes moved per call); ``exact``:
    outputs compared bit for bit (store_kv_)."""
    table(res, title, impls, cases, timing, progress=f"[context_kv] {title.split(' ')[0]}",
          graph=GRAPH, exact=exact)


def op_tables(res: Results, model: str, ts, timing: dict, tables) -> None:
    """The knorm_rope_, qk_norm_rope_ and store_kv_ tables of ``model`` (those in ``tables``)."""
    n_layers, hkv, d = MODELS[model]
    cache = make_cos_sin_cache(MAX_POS, d, device=DEVICE)
    extras = lambda t: t * d * 4 + t * 8  # noqa: E731 - a cos/sin row + a position a token
    # knorm_rope_
    w = 1 + 0.5 * rnd(n_layers, d)
    # Liger rotates q and k together: a zero 1-head k rides along (+ 1/(L*Hkv) bytes)
    dummy_k = torch.zeros(max(ts), 1, d, dtype=BF16, device=DEVICE)
    cases = []
    for t in ts:
        n = t * n_layers * hkv * d * 2
        make = lambda t=t: (rnd(t, n_layers, 2, hkv, d), random_positions(t))  # noqa: E731
        cases.append((t, lambda make=make, b=2 * n: rotating(make, b),
                      2 * n + extras(t) + w.nbytes))
    if "knorm_rope_" in tables:
        _table(res, f"knorm_rope_ {model}: k = kv[:,:,0] of [T,{n_layers},2,{hkv},{d}] "
                    f"bf16, wk[{n_layers},{d}]",
               _knorm_impls(n_layers, hkv, d, w, cache, dummy_k), cases, timing)
    # qk_norm_rope_
    wq, wk = 1 + 0.5 * rnd(d), 1 + 0.5 * rnd(d)
    cases = []
    for t in ts:
        n = t * (HQ + hkv) * d * 2
        make = lambda t=t: (rnd(t, (HQ + 2 * hkv) * d), random_positions(t))  # noqa: E731
        cases.append((t, lambda make=make, b=t * (HQ + 2 * hkv) * d * 2: rotating(make, b),
                      2 * n + extras(t) + 2 * wq.nbytes))
    if "qk_norm_rope_" in tables:
        _table(res, f"qk_norm_rope_ {model}: q,k slices of qkv[T,({HQ}+2*{hkv})*{d}] bf16",
               _qk_impls(hkv, d, wq, wk, cache), cases, timing)
    # qk_norm_rope_store_: reads q, k, v; writes q and the K/V rows
    cases = []
    for t in ts:
        n = t * (HQ + 2 * hkv) * d * 2
        cases.append((t, lambda t=t, b=n: _qkrs_sets(t, hkv, d, b),
                      2 * n + extras(t) + t * 8 + 2 * wq.nbytes))
    if "qk_norm_rope_store_" in tables:
        _table(res, f"qk_norm_rope_store_ {model}: q,k,v slices of qkv[T,({HQ}+2*{hkv})*{d}] "
                    f"bf16 -> [blocks,2,{BLOCK_SIZE},{hkv},{d}] (vLLM NHD)",
               _qkrs_impls(hkv, d, wq, wk, cache), cases, timing)
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


OP_NOTES = [
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
]
