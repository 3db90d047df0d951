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


@triton.jit
def _walk_kernel(unary_ptr, cand_ptr, hid_ptr, anchor_ptr, pred_ptr, succ_ptr, u_ptr, path_ptr,
                 q_ptr, J, K, RANK, V, temperature, SAMPLE: tl.constexpr, BK: tl.constexpr,
                 BR: tl.constexpr):
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
            best = tl.max(score, axis=0)
            pick = tl.min(tl.where((score == best) & ik, i, BK), axis=0)
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
                       BR=triton.next_power_of_2(rank), num_warps=4)
    return path, q


dispatch.register_backend("select_candidates", "triton", select_candidates)
