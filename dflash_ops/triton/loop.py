"""Triton kernels of the loop ops (``ops/loop.py``): ``greedy_commit_`` and ``sample_commit_``
(acceptance + commit of a verified block) and ``prepare_step_`` (a step's static inputs).

Commit: one program per active request r (row ``rows[r]`` of the per-request state):
* match = the leading drafts the target agrees with (greedy: block[r, j + 1] == post[r, j],
  j < B - 1; sampling: the rejection rule of ``sample_accept_ref``);
* the new tokens are post[r, 0 .. match] (greedy: an accepted draft equals the target's token),
  cut after the first stop token and at max_new - n_out[row]: kept of them, written to
  out_tokens[row, n_out[row] + j];
* n_out[row] += kept, start[row] += kept, last[row] = the last new token (post[r, 0] when
  nothing is kept, as the reference), ctx_pos[r, j] = start + j for j < kept else -1 (the rows
  of the verify that become the drafter's context), kept[r], done[r].
Rows are distinct, so programs never touch the same state. Shapes only decide the launch
(B and the stop-list length as constexprs): graph-capturable.

Device values are bounds-checked as ``ops/loop.py`` documents: a request whose row is outside
[0, N) or whose n_out[row] < 0 commits nothing (kept 0, done False, ctx_pos -1, no state or
token written), a sampled draft outside [0, V) is rejected (its probabilities are not read), a
``prepare_step_`` row outside [0, N) gets the padding entry.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dispatch
from ._pdl import pdl_kwargs


@triton.jit
def _commit(new, match, r, j, rows_ptr, n_out_ptr, start_ptr, last_ptr, stop_ptr, out_ptr,
            ctx_pos_ptr, kept_ptr, done_ptr, out_stride, out_width, n_stop, max_new, N,
            B: tl.constexpr, SP: tl.constexpr):
    """The commit shared by both kernels: the new tokens new[j] (j <= match) of request r, cut
    after the first stop token and at max_new - n_out; the state of row rows[r] updated (none
    when the row is outside [0, N) or its n_out < 0)."""
    row = tl.load(rows_ptr + r)
    ok = (row >= 0) & (row < N)
    row = tl.where(ok, row, 0)
    n_out = tl.load(n_out_ptr + row, mask=ok, other=0)
    ok = ok & (n_out >= 0)
    s = tl.arange(0, SP)
    stops = tl.load(stop_ptr + s, mask=s < n_stop, other=0)
    hit = (new[:, None] == stops[None, :]) & (s[None, :] < n_stop)
    is_stop = (tl.max(hit.to(tl.int32), axis=1) > 0) & (j <= match)
    first_stop = tl.min(tl.where(is_stop, j, B), axis=0)
    room = max_new - n_out
    kept = tl.minimum(tl.minimum(match + 1, room), first_stop + 1)
    kept = tl.where(ok, tl.maximum(kept, 0), 0)
    done = ((kept >= room) | (first_stop < kept)) & ok
    col = n_out + j
    tl.store(out_ptr + row * out_stride + col, new, mask=(j < kept) & (col < out_width))
    last = tl.sum(tl.where(j == tl.maximum(kept - 1, 0), new, 0), axis=0)
    start = tl.load(start_ptr + row, mask=ok, other=0)
    tl.store(ctx_pos_ptr + r * B + j, tl.where(j < kept, start + j, -1), mask=j < B)
    tl.store(n_out_ptr + row, n_out + kept, mask=ok)
    tl.store(start_ptr + row, start + kept, mask=ok)
    tl.store(last_ptr + row, last, mask=ok)
    tl.store(kept_ptr + r, kept)
    tl.store(done_ptr + r, done.to(tl.int8))


@triton.jit
def _greedy_commit_kernel(block_ptr, post_ptr, rows_ptr, n_out_ptr, start_ptr, last_ptr,
                          out_ptr, stop_ptr, ctx_pos_ptr, kept_ptr, done_ptr,
                          out_stride, out_width, n_stop, max_new, N,
                          B: tl.constexpr, BP: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    j = tl.arange(0, BP)
    post = tl.load(post_ptr + r * B + j, mask=j < B, other=0)
    drafts = tl.load(block_ptr + r * B + j + 1, mask=j < B - 1, other=0)
    agree = (drafts == post) & (j < B - 1)
    match = tl.min(tl.where(agree, B - 1, j), axis=0)  # first disagreement (B - 1: none)
    _commit(post, match, r, j, rows_ptr, n_out_ptr, start_ptr, last_ptr, stop_ptr, out_ptr,
            ctx_pos_ptr, kept_ptr, done_ptr, out_stride, out_width, n_stop, max_new, N, B, SP)


@triton.jit
def _row_chunk(p_row, q_row, qi_row, kv, V, q_lim, KQ, SPARSE: tl.constexpr, BK: tl.constexpr):
    """Entries kv of the row drawn from: (in range, p, max(p - q, 0)); q read where kv < q_lim
    (V, or 0 for none: an index bound, not a scalar bool in the mask, which some interpreter
    versions reject). SPARSE: the q row is KQ values at the token ids qi_row (0 elsewhere),
    matched against the chunk's ids."""
    inside = kv < V
    pv = tl.load(p_row + kv, mask=inside, other=0.0)
    if SPARSE:
        i = tl.arange(0, BK)
        qi = tl.load(qi_row + i, mask=i < KQ, other=-1)
        qv = tl.load(q_row + i, mask=i < KQ, other=0.0)
        hit = (qi[None, :] == kv[:, None]) & (kv < q_lim)[:, None]
        qk = tl.sum(tl.where(hit, qv[None, :], 0.0), axis=1)
    else:
        qk = tl.load(q_row + kv, mask=kv < q_lim, other=0.0)
    return inside, pv, tl.maximum(pv - qk, 0.0)


@triton.jit
def _sample_commit_kernel(block_ptr, p_ptr, q_ptr, qi_ptr, u_ptr, ures_ptr, rows_ptr, n_out_ptr,
                          start_ptr, last_ptr, out_ptr, stop_ptr, ctx_pos_ptr, kept_ptr,
                          done_ptr, sp_r, sp_j, sq_r, sq_j, V, KQ, out_stride, out_width, n_stop,
                          max_new, N, B: tl.constexpr, BP: tl.constexpr, SP: tl.constexpr,
                          BV: tl.constexpr, SPARSE: tl.constexpr, BK: tl.constexpr,
                          PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64)  # r * sp_r can pass 2^31 at large R * B * V
    j = tl.arange(0, BP)
    is_d = j < B - 1
    drafts = tl.load(block_ptr + r * B + j + 1, mask=is_d, other=0)
    in_v = is_d & (drafts >= 0) & (drafts < V)  # a draft outside the vocabulary is rejected
    p_d = tl.load(p_ptr + r * sp_r + j * sp_j + drafts, mask=in_v, other=0.0)
    if SPARSE:  # q at the draft: its value among the row's KQ candidates (0 if absent)
        i = tl.arange(0, BK)
        m2 = is_d[:, None] & (i < KQ)[None, :]
        qoff = r * sq_r + j[:, None] * sq_j + i[None, :]
        qi = tl.load(qi_ptr + qoff, mask=m2, other=-1)
        qv = tl.load(q_ptr + qoff, mask=m2, other=0.0)
        q_d = tl.sum(tl.where((qi == drafts[:, None]) & m2, qv, 0.0), axis=1)
        q_d = tl.where(in_v, q_d, 0.0)
    else:
        q_d = tl.load(q_ptr + r * sq_r + j * sq_j + drafts, mask=in_v, other=0.0)
    u = tl.load(u_ptr + r * (B - 1) + j, mask=is_d, other=1.0)
    ok = (u * q_d < p_d) & in_v
    match = tl.min(tl.where(ok, B - 1, j), axis=0)  # first rejection (B - 1: all accepted)
    # the draw at position match: max(p - q, 0) (q = 0 after B-1 acceptances), else p
    p_row = p_ptr + r * sp_r + match * sp_j
    q_row = q_ptr + r * sq_r + tl.minimum(match, B - 2) * sq_j
    q_lim = tl.where(match < B - 1, V, 0)  # q's row exists before B-1 acceptances
    k = tl.arange(0, BV)
    mass = 0.0
    pmass = 0.0
    last_r = 0
    last_p = 0
    qi_row = qi_ptr + r * sq_r + tl.minimum(match, B - 2) * sq_j
    for v0 in range(0, V, BV):
        kv = v0 + k
        inside, pv, rv = _row_chunk(p_row, q_row, qi_row, kv, V, q_lim, KQ, SPARSE, BK)
        mass += tl.sum(rv, axis=0)
        pmass += tl.sum(pv, axis=0)
        last_r = tl.maximum(last_r, tl.max(tl.where(rv > 0, kv, 0), axis=0))
        last_p = tl.maximum(last_p, tl.max(tl.where(pv > 0, kv, 0), axis=0))
    use_r = mass > 0.0
    total = tl.where(use_r, mass, pmass)
    q_lim = tl.where(use_r, q_lim, 0)  # drawing from p: q not read
    target = tl.load(ures_ptr + r) * total
    first = V  # the first k with weight whose running sum exceeds target (V: none yet)
    run = 0.0
    for v0 in range(0, V, BV):
        kv = v0 + k
        inside, pv, rv = _row_chunk(p_row, q_row, qi_row, kv, V, q_lim, KQ, SPARSE, BK)
        dv = tl.where(use_r, rv, pv)
        cdf = run + tl.cumsum(dv, axis=0)
        hit = (dv > 0.0) & (cdf > target) & inside
        first = tl.minimum(first, tl.min(tl.where(hit, kv, V), axis=0))
        run += tl.sum(dv, axis=0)
    token = tl.where(first < V, first, tl.where(use_r, last_r, last_p)).to(tl.int64)
    new = tl.where(j == match, token, drafts)
    _commit(new, match, r, j, rows_ptr, n_out_ptr, start_ptr, last_ptr, stop_ptr, out_ptr,
            ctx_pos_ptr, kept_ptr, done_ptr, out_stride, out_width, n_stop, max_new, N, B, SP)


def _stops(stop_ids):
    """The stop list with at least one entry, so the kernel has a valid pointer."""
    return stop_ids if stop_ids.numel() else stop_ids.new_zeros(1)


def greedy_commit_(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int,
                   kept, done, ctx_pos) -> None:
    """``torch.ops.dflash.greedy_commit_``, one program a request (arguments checked by the
    dispatcher)."""
    r, b = block.shape
    if r == 0:
        return
    _greedy_commit_kernel[(r,)](
        block.contiguous(), post.contiguous(), rows, n_out, start, last, out_tokens,
        _stops(stop_ids), ctx_pos, kept, done.view(torch.int8), out_tokens.stride(0),
        out_tokens.shape[1], stop_ids.numel(), max_new, n_out.shape[0], B=b,
        BP=triton.next_power_of_2(b), SP=triton.next_power_of_2(max(1, stop_ids.numel())),
        **pdl_kwargs(block.device))


def sample_commit_(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                   max_new: int, kept, done, ctx_pos, q_idx=None) -> None:
    """``torch.ops.dflash.sample_commit_``, one program a request: two passes over the V
    probabilities of the one row drawn from (mass and last nonzero token, then the inverse CDF:
    the first token with weight whose running sum exceeds u_res * mass). A sparse q (``q_idx``)
    is matched against each chunk of V token ids ([BV, k] compares, BV 1024)."""
    r, b = block.shape
    v = p.shape[-1]
    if r == 0:
        return
    sparse = q_idx is not None
    kq = q.shape[-1] if sparse else v
    bv = min(1024 if sparse else 4096, triton.next_power_of_2(v))
    _sample_commit_kernel[(r,)](
        block.contiguous(), p, q, q_idx if sparse else block, u.contiguous(), u_res.contiguous(),
        rows, n_out, start, last, out_tokens, _stops(stop_ids), ctx_pos, kept,
        done.view(torch.int8), p.stride(0), p.stride(1), q.stride(0), q.stride(1), v, kq,
        out_tokens.stride(0), out_tokens.shape[1], stop_ids.numel(), max_new, n_out.shape[0],
        B=b, BP=triton.next_power_of_2(b), SP=triton.next_power_of_2(max(1, stop_ids.numel())),
        BV=bv, SPARSE=sparse, BK=triton.next_power_of_2(kq) if sparse else 1,
        **pdl_kwargs(block.device))


@triton.jit
def _prepare_step_kernel(rows_ptr, last_ptr, start_ptr, drafts_ptr, ctx_rows_ptr, ctx_pos_ptr,
                         block_ptr, req_ptr, st_ptr, ctx_req_ptr, ctx_pos_out_ptr,
                         N, R, P, RC, C, fill_id, scratch,
                         B: tl.constexpr, BP: tl.constexpr, HAS_DRAFTS: tl.constexpr,
                         PDL: tl.constexpr):
    """Program i: block row i (i < P) and context entries [i * B, i * B + B) (< C). Scalars are
    stored as lane 0 of a vector (masked), so every store has one form. Block rows past R, or
    whose state row is outside [0, N), get the padding entry."""
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0)
    j = tl.arange(0, BP)
    in_b = j < B
    lane0 = j == 0
    zeros = tl.zeros((BP,), tl.int64)
    if i < P:
        # rows[i] (i < R) read as lane 0 of a vector, and ok as a vector (okv) where it meets
        # one: the interpreter rejects a scalar i < R as a mask and a scalar & vector mask
        has = lane0 & (i + j < R)
        row = tl.sum(tl.load(rows_ptr + i + j, mask=has, other=0), axis=0)
        ok = (tl.sum(has.to(tl.int32), axis=0) > 0) & (row >= 0) & (row < N)
        okv = (zeros + ok.to(tl.int64)) > 0
        row = tl.where(ok, row, 0)
        tok = tl.load(last_ptr + row, mask=ok, other=0)
        st = tl.load(start_ptr + row, mask=ok, other=0)
        if HAS_DRAFTS:
            d = tl.load(drafts_ptr + i * (B - 1) + j - 1, mask=(j >= 1) & in_b & okv, other=0)
            d = tl.where(ok, d, fill_id)
        else:
            d = zeros + fill_id
        tl.store(block_ptr + i * B + j, tl.where(lane0 & okv, zeros + tok, d), mask=in_b)
        tl.store(req_ptr + i + j, zeros + tl.where(ok, row, scratch), mask=lane0)
        tl.store(st_ptr + i + j, zeros + st, mask=lane0)
    e = i * B + j
    in_c = in_b & (e < C)
    if i < RC:
        req = tl.load(ctx_rows_ptr + i)
        pos = tl.load(ctx_pos_ptr + e, mask=in_c, other=-1)
        tl.store(ctx_req_ptr + e, zeros + req, mask=in_c)
        tl.store(ctx_pos_out_ptr + e, pos, mask=in_c)
    else:
        tl.store(ctx_req_ptr + e, zeros + scratch, mask=in_c)
        tl.store(ctx_pos_out_ptr + e, zeros - 1, mask=in_c)


def prepare_step_(rows, last, start, drafts, ctx_rows, ctx_pos, fill_id: int, scratch: int,
                  block_out, requests_out, start_out, ctx_req_out, ctx_pos_out) -> None:
    """``torch.ops.dflash.prepare_step_``, one program per block row / B context entries
    (drafts [0, B-1]: none; ctx_* empty: none)."""
    r = rows.shape[0]
    p, b = block_out.shape
    c = ctx_req_out.shape[0]
    grid = max(p, c // b)
    if grid == 0:
        return
    _prepare_step_kernel[(grid,)](
        rows, last, start, drafts, ctx_rows, ctx_pos, block_out, requests_out, start_out,
        ctx_req_out, ctx_pos_out, last.shape[0], r, p, ctx_rows.shape[0], c, fill_id, scratch,
        B=b, BP=triton.next_power_of_2(b), HAS_DRAFTS=drafts.shape[0] > 0,
        **pdl_kwargs(rows.device))


@triton.jit
def _token_meta_kernel(req_ptr, start_ptr, qlen_ptr, table_ptr, pos_ptr, slot_ptr, seq_ptr,
                       qsl_ptr, R, T, NR, MB, NB, BS,
                       BLOCK: tl.constexpr, VAR: tl.constexpr, BR: tl.constexpr,
                       BT: tl.constexpr, PDL: tl.constexpr):
    """Program r: request r's first token row (the q_lens before it, or r * BLOCK), its seq_len
    and qsl entries, and the positions and slots of its tokens, BT at a time. Scalars are
    stored as lane 0 of a vector (masked), as in _prepare_step_kernel."""
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    k = tl.arange(0, BR)
    lane0 = k == 0
    zeros = tl.zeros((BR,), tl.int64)
    if VAR:
        ql = tl.load(qlen_ptr + k, mask=k < R, other=0)
        first = tl.sum(tl.where(k < r, ql, 0), axis=0)
        n = tl.sum(tl.where(k == r, ql, 0), axis=0)
    else:
        first = r.to(tl.int64) * BLOCK
        n = BLOCK
    req = tl.load(req_ptr + r)
    st = tl.load(start_ptr + r)
    tl.store(seq_ptr + r + k, (zeros + st + n).to(tl.int32), mask=lane0)
    tl.store(qsl_ptr + r + k, (zeros + first).to(tl.int32), mask=lane0)
    tl.store(qsl_ptr + R + k, (zeros + first + n).to(tl.int32), mask=lane0 & (zeros + r == R - 1))
    j0 = tl.arange(0, BT)
    zt = tl.zeros((BT,), tl.int64)
    ok_req = (zt + req >= 0) & (zt + req < NR)  # a request slot outside the table: slots -1
    reqc = tl.where(ok_req, zt + req, 0)
    for off in range(0, n, BT):
        j = off + j0
        row = first + j
        m = (j < n) & (row >= 0) & (row < T)
        p = st + j
        col = p // BS  # (negative p: masked below whatever the rounding)
        ok = m & ok_req & (p >= 0) & (col < MB)
        blk = tl.load(table_ptr + reqc * MB + col, mask=ok, other=NB).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < NB)
        slot = tl.where(ok, blk * BS + p % BS, -1)
        tl.store(pos_ptr + row, p, mask=m)
        tl.store(slot_ptr + row, slot, mask=m)


def token_meta(requests, starts, q_lens, block: int, table, block_size: int, num_blocks: int,
               pos, slots, seq_lens, qsl) -> None:
    """``models.cache.token_meta_ref``'s outputs written in one launch, one program a request
    (q_lens None: ``block`` tokens each); pos / slots [T] int64, seq_lens [R] / qsl [R + 1]
    int32 are the outputs."""
    r = requests.shape[0]
    if r == 0:
        qsl.zero_()
        return
    var = q_lens is not None
    # the kernel reads unit-stride vectors: an expanded or strided index is copied
    requests, starts = requests.contiguous(), starts.contiguous()
    q_lens = q_lens.contiguous() if var else None
    _token_meta_kernel[(r,)](
        requests, starts, q_lens if var else starts, table, pos, slots, seq_lens, qsl,
        r, pos.shape[0], table.shape[0], table.shape[1], num_blocks, block_size,
        BLOCK=0 if var else block, VAR=var, BR=triton.next_power_of_2(r) if var else 1,
        BT=min(1024, triton.next_power_of_2(max(1, -(-pos.shape[0] // r)))),
        **pdl_kwargs(requests.device))


dispatch.register_backend("greedy_commit_", "triton", greedy_commit_)
dispatch.register_backend("sample_commit_", "triton", sample_commit_)
dispatch.register_backend("prepare_step_", "triton", prepare_step_)
