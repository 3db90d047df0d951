"""Greedy acceptance and commit of a verified block in one Triton kernel (the speculator's hot
bookkeeping: the torch version, ``speculator.accept.greedy_commit_ref``, is ~25 small launches).

One program per active request r (row ``rows[r]`` of the per-request state):
* match = the leading drafts the target agrees with: block[r, j + 1] == post[r, j], j < B - 1;
* the new tokens are post[r, 0 .. match] (greedy: an accepted draft equals the target's token),
  cut after the first stop token and at max_new - n_out[row]: kept of them, written to
  out_tokens[row, n_out[row] + j];
* n_out[row] += kept, start[row] += kept, last[row] = the last new token (post[r, 0] when
  nothing is kept, as the reference), ctx_pos[r, j] = start + j for j < kept else -1 (the rows
  of the verify that become the drafter's context), kept[r], done[r].
Rows are distinct, so programs never touch the same state. Shapes only decide the launch
(B and the stop-list length as constexprs): graph-capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_commit_kernel(block_ptr, post_ptr, rows_ptr, n_out_ptr, start_ptr, last_ptr,
                          out_ptr, stop_ptr, ctx_pos_ptr, kept_ptr, done_ptr,
                          out_stride, out_width, n_stop, max_new,
                          B: tl.constexpr, BP: tl.constexpr, SP: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, BP)
    in_b = j < B
    row = tl.load(rows_ptr + r)
    post = tl.load(post_ptr + r * B + j, mask=in_b, other=0)
    drafts = tl.load(block_ptr + r * B + j + 1, mask=j < B - 1, other=0)
    agree = (drafts == post) & (j < B - 1)
    match = tl.min(tl.where(agree, B - 1, j), axis=0)  # first disagreement (B - 1: none)
    s = tl.arange(0, SP)
    stops = tl.load(stop_ptr + s, mask=s < n_stop, other=0)
    hit = (post[:, None] == stops[None, :]) & (s[None, :] < n_stop)
    is_stop = (tl.max(hit.to(tl.int32), axis=1) > 0) & (j <= match)
    first_stop = tl.min(tl.where(is_stop, j, B), axis=0)
    n_out = tl.load(n_out_ptr + row)
    room = max_new - n_out
    kept = tl.minimum(tl.minimum(match + 1, room), first_stop + 1)
    kept = tl.maximum(kept, 0)
    done = (kept >= room) | (first_stop < kept)
    col = n_out + j
    tl.store(out_ptr + row * out_stride + col, post, mask=(j < kept) & (col < out_width))
    last = tl.sum(tl.where(j == tl.maximum(kept - 1, 0), post, 0), axis=0)
    start = tl.load(start_ptr + row)
    tl.store(ctx_pos_ptr + r * B + j, tl.where(j < kept, start + j, -1), mask=in_b)
    tl.store(n_out_ptr + row, n_out + kept)
    tl.store(start_ptr + row, start + kept)
    tl.store(last_ptr + row, last)
    tl.store(kept_ptr + r, kept)
    tl.store(done_ptr + r, done.to(tl.int8))


def greedy_commit(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int):
    """See the module docstring; block/post [R, B] int64, rows [R], n_out/start/last [N] and
    out_tokens [N, W] int64 (updated in place), stop_ids [S]. Returns (kept [R] int64, done [R]
    bool, ctx_pos [R, B] int64)."""
    r, b = block.shape
    dev = block.device
    for name, t in (("rows", rows), ("n_out", n_out), ("start", start), ("last", last),
                    ("stop_ids", stop_ids)):
        if t.dtype != torch.long or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"greedy_commit: {name} must be a contiguous 1-D int64 tensor, got "
                             f"{t.dtype} {list(t.shape)} strides {list(t.stride())}")
    if out_tokens.dtype != torch.long or out_tokens.stride(1) != 1:
        raise ValueError(f"greedy_commit: out_tokens must be int64 with unit column stride, got "
                         f"{out_tokens.dtype} strides {list(out_tokens.stride())}")
    kept = torch.empty(r, dtype=torch.long, device=dev)
    done = torch.empty(r, dtype=torch.int8, device=dev)
    ctx_pos = torch.empty(r, b, dtype=torch.long, device=dev)
    if r == 0:
        return kept, done.bool(), ctx_pos
    stops = stop_ids if stop_ids.numel() else torch.zeros(1, dtype=torch.long, device=dev)
    _greedy_commit_kernel[(r,)](
        block.contiguous(), post.contiguous(), rows, n_out, start, last, out_tokens, stops,
        ctx_pos, kept, done, out_tokens.stride(0), out_tokens.shape[1], stop_ids.numel(),
        max_new, B=b, BP=triton.next_power_of_2(b),
        SP=triton.next_power_of_2(max(1, stop_ids.numel())))
    return kept, done.bool(), ctx_pos
