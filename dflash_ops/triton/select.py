"""Triton kernel of ``select_candidates`` (``ops/select.py``): DFlash 2's selector walk.

One program per request walks its J mask rows in order (each pick is the next row's
predecessor): it loads the predecessor's codebook row and the row's projected hidden state
(rank values each), the k candidates' successor rows (a [k, rank] tile), forms the k scores,
picks (greedy: the first maximum; sampled: softmax(score / T) and the first running sum past the
row's uniform) and writes q and the pick. Ids outside [0, V) read as zero rows. Grid (R,) from
the shapes only: graph-capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dispatch
from ._pdl import pdl_kwargs


@triton.jit
def _walk_kernel(unary_ptr, cand_ptr, hid_ptr, anchor_ptr, pred_ptr, succ_ptr, u_ptr, path_ptr,
                 q_ptr, J, K, RANK, V, temperature, SAMPLE: tl.constexpr, BK: tl.constexpr,
                 BR: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BK)
    d = tl.arange(0, BR)
    ik = i < K
    dk = d < RANK
    prev = tl.load(anchor_ptr + r)
    for j in range(J):
        row = r * J + j
        pd = d.to(tl.int64) * 0 + prev  # the predecessor as a vector (the interpreter takes
        okp = dk & (pd >= 0) & (pd < V)  # no scalar & vector mask)
        pv = tl.load(pred_ptr + tl.where(okp, pd, 0) * RANK + d, mask=okp, other=0.0)
        hv = tl.load(hid_ptr + row * RANK + d, mask=dk, other=0.0)
        qv = pv.to(tl.float32) * hv.to(tl.float32)
        c = tl.load(cand_ptr + row * K + i, mask=ik, other=0)
        okc = ik & (c >= 0) & (c < V)
        sv = tl.load(succ_ptr + tl.where(okc, c, 0)[:, None] * RANK + d[None, :],
                     mask=okc[:, None] & dk[None, :], other=0.0).to(tl.float32)
        un = tl.load(unary_ptr + row * K + i, mask=ik, other=0.0).to(tl.float32)
        score = tl.where(ik, un + tl.sum(sv * qv[None, :], axis=1), float("-inf"))
        if SAMPLE:
            s = score / temperature
            e = tl.where(ik, tl.exp(s - tl.max(s, axis=0)), 0.0)
            q = e / tl.sum(e, axis=0)
            cdf = tl.cumsum(q, axis=0)
            total = tl.sum(q, axis=0)
            over = (cdf > tl.load(u_ptr + row) * total) & ik
            pick = tl.min(tl.where(over, i, BK), axis=0)
            pick = tl.where(pick < K, pick, K - 1)
        else:
            # the first NaN if the row has one (torch.argmax's rule), else the first maximum
            nan = (score != score) & ik
            best = tl.max(tl.where(nan, float("-inf"), score), axis=0)
            hit = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, nan, (score == best) & ik)
            pick = tl.min(tl.where(hit, i, BK), axis=0)
            q = tl.where(i == pick, 1.0, 0.0)
        tl.store(q_ptr + row * K + i, q, mask=ik)
        prev = tl.sum(tl.where(i == pick, c, 0), axis=0)
        tl.store(path_ptr + row, prev)


def select_candidates(unary, cand, hidden, anchor, pred, succ, temperature: float, u=None):
    r, j, k = unary.shape
    path = torch.empty((r, j), dtype=torch.long, device=unary.device)
    q = torch.empty((r, j, k), dtype=torch.float32, device=unary.device)
    if r == 0 or j == 0 or k == 0:
        return path, q
    rank = pred.shape[1]
    sample = temperature > 0
    _walk_kernel[(r,)](unary, cand, hidden, anchor, pred, succ, u if sample else unary, path, q,
                       j, k, rank, pred.shape[0], float(temperature) if sample else 1.0,
                       SAMPLE=sample, BK=triton.next_power_of_2(k),
                       BR=triton.next_power_of_2(max(rank, 1)), num_warps=4, **pdl_kwargs(unary.device))
    return path, q


dispatch.register_backend("select_candidates", "triton", select_candidates)


# ----------------------------------------------------------------------------- row_topk
# z [M, V] in chunks of CHUNK entries, four launches: (1) each chunk's max (NaN as +inf); (2) a
# program per row takes the k-th largest of its chunk maxima, a threshold T (-inf with fewer
# than k chunks): k chunks hold an entry >= T each, so every one of the row's k best is >= T,
# and a chunk whose max is below T holds none of them; (3) a program per (row, chunk) whose max
# reaches T loads its chunk and takes its entries >= T best first, up to k, the others write
# nothing but empty slots; (4) a program per row takes the k best of the chunks' candidates
# and gathers the values from z (so they keep z's dtype and bits). An entry is one int64
# (``_packed``: the key's bits made order-preserving in the high word, -0.0 as +0.0 and NaN
# above +inf as the reference's sort, 2^31 - 1 - index in the low word), so the op's order is
# the integers' and entries are distinct: a round is one max, then the pick dropped. Empty
# slots are EMPTY, below every entry. At V 248320, k 16 z is read once plus at most ~k chunks
# again, and only those chunks run rounds (the first version ran k rounds of two reductions in
# every chunk: 56 us at M 7, 2.3 ms at M 448 on the H200, slower than torch.topk).
TOPK_CHUNK = 2048
EMPTY = tl.constexpr(-(1 << 63))
# warps of the four launches (benchmarks/topk_probe.py times other counts against these)
TOPK_WARPS = {"chunk_max": 4, "threshold": 4, "chunk": 4, "merge": 4}


@triton.jit
def _packed(key, idx):
    key = tl.where(key == 0.0, 0.0, key)  # -0.0 ties with +0.0 (the reference's equality)
    bits = key.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(key != key, 0x7FFFFFFF, ordered)  # NaN above +inf (0x7F800000)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - idx.to(tl.int64))


@triton.jit
def _key_of(packed):
    hi = (packed >> 32).to(tl.int32)  # the order-preserving map is an involution
    return (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_max_kernel(z_ptr, stride_m, V, cmax_ptr, NCH, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    x = tl.load(z_ptr + m * stride_m + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    tl.store(cmax_ptr + m * NCH + c, tl.max(x, axis=0))


@triton.jit
def _threshold_kernel(cmax_ptr, thr_ptr, NCH, K: tl.constexpr, NP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    key = tl.load(cmax_ptr + m * NCH + j, mask=j < NCH, other=float("-inf"))
    packed = tl.where(j < NCH, _packed(key, j), EMPTY)
    best = tl.max(packed, axis=0)
    for _t in range(K - 1):  # the K-th largest, duplicates counted
        packed = tl.where(packed == best, EMPTY, packed)
        best = tl.max(packed, axis=0)
    tl.store(thr_ptr + m, tl.where(best > EMPTY, _key_of(best), float("-inf")))


@triton.jit
def _topk_chunk_kernel(z_ptr, stride_m, V, cmax_ptr, thr_ptr, cand_ptr, NCH,
                       K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    thr = tl.load(thr_ptr + m)
    cm = tl.load(cmax_ptr + m * NCH + c)
    offs = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    # a chunk below the threshold is not even loaded (the max broadcast to the block: the
    # interpreter cannot AND a scalar bool with a block)
    inr = (offs < V) & ((tl.zeros([CHUNK], tl.float32) + cm) >= thr)
    key = tl.load(z_ptr + m * stride_m + offs, mask=inr, other=float("-inf")).to(tl.float32)
    packed = tl.where(inr, _packed(key, offs), EMPTY)
    # the lowest entry of key thr: every entry below it is none of the row's k best
    floor = _packed(thr, tl.full([], 0x7FFFFFFF, tl.int64))
    slot = tl.arange(0, KP)
    out = tl.full([KP], EMPTY, tl.int64)
    best = tl.max(packed, axis=0)
    t = 0
    while (t < K) & (best > EMPTY) & (best >= floor):
        out = tl.where(slot == t, best, out)
        packed = tl.where(packed == best, EMPTY, packed)
        best = tl.max(packed, axis=0)
        t += 1
    tl.store(cand_ptr + (m * NCH + c) * KP + slot, out)


@triton.jit
def _topk_merge_kernel(z_ptr, stride_m, cand_ptr, val_ptr, out_idx_ptr, N,
                       K: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    packed = tl.load(cand_ptr + m * N + j, mask=j < N, other=EMPTY)
    slot = tl.arange(0, KP)
    out_i = tl.full([KP], -1, tl.int64)
    for t in range(K):  # k <= V: the row has k entries
        best = tl.max(packed, axis=0)
        out_i = tl.where(slot == t, 0x7FFFFFFF - (best & 0xFFFFFFFF), out_i)
        packed = tl.where(packed == best, EMPTY, packed)
    ok = slot < K
    v = tl.load(z_ptr + m * stride_m + tl.where(ok, out_i, 0), mask=ok)
    tl.store(val_ptr + m * K + slot, v, mask=ok)
    tl.store(out_idx_ptr + m * K + slot, out_i, mask=ok)


def row_topk(z, k: int):
    m, v = z.shape
    vals = torch.empty((m, k), dtype=z.dtype, device=z.device)
    idx = torch.empty((m, k), dtype=torch.long, device=z.device)
    if m == 0:
        return vals, idx
    kp = triton.next_power_of_2(k)
    chunk = min(TOPK_CHUNK, triton.next_power_of_2(v))
    nch = triton.cdiv(v, chunk)
    cmax = torch.empty((m, nch), dtype=torch.float32, device=z.device)
    thr = torch.empty((m,), dtype=torch.float32, device=z.device)
    cand = torch.empty((m, nch, kp), dtype=torch.long, device=z.device)
    w = TOPK_WARPS
    _chunk_max_kernel[(m, nch)](z, z.stride(0), v, cmax, nch, CHUNK=chunk,
                                num_warps=w["chunk_max"], **pdl_kwargs(z.device))
    _threshold_kernel[(m,)](cmax, thr, nch, K=k, NP=triton.next_power_of_2(nch),
                            num_warps=w["threshold"], **pdl_kwargs(z.device))
    _topk_chunk_kernel[(m, nch)](z, z.stride(0), v, cmax, thr, cand, nch, K=k, KP=kp,
                                 CHUNK=chunk, num_warps=w["chunk"], **pdl_kwargs(z.device))
    n = nch * kp
    _topk_merge_kernel[(m,)](z, z.stride(0), cand, vals, idx, n, K=k, KP=kp,
                             NP=triton.next_power_of_2(n), num_warps=w["merge"],
                             **pdl_kwargs(z.device))
    return vals, idx


dispatch.register_backend("row_topk", "triton", row_topk)


# ----------------------------------------------------------------------------- row_argmax
# z [M, V] in chunks of ARGMAX_CHUNK entries: a program per (row, chunk) takes its chunk's best
# entry as one int64 (``_packed``: the order is the op's, the first index winning ties), then a
# program per row takes the best of its chunks' and unpacks the index. A row of one chunk is
# done by the first launch. Grids from the shapes only (graph-capturable).
ARGMAX_CHUNK = 4096


@triton.jit
def _argmax_chunk_kernel(z_ptr, stride_m, V, part_ptr, idx_ptr, NCH, CHUNK: tl.constexpr,
                         FINAL: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    inr = offs < V
    x = tl.load(z_ptr + m * stride_m + offs, mask=inr, other=float("-inf")).to(tl.float32)
    best = tl.max(tl.where(inr, _packed(x, offs), EMPTY), axis=0)
    if FINAL:  # the row is one chunk
        tl.store(idx_ptr + m, 0x7FFFFFFF - (best & 0xFFFFFFFF))
    else:
        tl.store(part_ptr + m * NCH + c, best)


@triton.jit
def _argmax_merge_kernel(part_ptr, idx_ptr, NCH, NP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    best = tl.max(tl.load(part_ptr + m * NCH + j, mask=j < NCH, other=EMPTY), axis=0)
    tl.store(idx_ptr + m, 0x7FFFFFFF - (best & 0xFFFFFFFF))


def row_argmax(z):
    m, v = z.shape
    idx = torch.empty((m,), dtype=torch.long, device=z.device)
    if m == 0:
        return idx
    chunk = min(ARGMAX_CHUNK, triton.next_power_of_2(v))
    nch = triton.cdiv(v, chunk)
    part = idx if nch == 1 else torch.empty((m, nch), dtype=torch.long, device=z.device)
    _argmax_chunk_kernel[(m, nch)](z, z.stride(0), v, part, idx, nch, CHUNK=chunk,
                                   FINAL=nch == 1, num_warps=4, **pdl_kwargs(z.device))
    if nch > 1:
        _argmax_merge_kernel[(m,)](part, idx, nch, NP=triton.next_power_of_2(nch), num_warps=1,
                                   **pdl_kwargs(z.device))
    return idx


dispatch.register_backend("row_argmax", "triton", row_argmax)
