"""Committing a verified block on the device: no host round trip per request.

``commit_block`` turns (block, the target's tokens, accepted-draft counts) into each request's
committed tokens, cut at max_new_tokens and at the first stop token, written into a token
buffer, plus the bookkeeping the next iteration needs (committed count, the new last token,
done flags). All torch ops on the block's device, shapes fixed by [R, B]: nothing synchronises
and the whole step can sit in a CUDA graph.
"""
from __future__ import annotations

import torch


def commit_block(block: torch.Tensor, post: torch.Tensor, match: torch.Tensor,
                 n_out: torch.Tensor, max_new: int, stop_ids: torch.Tensor,
                 out_tokens: torch.Tensor, rows: torch.Tensor):
    """block [R, B]: [last token, drafts]; post [R, B]: post[r, match[r]] is the token the
    target gives after the accepted drafts (greedy: its argmax; sampling: the bonus or the
    residual draw); match [R]: accepted drafts; n_out [R]: tokens each request has; out_tokens
    [N, W] (W >= max_new + B) the token buffer, rows [R] its row per request.

    New tokens of request r: block[r, 1:match+1] then post[r, match], cut to max_new - n_out
    and after the first stop token. Writes them at out_tokens[rows[r], n_out[r]:] (columns past
    the committed count get garbage that later commits overwrite). Returns (kept [R], done [R],
    last [R]): committed count, finished flag, the last committed token."""
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
    cols = (n_out.long()[:, None] + j).clamp(max=out_tokens.shape[1] - 1)
    out_tokens[rows.long()[:, None], cols] = new
    last = new.gather(1, (kept - 1).clamp_min(0))
    return kept[:, 0], done[:, 0], last[:, 0]


def commit_update(block, post, match, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new: int):
    """commit_block with the per-request state updated in place: n_out, start, last (all [N],
    indexed by rows). Returns (kept [R], done [R] bool, ctx_pos [R, B]: start + j for the kept
    rows, -1 elsewhere: the verify rows that become the drafter's context)."""
    st = start[rows]
    kept, done, new_last = commit_block(block, post, match, n_out[rows], max_new, stop_ids,
                                        out_tokens, rows)
    j = torch.arange(block.shape[1], device=block.device)[None, :]
    ctx_pos = torch.where(j < kept[:, None], st[:, None] + j, torch.full_like(block, -1))
    n_out[rows] += kept
    start[rows] = st + kept
    last[rows] = new_last
    return kept, done, ctx_pos


def greedy_commit_ref(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int):
    """Greedy acceptance + commit + state update (the contract of ``triton.accept``): match =
    leading drafts block[:, 1:] equal to post[:, :-1], then ``commit_update``."""
    match = (block[:, 1:] == post[:, :-1]).int().cumprod(1).sum(1)
    return commit_update(block, post, match, rows, n_out, start, last, out_tokens, stop_ids,
                         max_new)


def greedy_commit(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int,
                  backend: str = "auto"):
    """``greedy_commit_ref``'s contract in one kernel: ``"triton"`` (triton/accept.py),
    ``"cuda"`` (``torch.ops.dflash_spec.greedy_commit_``, csrc/accept.cu, a warp a request; needs
    the CUDA extension) or the torch ops (``"torch"``). ``"auto"``: triton on CUDA tensors when
    installed, else torch (the CUDA kernel becomes the choice once measured on the GPU)."""
    if backend not in ("auto", "torch", "triton", "cuda"):
        raise ValueError(f"greedy_commit: backend must be auto, torch, triton or cuda, got "
                         f"{backend!r}")
    if backend == "auto":
        from .. import triton as _tr
        backend = "triton" if block.is_cuda and _tr.AVAILABLE else "torch"
    if backend == "torch":
        return greedy_commit_ref(block, post, rows, n_out, start, last, out_tokens, stop_ids,
                                 max_new)
    if backend == "cuda":
        op = getattr(getattr(torch.ops, "dflash_spec", None), "greedy_commit_", None) \
            if _cuda_extension_loaded() else None
        if op is None:
            raise RuntimeError("greedy_commit: backend 'cuda' needs the CUDA extension "
                               "(dflash_ops._C), which is not loaded")
        r, b = block.shape
        kept = torch.empty(r, dtype=torch.long, device=block.device)
        done = torch.empty(r, dtype=torch.bool, device=block.device)
        ctx_pos = torch.empty(r, b, dtype=torch.long, device=block.device)
        op(block.contiguous(), post.contiguous(), rows, n_out, start, last, out_tokens,
           stop_ids, max_new, kept, done, ctx_pos)
        return kept, done, ctx_pos
    from ..triton.accept import greedy_commit as kernel
    return kernel(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new)


def _cuda_extension_loaded() -> bool:
    from .. import _ext
    return _ext.load()["how"] != "absent"
