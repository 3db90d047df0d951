"""Triton kernels of ``select_candidates`` (``ops/select.py``, DFlash 2's selector walk) and of
``row_topk`` / ``row_argmax``.

The walk: one program per request walks its J mask rows in order (each pick is the next row's
predecessor): it loads the predecessor's codebook row and the row's projected hidden state
(rank values each), the k candidates' successor rows (a [k, rank] tile), forms the k scores,
picks (greedy: the first maximum; sampled: softmax(score / T) and the first running sum past the
row's uniform) and writes q and the pick. Ids outside [0, V) read as zero rows. Grid (R,) from
the shapes only: graph-capturable. (A table a row of every predecessor's scores, then a walk
over the tables, was measured twice and not kept: no change to the DFlash 2 step in session
38, and in session 43 -2 us at one request but +14 us at 64; benchmarks/NOTES.md.)
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
# z [M, V] in chunks of CHUNK entries, four launches. An entry is one int64 (``_packed``: the
# key's bits made order-preserving in the high word, -0.0 as +0.0 and NaN above +inf as the
# reference's sort, 2^31 - 1 - index in the low word), so the op's order is the integers' and
# entries are distinct: a round is one max, then the pick dropped; empty slots are EMPTY, below
# every entry. (1) each chunk's best entry (``_argmax_chunk_kernel``); (2) a program per row
# takes its k best chunk maxima in order: those k chunks and the k-th of them, the floor; every
# other chunk's entries all lie below k chunk maxima, so the row's k best lie in those k chunks
# and are >= the floor; (3) a program per (row, one of its k chunks) loads the chunk and takes
# its entries >= the floor, best first, up to k (most chunks have one or two); (4) a program per
# row merges the k x k candidates and gathers the values from z (they keep z's dtype and bits).
# At V 248320, k 16: z read once plus k chunks a row again; the serial rounds run over 128
# chunk maxima and 256 candidates, one warp each (the first version ran its rounds over every
# chunk's candidates, 2,048 a row with four warps: 6.8 us of the 18.6 at 7 rows, H100).
TOPK_CHUNK = 2048
EMPTY = tl.constexpr(-(1 << 63))
# warps of the four launches; "merge" is the width up to 512 candidates a row, 4 above
# (benchmarks/topk_probe.py times other counts against these)
TOPK_WARPS = {"chunk_max": 4, "threshold": 1, "chunk": 4, "merge": 1}


@triton.jit
def _packed(key, idx):
    key = tl.where(key == 0.0, 0.0, key)  # -0.0 ties with +0.0 (the reference's equality)
    bits = key.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(key != key, 0x7FFFFFFF, ordered)  # NaN above +inf (0x7F800000)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - idx.to(tl.int64))


@triton.jit
def _index_of(packed):
    return 0x7FFFFFFF - (packed & 0xFFFFFFFF)


@triton.jit
def _topk_chunks_kernel(cmax_ptr, act_ptr, floor_ptr, NCH, K: tl.constexpr, KP: tl.constexpr,
                        NP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    packed = tl.load(cmax_ptr + m * NCH + j, mask=j < NCH, other=EMPTY)
    slot = tl.arange(0, KP)
    top = tl.full([KP], EMPTY, tl.int64)  # the k best chunk maxima in order
    for t in range(K):
        best = tl.max(packed, axis=0)
        top = tl.where(slot == t, best, top)
        packed = tl.where(packed == best, EMPTY, packed)
    tl.store(act_ptr + m * K + slot, tl.where(top > EMPTY, _index_of(top) // CHUNK, -1),
             mask=slot < K)
    # the k-th of them (EMPTY with fewer than k chunks: every entry counts)
    tl.store(floor_ptr + m, tl.min(tl.where(slot < K, top, -EMPTY - 1), axis=0))


@triton.jit
def _topk_chunk_kernel(z_ptr, stride_m, V, act_ptr, floor_ptr, cand_ptr, K: tl.constexpr,
                       KP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    c = tl.load(act_ptr + m * K + s)  # -1: the row has fewer than k chunks
    floor = tl.load(floor_ptr + m)
    offs = tl.arange(0, CHUNK).to(tl.int64) + c * CHUNK
    # (c broadcast to the block: the interpreter cannot AND a scalar bool with a block)
    inr = (offs < V) & ((tl.zeros([CHUNK], tl.int64) + c) >= 0)
    offs = tl.where(inr, offs, 0)
    key = tl.load(z_ptr + m * stride_m + offs, mask=inr, other=float("-inf")).to(tl.float32)
    packed = tl.where(inr, _packed(key, offs), EMPTY)
    slot = tl.arange(0, KP)
    out = tl.full([KP], EMPTY, tl.int64)
    best = tl.max(packed, axis=0)
    t = 0
    while (t < K) & (best > EMPTY) & (best >= floor):
        out = tl.where(slot == t, best, out)
        packed = tl.where(packed == best, EMPTY, packed)
        best = tl.max(packed, axis=0)
        t += 1
    tl.store(cand_ptr + (m * K + s) * KP + slot, out)


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
        out_i = tl.where(slot == t, _index_of(best), out_i)
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
    cmax = torch.empty((m, nch), dtype=torch.int64, device=z.device)
    act = torch.empty((m, k), dtype=torch.int64, device=z.device)
    floor = torch.empty((m,), dtype=torch.int64, device=z.device)
    cand = torch.empty((m, k, kp), dtype=torch.long, device=z.device)
    w = TOPK_WARPS
    _argmax_chunk_kernel[(m, nch)](z, z.stride(0), v, cmax, idx, nch, CHUNK=chunk, FINAL=False,
                                   num_warps=w["chunk_max"], **pdl_kwargs(z.device))
    _topk_chunks_kernel[(m,)](cmax, act, floor, nch, K=k, KP=kp, NP=triton.next_power_of_2(nch),
                              CHUNK=chunk, num_warps=w["threshold"], **pdl_kwargs(z.device))
    _topk_chunk_kernel[(m, k)](z, z.stride(0), v, act, floor, cand, K=k, KP=kp, CHUNK=chunk,
                               num_warps=w["chunk"], **pdl_kwargs(z.device))
    n = k * kp
    np_ = triton.next_power_of_2(n)
    _topk_merge_kernel[(m,)](z, z.stride(0), cand, vals, idx, n, K=k, KP=kp, NP=np_,
                             num_warps=w["merge"] if np_ <= 512 else 4, **pdl_kwargs(z.device))
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
        tl.store(idx_ptr + m, _index_of(best))
    else:
        tl.store(part_ptr + m * NCH + c, best)


@triton.jit
def _argmax_merge_kernel(part_ptr, idx_ptr, NCH, NP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    best = tl.max(tl.load(part_ptr + m * NCH + j, mask=j < NCH, other=EMPTY), axis=0)
    tl.store(idx_ptr + m, _index_of(best))


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
