"""Loop ops: the speculator's per-step bookkeeping on the device, no host round trip.

* ``greedy_commit_`` / ``sample_commit_``: accept a verified block (greedy: the leading drafts
  the target agrees with; sampling: speculative rejection sampling) and commit it: each
  request's new tokens, cut at max_new_tokens and after the first stop token, are written into
  a token buffer and the per-request state (committed count, start position, last token) is
  updated in place.
* ``prepare_step_``: a step's static inputs (blocks, request slots, start positions, padding
  rows, the context rows the previous verify committed) written in one launch from that state.

Device values: the contract is that a request whose row is outside ``[0, N)`` or whose
``n_out[row] < 0`` commits nothing (kept 0, done False, ctx_pos -1; no state or token written),
a draft token outside ``[0, V)`` is rejected by ``sample_commit_``, tokens past out_tokens' W
columns are not written, and a ``prepare_step_`` row outside ``[0, N)`` gets the padding entry;
``DFLASH_OPS_DEBUG=1`` raises on such rows and counts (every backend). A commit's rows must be
distinct: two requests naming one slot leave that slot's state and tokens undefined (still
within the buffers); ``DFLASH_OPS_DEBUG=1`` raises on it. The torch references
and the Triton kernels both keep it (tests/test_hostile_inputs.py, with guard memory around
every tensor).

Shapes alone decide every launch (nothing is read on the host), so a whole step can sit in a
CUDA graph. The torch references are what the kernels are tested against; the torch version
of a commit is ~25 small launches, of ``prepare_step_`` ~12.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from . import _checks as C
from ._samples import META, set_, sliced, to

__all__ = ["greedy_commit", "sample_commit", "prepare_step_"]


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------
def _put(t: torch.Tensor, idx: tuple, value: torch.Tensor, write: torch.Tensor) -> None:
    """t[idx] = value where ``write``, nothing elsewhere, with no host sync (CUDA-graph safe):
    adds value - t[idx] (0 where not written), so indices of unwritten entries (clamped ones)
    may repeat or meet a written one. Integer tensors: exact."""
    delta = torch.where(write, value - t[idx], torch.zeros_like(value))
    t.index_put_(idx, delta, accumulate=True)


def _row_ok(rows: torch.Tensor, n: int) -> tuple:
    """(in range [R] bool, rows clamped into [0, N) [R] int64) for state rows of N slots."""
    rows = rows.long()
    ok = (rows >= 0) & (rows < n)
    return ok, torch.where(ok, rows, torch.zeros_like(rows))


def commit_block(block: torch.Tensor, post: torch.Tensor, match: torch.Tensor,
                 n_out: torch.Tensor, max_new: int, stop_ids: torch.Tensor,
                 out_tokens: torch.Tensor, rows: torch.Tensor,
                 ok: Optional[torch.Tensor] = None):
    """block [R, B]: [last token, drafts]; post [R, B]: post[r, match[r]] is the token the
    target gives after the accepted drafts (greedy: its argmax; sampling: the bonus or the
    residual draw); match [R]: accepted drafts; n_out [R]: tokens each request has; out_tokens
    [N, W] (W >= max_new + B) the token buffer, rows [R] its row per request.

    New tokens of request r: block[r, 1:match+1] then post[r, match], cut to max_new - n_out
    and after the first stop token. Writes the kept ones at out_tokens[rows[r], n_out[r]:] (the
    columns < W) and nothing else. ``ok`` [R] bool (None: all): requests to commit; the others
    (rows must still index out_tokens) get kept 0, done False and write nothing. Returns
    (kept [R], done [R], last [R]): committed count, finished flag, the last committed token."""
    r, b = block.shape
    j = torch.arange(b, device=block.device)[None, :]
    match = match.long()[:, None]
    shifted = torch.cat([block[:, 1:], block[:, :1]], 1)  # drafts at j < B-1 (col B-1 unused)
    new = torch.where(j == match, post.gather(1, match), shifted)
    valid = j <= match
    room = (max_new - n_out.long())[:, None]
    is_stop = torch.isin(new, stop_ids) & valid if stop_ids.numel() else torch.zeros_like(valid)
    first_stop = torch.where(is_stop, j, torch.full_like(j, b)).amin(1, keepdim=True)
    kept = torch.minimum(torch.minimum(match + 1, room), first_stop + 1).clamp_min(0)
    done = (kept >= room) | (first_stop < kept)
    if ok is not None:
        kept = torch.where(ok[:, None], kept, torch.zeros_like(kept))
        done = done & ok[:, None]
    # written: the kept columns inside [0, W); the others index a clamped column, unwritten
    w = out_tokens.shape[1]
    cols = n_out.long()[:, None] + j
    write = (j < kept) & (cols >= 0) & (cols < w)
    idx = (rows.long()[:, None].expand(-1, b), cols.clamp(0, max(w - 1, 0)))
    if w:
        _put(out_tokens, idx, new, write)
    last = new.gather(1, (kept - 1).clamp_min(0))
    return kept[:, 0], done[:, 0], last[:, 0]


def commit_update(block, post, match, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new: int):
    """commit_block with the per-request state updated in place: n_out, start, last (all [N],
    indexed by rows). Returns (kept [R], done [R] bool, ctx_pos [R, B]: start + j for the kept
    rows, -1 elsewhere: the verify rows that become the drafter's context). A request whose
    row is outside [0, N) or whose n_out[row] < 0 is skipped: kept 0, done False, ctx_pos -1,
    nothing written."""
    r, b = block.shape
    n = n_out.shape[0]
    if n == 0:  # every row out of range
        return (torch.zeros(r, dtype=torch.long, device=block.device),
                torch.zeros(r, dtype=torch.bool, device=block.device),
                torch.full_like(block, -1))
    ok, safe = _row_ok(rows, n)
    count = n_out[safe]
    ok = ok & (count >= 0)
    st = start[safe]
    kept, done, new_last = commit_block(block, post, match, count, max_new, stop_ids,
                                        out_tokens, safe, ok)
    j = torch.arange(b, device=block.device)[None, :]
    ctx_pos = torch.where(j < kept[:, None], st[:, None] + j, torch.full_like(block, -1))
    # rows are distinct: for the committed ones these are n_out[rows] += kept,
    # start[rows] = st + kept and last[rows] = new_last
    _put(n_out, (safe,), count + kept, ok)
    _put(start, (safe,), st + kept, ok)
    _put(last, (safe,), new_last.to(last.dtype), ok)
    return kept, done, ctx_pos


def greedy_commit_ref(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int):
    """Greedy acceptance + commit + state update: match = leading drafts block[:, 1:] equal to
    post[:, :-1], then ``commit_update``."""
    match = (block[:, 1:] == post[:, :-1]).int().cumprod(1).sum(1)
    return commit_update(block, post, match, rows, n_out, start, last, out_tokens, stop_ids,
                         max_new)


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw from unnormalised weights dist [R, V] >= 0 with uniforms u [R] in [0, 1):
    the first k with dist[k] > 0 whose running sum exceeds u * total; the last k with dist > 0
    if rounding leaves none. Asking dist[k] > 0 keeps a zero-weight token (top-k / top-p cuts)
    out even where an fp32 running sum computed in parallel dips by a rounding step."""
    cdf = dist.cumsum(-1)
    target = u * dist.sum(-1)
    k = torch.arange(dist.shape[-1], device=dist.device)
    v = dist.shape[-1]
    first = torch.where((dist > 0) & (cdf > target[:, None]), k, v).amin(-1)
    last_nz = torch.where(dist > 0, k, torch.zeros_like(k)).amax(-1)
    return torch.where(first < v, first, last_nz)


def sample_accept_ref(block, p, q, u, u_res):
    """Speculative rejection sampling of a block (Leviathan et al.): block [R, B] (last token,
    drafts d_1..d_{B-1}), p [R, B, V] the target's sampling distribution after each block
    position, q [R, B-1, V] the drafter's for each draft, u [R, B-1] and u_res [R] uniforms in
    [0, 1). Draft j is accepted while u_j * q_j(d_j) < p_{j-1}(d_j); at the first rejection
    (position m = match) the token is drawn from max(p_m - q_m, 0) (p_m where that is all zero),
    after B-1 acceptances the bonus from p_{B-1}, with u_res through ``inverse_cdf``. A draft
    outside the vocabulary [0, V) is rejected (never read as an index). Returns (match [R]
    int64, post [R, B] int64: the drawn token at column match, the drafts shifted left
    elsewhere, what ``commit_update`` reads)."""
    r, b = block.shape
    v = p.shape[-1]
    d = block[:, 1:, None]
    in_vocab = ((d >= 0) & (d < v))[..., 0]
    d = d.clamp(0, max(v - 1, 0))
    p_d = p[:, :-1].gather(-1, d)[..., 0].float()
    q_d = q.gather(-1, d)[..., 0].float()
    match = ((u * q_d < p_d) & in_vocab).int().cumprod(1).sum(1).long()
    ar = torch.arange(r, device=block.device)
    pm = p[ar, match].float()
    qm = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[ar, match].float()  # 0 after B-1 drafts
    resid = (pm - qm).clamp_min(0)
    dist = torch.where((resid.sum(-1) > 0)[:, None], resid, pm)
    token = inverse_cdf(dist, u_res.float())
    post = torch.cat([block[:, 1:], block[:, :1]], 1).clone()
    post[ar, match] = token
    return match, post


def dense_q(q: torch.Tensor, q_idx: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sparse draft distribution q [R, B-1, k] on token ids q_idx [R, B-1, k] (distinct in a
    row) scattered into the vocabulary: [R, B-1, V] fp32, zero elsewhere; ids outside [0, V)
    are dropped."""
    ok = (q_idx >= 0) & (q_idx < vocab)
    out = torch.zeros(*q.shape[:2], vocab, dtype=torch.float32, device=q.device)
    # scatter_add: a dropped id lands on id 0 with value 0 and must not overwrite id 0's value
    return out.scatter_add_(2, torch.where(ok, q_idx, torch.zeros_like(q_idx)),
                            torch.where(ok, q.float(), torch.zeros_like(q, dtype=torch.float32)))


def sample_commit_ref(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                      max_new: int, q_idx=None):
    """``sample_accept_ref`` then ``commit_update``: (kept [R], done [R], ctx_pos [R, B]).
    ``q_idx`` [R, B-1, k]: q is sparse, [R, B-1, k] values on those token ids (``dense_q``)."""
    if q_idx is not None:
        q = dense_q(q, q_idx, p.shape[-1])
    match, post = sample_accept_ref(block, p, q, u, u_res)
    return commit_update(block, post, match, rows, n_out, start, last, out_tokens, stop_ids,
                         max_new)


def prepare_step_ref(rows, last, start, drafts, ctx_rows, ctx_pos, fill_id: int, scratch: int,
                     block_out, requests_out, start_out, ctx_req_out, ctx_pos_out) -> None:
    """``prepare_step_``'s contract in torch ops (arguments there; None for the absent ones).
    A row outside [0, N) is skipped: its entry is a padding row (fill_id, scratch, start 0)."""
    r, p_rows, b = rows.shape[0], block_out.shape[0], block_out.shape[1]
    ok, safe = _row_ok(rows, last.shape[0])
    if last.shape[0] == 0:  # every row out of range: padding rows only
        last, start = last.new_zeros(1), start.new_zeros(1)
    block_out[:r, 0] = torch.where(ok, last[safe], torch.full_like(safe, fill_id))
    if drafts is not None:
        block_out[:r, 1:] = torch.where(ok[:, None], drafts, torch.full_like(drafts, fill_id))
    else:
        block_out[:r, 1:] = fill_id
    block_out[r:] = fill_id
    requests_out[:r] = torch.where(ok, safe, torch.full_like(safe, scratch))
    requests_out[r:p_rows] = scratch
    start_out[:r] = torch.where(ok, start[safe], torch.zeros_like(safe))
    start_out[r:p_rows] = 0
    if ctx_req_out is not None:
        n = ctx_rows.shape[0] * b if ctx_rows is not None else 0
        if n:
            ctx_req_out[:n] = ctx_rows.long()[:, None].expand(-1, b).reshape(-1)
            ctx_pos_out[:n] = ctx_pos.reshape(-1)
        ctx_req_out[n:] = scratch
        ctx_pos_out[n:] = -1


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def _desc(t) -> str:
    return f"{t.dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}"


def check_commit_args(op: str, block, rows, n_out, start, last, out_tokens, stop_ids,
                      post=None, probs=None, q_idx=None) -> None:
    """ValueError naming the argument (expected vs given) before anything is written: block
    [R, B] int64 (B >= 2 with ``probs``), post [R, B] int64, rows [R], n_out / start / last
    [N] and stop_ids [S] contiguous int64, out_tokens [N, W] int64 with unit column stride, all
    on block's device; ``probs`` = (p, q, u, u_res): fp32 [R, B, V], [R, B-1, V], [R, B-1],
    [R], unit stride in the last dim."""
    dev = block.device
    if block.dtype != torch.long or block.dim() != 2 or block.shape[1] < (2 if probs else 1):
        C.fail(op, f"block must be int64 [R, B] with B >= {2 if probs else 1}, got "
                   f"{_desc(block)}")
    r, b = block.shape
    n = n_out.shape[0] if n_out.dim() == 1 else -1
    for name, t, want in (("rows", rows, (r,)), ("n_out", n_out, (n,)), ("start", start, (n,)),
                          ("last", last, (n,)), ("stop_ids", stop_ids, None)):
        want = want or tuple(t.shape)
        if (t.dtype != torch.long or t.dim() != 1 or tuple(t.shape) != want
                or not t.is_contiguous() or t.device != dev):
            C.fail(op, f"{name} must be a contiguous 1-D int64 tensor of {list(want)} on {dev}, "
                       f"got {_desc(t)}")
    if (out_tokens.dtype != torch.long or out_tokens.dim() != 2 or out_tokens.shape[0] != n
            or out_tokens.stride(1) != 1 or out_tokens.device != dev):
        C.fail(op, f"out_tokens must be int64 [{n}, W] with unit column stride on {dev}, got "
                   f"{_desc(out_tokens)}")
    if post is not None and (post.dtype != torch.long or tuple(post.shape) != (r, b)
                             or post.device != dev):
        C.fail(op, f"post must be int64 {[r, b]} on {dev}, got {_desc(post)}")
    if probs is not None:
        p, q = probs[0], probs[1]
        v = p.shape[-1] if p.dim() == 3 else -1
        if v == 0:
            C.fail(op, f"p must have a vocabulary of V >= 1 (its last dim), got {_desc(p)}")
        kq = v  # q's last dim: the vocabulary, or k candidates when sparse
        if q_idx is not None:
            kq = q.shape[-1] if q.dim() == 3 else -1
            if (q_idx.dtype != torch.long or tuple(q_idx.shape) != (r, b - 1, kq)
                    or not q_idx.is_contiguous() or q_idx.device != dev or kq < 1):
                C.fail(op, f"q_idx must be a contiguous int64 [{r}, {b - 1}, k >= 1] (q's "
                           f"shape) on {dev}, got {_desc(q_idx)}")
            if not q.is_contiguous():
                C.fail(op, f"q must be contiguous with q_idx (sparse q), got {_desc(q)}")
        for name, t, shape in zip(("p", "q", "u", "u_res"), probs,
                                  ((r, b, v), (r, b - 1, kq), (r, b - 1), (r,))):
            if (t.dtype != torch.float32 or tuple(t.shape) != shape or t.device != dev
                    or (t.numel() and t.stride(-1) != 1)):
                C.fail(op, f"{name} must be fp32 {list(shape)} with unit stride in its last dim "
                           f"on {dev}, got {_desc(t)}")


def _check_commit_outputs(op: str, block, kept, done, ctx_pos) -> None:
    """kept [R] int64, done [R] bool, ctx_pos [R, B] int64: contiguous, on block's device."""
    r, b = block.shape
    for name, t, dtype, shape in (("kept", kept, torch.long, (r,)),
                                  ("done", done, torch.bool, (r,)),
                                  ("ctx_pos", ctx_pos, torch.long, (r, b))):
        if (t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous()
                or t.device != block.device):
            C.fail(op, f"{name} must be a contiguous {str(dtype).replace('torch.', '')} tensor "
                       f"of {list(shape)} on {block.device}, got {_desc(t)}")


def _debug_rows(op: str, rows, n_out=None, n: Optional[int] = None) -> None:
    """``DFLASH_OPS_DEBUG=1``: rows in [0, N) and (commits) n_out[rows] >= 0, the ops skip
    such requests otherwise; (commits) rows distinct: two requests committing into one state
    slot leave that slot's state and tokens undefined otherwise."""
    n = n_out.shape[0] if n_out is not None else n
    bad = (rows < 0) | (rows >= n)
    if bool(bad.any()):
        C.fail(op, f"rows must lie in [0, {n}) (the state's slots), got "
                   f"{rows[bad].tolist()[:8]} at {bad.nonzero()[:, 0].tolist()[:8]}")
    if n_out is not None and rows.numel() and bool((n_out[rows] < 0).any()):
        C.fail(op, f"n_out must be >= 0 at rows, got {n_out[rows].tolist()[:8]}")
    if n_out is not None and rows.numel() > 1:
        uniq, counts = torch.unique(rows, return_counts=True)
        if bool((counts > 1).any()):
            C.fail(op, f"rows must be distinct (one request a state slot), got "
                       f"{uniq[counts > 1].tolist()[:8]} more than once")


def _check_pairs(ctx_rows, ctx_pos, ctx_req_out, ctx_pos_out) -> None:
    op = "prepare_step_"
    if (ctx_rows is None) != (ctx_pos is None):
        C.fail(op, "ctx_rows and ctx_pos go together (both None: no context rows)")
    if (ctx_req_out is None) != (ctx_pos_out is None):
        C.fail(op, "ctx_req_out and ctx_pos_out go together (both None: no context outputs)")
    if ctx_rows is not None and ctx_req_out is None:
        C.fail(op, "ctx_rows given without ctx_req_out / ctx_pos_out to write them to")


def check_prepare_args(rows, last, start, drafts, ctx_rows, ctx_pos, block_out, requests_out,
                       start_out, ctx_req_out, ctx_pos_out) -> None:
    """ValueError naming the argument (expected vs given) before anything is written; None for
    the absent ones."""
    op = "prepare_step_"
    dev = rows.device

    def want(name, t, shape):
        if (t.dtype != torch.long or tuple(t.shape) != tuple(shape) or not t.is_contiguous()
                or t.device != dev):
            C.fail(op, f"{name} must be a contiguous int64 tensor of {list(shape)} on {dev}, "
                       f"got {_desc(t)}")

    if rows.dtype != torch.long or rows.dim() != 1 or not rows.is_contiguous():
        C.fail(op, f"rows must be a contiguous 1-D int64 tensor, got {_desc(rows)}")
    r = rows.shape[0]
    if last.dim() != 1:
        C.fail(op, f"last must be a contiguous 1-D int64 tensor, got {_desc(last)}")
    n = last.shape[0]
    want("last", last, (n,))
    want("start", start, (n,))
    if block_out.dim() != 2 or block_out.shape[0] < r or block_out.shape[1] < 1:
        C.fail(op, f"block_out must be int64 [P, B] with P >= {r} (rows' length), got "
                   f"{_desc(block_out)}")
    p_rows, b = block_out.shape
    want("block_out", block_out, (p_rows, b))
    want("requests_out", requests_out, (p_rows,))
    want("start_out", start_out, (p_rows,))
    if drafts is not None:
        want("drafts", drafts, (r, b - 1))
    _check_pairs(ctx_rows, ctx_pos, ctx_req_out, ctx_pos_out)
    if ctx_rows is not None:
        if ctx_rows.dim() != 1:
            C.fail(op, f"ctx_rows must be a contiguous 1-D int64 tensor, got {_desc(ctx_rows)}")
        want("ctx_rows", ctx_rows, (ctx_rows.shape[0],))
        want("ctx_pos", ctx_pos, (ctx_rows.shape[0], b))
    if ctx_req_out is not None:
        c = ctx_req_out.shape[0] if ctx_req_out.dim() == 1 else -1
        rc = ctx_rows.shape[0] if ctx_rows is not None else 0
        if c < rc * b or c % b:
            C.fail(op, f"ctx_req_out must be int64 [C] with C a multiple of B = {b} and >= "
                       f"{rc * b} (ctx_rows x B), got {_desc(ctx_req_out)}")
        want("ctx_req_out", ctx_req_out, (c,))
        want("ctx_pos_out", ctx_pos_out, (c,))


# --------------------------------------------------------------------------------------------
# Ops: torch.ops.dflash.{greedy_commit_, sample_commit_, prepare_step_}
# --------------------------------------------------------------------------------------------
def _check_greedy(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new, kept,
                  done, ctx_pos):
    check_commit_args("greedy_commit_", block, rows, n_out, start, last, out_tokens, stop_ids,
                      post=post)
    _check_commit_outputs("greedy_commit_", block, kept, done, ctx_pos)


def _greedy_torch(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new, kept,
                  done, ctx_pos):
    for out, got in zip((kept, done, ctx_pos), greedy_commit_ref(
            block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new)):
        out.copy_(got)


def _check_sample(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new, kept, done, ctx_pos, q_idx=None):
    check_commit_args("sample_commit_", block, rows, n_out, start, last, out_tokens, stop_ids,
                      probs=(p, q, u, u_res), q_idx=q_idx)
    _check_commit_outputs("sample_commit_", block, kept, done, ctx_pos)


def _sample_torch(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new, kept, done, ctx_pos, q_idx=None):
    for out, got in zip((kept, done, ctx_pos), sample_commit_ref(
            block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids, max_new,
            q_idx)):
        out.copy_(got)


def _present(rows, last, start, drafts, ctx_rows, ctx_pos, fill_id, scratch, block_out,
             requests_out, start_out, ctx_req_out, ctx_pos_out) -> tuple:
    """The op's arguments with the absent ones (empty tensors in the schema) as None: no
    drafts, no context rows, no context outputs."""
    absent = drafts.numel() == 0 and rows.numel() > 0
    no_ctx = ctx_rows.numel() == 0 and ctx_pos.numel() == 0
    no_ctx_out = ctx_req_out.numel() == 0 and ctx_pos_out.numel() == 0
    return (rows, last, start, None if absent else drafts, None if no_ctx else ctx_rows,
            None if no_ctx else ctx_pos, fill_id, scratch, block_out, requests_out, start_out,
            None if no_ctx_out else ctx_req_out, None if no_ctx_out else ctx_pos_out)


def _check_prepare(*args):
    a = _present(*args)
    check_prepare_args(*a[:6], *a[8:])


def _prepare_torch(*args):
    prepare_step_ref(*_present(*args))


# Default triton, the one GPU kernel of each loop op: one launch where the torch version takes
# ~25 (a commit) or ~12 (prepare_step_) small launches; with prepare_step_ in the loop, the e2e
# host loop's GPU idle time at B 1 S 1024 fell from 0.499 to 0.478 ms an iteration (H200).
dispatch.define_op(
    "greedy_commit_(Tensor block, Tensor post, Tensor rows, Tensor(a!) n_out, Tensor(b!) start, "
    "Tensor(c!) last, Tensor(d!) out_tokens, Tensor stop_ids, int max_new, Tensor(e!) kept, "
    "Tensor(f!) done, Tensor(g!) ctx_pos) -> ()",
    validate=_check_greedy, reference=_greedy_torch, fake=lambda *args: None, default="triton",
    debug_check=lambda *a: _debug_rows("greedy_commit_", a[2], a[3]))

dispatch.define_op(
    "sample_commit_(Tensor block, Tensor p, Tensor q, Tensor u, Tensor u_res, Tensor rows, "
    "Tensor(a!) n_out, Tensor(b!) start, Tensor(c!) last, Tensor(d!) out_tokens, "
    "Tensor stop_ids, int max_new, Tensor(e!) kept, Tensor(f!) done, Tensor(g!) ctx_pos, "
    "Tensor? q_idx=None) -> ()",
    validate=_check_sample, reference=_sample_torch, fake=lambda *args, **kw: None,
    default="triton",
    debug_check=lambda *a: _debug_rows("sample_commit_", a[5], a[6]))

dispatch.define_op(
    "prepare_step_(Tensor rows, Tensor last, Tensor start, Tensor drafts, Tensor ctx_rows, "
    "Tensor ctx_pos, int fill_id, int scratch, Tensor(a!) block_out, Tensor(b!) requests_out, "
    "Tensor(c!) start_out, Tensor(d!) ctx_req_out, Tensor(e!) ctx_pos_out) -> ()",
    validate=_check_prepare, reference=_prepare_torch, fake=lambda *args: None,
    default="triton", debug_check=lambda *a: _debug_rows("prepare_step_", a[0], n=a[1].shape[0]))


# --------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------
def _commit_outputs(block: torch.Tensor) -> tuple:
    """(kept [R] int64, done [R] bool, ctx_pos [R, B] int64), uninitialised. A block that is not
    [R, B] gets outputs the op's check rejects after naming block."""
    r = block.shape[0] if block.dim() >= 1 else 0
    b = block.shape[1] if block.dim() == 2 else 1
    return (torch.empty(r, dtype=torch.long, device=block.device),
            torch.empty(r, dtype=torch.bool, device=block.device),
            torch.empty(r, b, dtype=torch.long, device=block.device))


def greedy_commit(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int):
    """Greedy acceptance + commit in one kernel (``greedy_commit_ref``'s contract): block / post
    [R, B] int64, rows [R], n_out / start / last [N] and out_tokens [N, W] int64 (updated in
    place), stop_ids [S]. Returns (kept [R] int64, done [R] bool, ctx_pos [R, B] int64). Rows
    outside [0, N) and n_out < 0: see the module docstring."""
    outs = _commit_outputs(block)
    torch.ops.dflash.greedy_commit_.default(block, post, rows, n_out, start, last, out_tokens,
                                            stop_ids, max_new, *outs)
    return outs


def sample_commit(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new: int, q_idx=None):
    """Speculative rejection sampling + commit in one kernel (``sample_commit_ref``'s
    contract); p / q / u / u_res are fp32 (p, q with unit stride in V), the rest as
    ``greedy_commit``; drafts outside [0, V): see the module docstring. ``q_idx`` [R, B-1, k]
    int64: q is sparse, [R, B-1, k] values on those token ids (DFlash 2's selector q on its
    candidates): no [R, B-1, V] tensor. Returns (kept, done, ctx_pos)."""
    outs = _commit_outputs(block)
    torch.ops.dflash.sample_commit_.default(block, p, q, u, u_res, rows, n_out, start, last,
                                            out_tokens, stop_ids, max_new, *outs, q_idx)
    return outs


def prepare_step_(rows, last, start, drafts: Optional[torch.Tensor],
                  ctx_rows: Optional[torch.Tensor], ctx_pos: Optional[torch.Tensor],
                  fill_id: int, scratch: int, block_out, requests_out, start_out,
                  ctx_req_out: Optional[torch.Tensor] = None,
                  ctx_pos_out: Optional[torch.Tensor] = None) -> None:
    """Write a step's inputs in place (all int64, contiguous, on one device):

    * rows [R]: the state row (request slot) of each active request; last [N], start [N]: per
      slot, the last committed token and its position (what the commit kernels keep);
    * drafts [R, B-1] or None: the tokens after ``last`` (None: ``fill_id``, the draft step's
      block of masks);
    * block_out [P, B] (P >= R), requests_out [P], start_out [P]: row i < R gets
      ``[last[rows[i]], drafts[i] or fill_id...]``, ``rows[i]``, ``start[rows[i]]``; padding
      rows i >= R, and rows whose ``rows[i]`` is outside [0, N), get ``fill_id`` tokens, the
      ``scratch`` slot and start 0;
    * ctx_rows [Rc] and ctx_pos [Rc, B] (or both None: no context rows): the previous verify's
      requests and their rows' context positions (-1: not committed); ctx_req_out / ctx_pos_out
      [C] (C a multiple of B, >= Rc * B; or both None for the verify step): entry i < Rc * B gets
      ``(ctx_rows[i // B], ctx_pos[i // B, i % B])``, the rest ``(scratch, -1)``."""
    # the op takes absent tensors as empties (distinct ones: the outputs are mutable); which
    # are absent is checked here, everything else by the op
    _check_pairs(ctx_rows, ctx_pos, ctx_req_out, ctx_pos_out)
    b = block_out.shape[1] if block_out.dim() == 2 else 1
    torch.ops.dflash.prepare_step_.default(
        rows, last, start, drafts if drafts is not None else rows.new_empty(0, b - 1),
        ctx_rows if ctx_rows is not None else rows.new_empty(0),
        ctx_pos if ctx_pos is not None else rows.new_empty(0, b),
        int(fill_id), int(scratch), block_out, requests_out, start_out,
        ctx_req_out if ctx_req_out is not None else rows.new_empty(0),
        ctx_pos_out if ctx_pos_out is not None else rows.new_empty(0))


# --------------------------------------------------------------------------------------------
# Sample inputs
# --------------------------------------------------------------------------------------------
def _zero_outputs(r, b, device):
    return (torch.zeros(r, dtype=torch.long, device=device),
            torch.zeros(r, dtype=torch.bool, device=device),
            torch.zeros(r, b, dtype=torch.long, device=device))


def _commit_state(g, r, n, b, vocab, max_new, n_stop, device):
    rows = torch.randperm(n, generator=g)[:r]
    n_out = torch.randint(1, max_new + 1, (n,), generator=g)  # some with no room left
    start = torch.randint(5, 50, (n,), generator=g)
    last = torch.randint(0, vocab, (n,), generator=g)
    out = torch.randint(0, vocab, (n, max_new + b + 1), generator=g)
    stops = torch.randperm(vocab, generator=g)[:n_stop]
    return [t.to(device) for t in (rows, n_out, start, last, out, stops)]


def _greedy_sample(seed, device, r=5, n=8, b=8, vocab=6, n_stop=2, max_new=12):
    g = torch.Generator().manual_seed(seed)
    post = torch.randint(0, vocab, (r, b), generator=g)
    block = torch.randint(0, vocab, (r, b), generator=g)
    acc = torch.randint(0, b, (r,), generator=g)  # drafts copy post up to a chosen length
    for i in range(r):
        block[i, 1:acc[i] + 1] = post[i, :acc[i]]
    rows, n_out, start, last, out, stops = _commit_state(g, r, n, b, vocab, max_new, n_stop,
                                                         device)
    kept, done, ctx_pos = _zero_outputs(r, b, device)
    return dict(block=block.to(device), post=post.to(device), rows=rows, n_out=n_out, start=start,
                last=last, out_tokens=out, stop_ids=stops, max_new=max_new, kept=kept,
                done=done, ctx_pos=ctx_pos)


def _sample_sample(seed, device, r=4, n=6, b=4, vocab=40, n_stop=1, max_new=12, strided=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(r, b - 1, vocab, generator=g)
    p = torch.rand(r, b, vocab, generator=g)
    p[:, :b - 1] = torch.where(torch.rand(r, b - 1, 1, generator=g) < 0.5, q, p[:, :b - 1])
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(r, b - 1)
    block = torch.cat([torch.randint(0, vocab, (r, 1), generator=g), drafts], 1)
    u = torch.rand(r, b - 1, generator=g)
    u_res = torch.rand(r, generator=g)
    rows, n_out, start, last, out, stops = _commit_state(g, r, n, b, vocab, max_new, n_stop,
                                                         device)
    p, q = p.to(device), q.to(device)
    if strided:  # views with row strides past V (a slice of wider logits)
        p = torch.nn.functional.pad(p, (0, 5))[..., :vocab]
        q = torch.nn.functional.pad(q, (0, 3))[..., :vocab]
    kept, done, ctx_pos = _zero_outputs(r, b, device)
    return dict(block=block.to(device), p=p, q=q, u=u.to(device), u_res=u_res.to(device),
                rows=rows, n_out=n_out, start=start, last=last, out_tokens=out, stop_ids=stops,
                max_new=max_new, kept=kept, done=done, ctx_pos=ctx_pos)


def _sparse_q_sample(seed, device, r=4, b=4, vocab=40, k=5):
    """A sample_commit_ case with a sparse q (k candidates a row, the draft among them, as
    DFlash 2's selector gives): q_idx [R, B-1, k], q [R, B-1, k]."""
    kw = _sample_sample(seed, device, r=r, b=b, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 100)
    idx = torch.stack([torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(b - 1)])
                       for _ in range(r)])
    vals = torch.rand(r, b - 1, k, generator=g)
    vals = vals / vals.sum(-1, keepdim=True)
    pick = torch.multinomial(vals.reshape(-1, k), 1, generator=g).view(r, b - 1, 1)
    block = kw["block"].cpu().clone()
    block[:, 1:] = idx.gather(2, pick)[..., 0]
    kw.update(block=block.to(device), q=vals.to(device), q_idx=idx.to(device))
    return kw


def _prepare_sample(seed, device, r=3, n=7, b=4, pad=2, rc=2, c_extra=1, drafts=True,
                    ctx=True):
    g = torch.Generator().manual_seed(seed)
    p, c = r + pad, (rc + c_extra) * b if ctx else 0
    ctx_pos = torch.where(torch.rand(rc, b, generator=g) < 0.3, -1,
                          torch.randint(0, 500, (rc, b), generator=g))
    case = dict(rows=torch.randperm(n, generator=g)[:r],
                last=torch.randint(0, 1000, (n,), generator=g),
                start=torch.randint(0, 500, (n,), generator=g),
                drafts=torch.randint(0, 1000, (r if drafts else 0, b - 1), generator=g),
                ctx_rows=torch.randperm(n, generator=g)[:rc if ctx else 0],
                ctx_pos=ctx_pos if ctx else torch.empty(0, b, dtype=torch.long),
                fill_id=999, scratch=n - 1,
                block_out=torch.full((p, b), -7), requests_out=torch.full((p,), -7),
                start_out=torch.full((p,), -7), ctx_req_out=torch.full((c,), -7),
                ctx_pos_out=torch.full((c,), -7))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order (every
    tensor int64 / fp32 / bool whatever ``dtype``)."""
    return {
        "greedy_commit_": {"b8": _greedy_sample(0, device),
                           "b2-nostop": _greedy_sample(1, device, b=2, n_stop=0)},
        "sample_commit_": {"b4": _sample_sample(2, device),
                           "b2-strided": _sample_sample(3, device, b=2, strided=True),
                           "b4-sparse-q": _sparse_q_sample(4, device)},
        "prepare_step_": {"draft": _prepare_sample(4, device, drafts=False),
                          "verify": _prepare_sample(5, device, ctx=False)},
    }


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``); both commit ops share
    the cases on their common arguments."""
    I32, I64, F32 = torch.int32, torch.int64, torch.float32
    commit = [
        ("block-int32", to("block", dtype=I32), "block"),
        ("rows-len", sliced("rows", slice(None, -1)), "rows"),
        ("rows-float", to("rows", dtype=F32), "rows"),
        ("n_out-rank2", sliced("n_out", (slice(None), None)), "n_out"),
        ("start-len", sliced("start", slice(None, -1)), "start"),
        ("last-int32", to("last", dtype=I32), "last"),
        ("out_tokens-column-stride",
         set_(out_tokens=lambda kw: kw["out_tokens"].t().contiguous().t()), "out_tokens"),
        ("out_tokens-rows", sliced("out_tokens", slice(None, -1)), "out_tokens"),
        ("stop_ids-float", to("stop_ids", dtype=F32), "stop_ids"),
        ("stop_ids-meta", to("stop_ids", device=META), "stop_ids"),
        ("kept-int32", to("kept", dtype=I32), "kept"),
        ("done-int64", to("done", dtype=I64), "done"),
        ("ctx_pos-shape", set_(ctx_pos=lambda kw: kw["ctx_pos"][:, :-1].contiguous()),
         "ctx_pos"),
    ]
    return {
        "greedy_commit_": commit + [
            ("block-1d", sliced("block", 0), "block"),
            ("post-shape", sliced("post", (slice(None), slice(None, -1))), "post"),
            ("post-int32", to("post", dtype=I32), "post"),
        ],
        "sample_commit_": commit + [
            ("block-B1", sliced("block", (slice(None), slice(None, 1))), "block"),
            ("p-float64", to("p", dtype=torch.float64), "p"),
            ("p-vocab-stride",
             set_(p=lambda kw: kw["p"].transpose(1, 2).contiguous().transpose(1, 2)), "p"),
            ("p-empty-vocab", set_(p=lambda kw: kw["p"][..., :0], q=lambda kw: kw["q"][..., :0]),
             "p"),
            ("q-shape", sliced("q", (slice(None), slice(None, -1))), "q"),
            ("u-shape", sliced("u", (slice(None), slice(None, -1))), "u"),
            ("u_res-len", sliced("u_res", slice(None, -1)), "u_res"),
            ("u_res-meta", to("u_res", device=META), "u_res"),
        ],
        "prepare_step_": [
            ("rows-int32", to("rows", dtype=I32), "rows"),
            ("last-rank2", sliced("last", (slice(None), None)), "last"),
            ("start-len", sliced("start", slice(None, -1)), "start"),
            ("drafts-shape", set_(drafts=torch.zeros(3, 2, dtype=I64)), "drafts"),
            ("ctx_pos-shape", set_(ctx_pos=lambda kw: kw["ctx_pos"][:, :-1].contiguous()),
             "ctx_pos"),
            ("block_out-rows", set_(block_out=torch.zeros(2, 4, dtype=I64)), "block_out"),
            ("requests_out-len", set_(requests_out=torch.zeros(4, dtype=I64)), "requests_out"),
            ("start_out-int32", to("start_out", dtype=I32), "start_out"),
            ("ctx_req_out-multiple", set_(ctx_req_out=torch.zeros(9, dtype=I64),
                                          ctx_pos_out=torch.zeros(9, dtype=I64)),
             "ctx_req_out"),
            ("ctx_pos_out-int32", to("ctx_pos_out", dtype=I32), "ctx_pos_out"),
            ("ctx_pos_out-meta", to("ctx_pos_out", device=META), "ctx_pos_out"),
        ],
    }
