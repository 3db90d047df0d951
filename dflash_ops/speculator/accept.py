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
    after B-1 acceptances the bonus from p_{B-1}, with u_res through ``inverse_cdf``.
    Returns (match [R] int64, post [R, B] int64: the drawn token at column match, the drafts
    shifted left elsewhere, what ``commit_update`` reads)."""
    r, b = block.shape
    d = block[:, 1:, None]
    p_d = p[:, :-1].gather(-1, d)[..., 0].float()
    q_d = q.gather(-1, d)[..., 0].float()
    match = (u * q_d < p_d).int().cumprod(1).sum(1).long()
    ar = torch.arange(r, device=block.device)
    pm = p[ar, match].float()
    qm = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[ar, match].float()  # 0 after B-1 drafts
    resid = (pm - qm).clamp_min(0)
    dist = torch.where((resid.sum(-1) > 0)[:, None], resid, pm)
    token = inverse_cdf(dist, u_res.float())
    post = torch.cat([block[:, 1:], block[:, :1]], 1).clone()
    post[ar, match] = token
    return match, post


def sample_commit_ref(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                      max_new: int):
    """``sample_accept_ref`` then ``commit_update``: (kept [R], done [R], ctx_pos [R, B])."""
    match, post = sample_accept_ref(block, p, q, u, u_res)
    return commit_update(block, post, match, rows, n_out, start, last, out_tokens, stop_ids,
                         max_new)


def sample_commit(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new: int, backend: str = "auto"):
    """``sample_commit_ref``'s contract: ``"triton"`` (one program a request,
    triton/accept.py), ``"cuda"`` (``torch.ops.dflash_spec.sample_commit_``, csrc/accept.cu, a
    CTA a request; needs the CUDA extension), the torch ops (``"torch"``), or ``"auto"``: triton
    on CUDA tensors when installed, else torch (the CUDA kernel becomes the choice once
    measured). p / q / u / u_res are fp32 (p, q with unit stride in V)."""
    backend = _backend(backend, "sample_commit", block)
    check_commit_args("sample_commit", block, rows, n_out, start, last, out_tokens, stop_ids,
                      probs=(p, q, u, u_res))
    if backend == "torch":
        return sample_commit_ref(block, p, q, u, u_res, rows, n_out, start, last, out_tokens,
                                 stop_ids, max_new)
    if backend == "cuda":
        outs = _outputs(block)
        _spec_op("sample_commit_", "sample_commit")(
            block.contiguous(), p, q, u.contiguous(), u_res.contiguous(), rows, n_out, start,
            last, out_tokens, stop_ids, max_new, *outs)
        return outs
    from ..triton.accept import sample_commit as kernel
    return kernel(block, p, q, u, u_res, rows, n_out, start, last, out_tokens, stop_ids,
                  max_new)


def greedy_commit(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new: int,
                  backend: str = "auto"):
    """``greedy_commit_ref``'s contract in one kernel: ``"triton"`` (triton/accept.py),
    ``"cuda"`` (``torch.ops.dflash_spec.greedy_commit_``, csrc/accept.cu, a warp a request; needs
    the CUDA extension) or the torch ops (``"torch"``). ``"auto"``: triton on CUDA tensors when
    installed, else torch (the CUDA kernel becomes the choice once measured on the GPU)."""
    backend = _backend(backend, "greedy_commit", block)
    check_commit_args("greedy_commit", block, rows, n_out, start, last, out_tokens, stop_ids,
                      post=post)
    if backend == "torch":
        return greedy_commit_ref(block, post, rows, n_out, start, last, out_tokens, stop_ids,
                                 max_new)
    if backend == "cuda":
        outs = _outputs(block)
        _spec_op("greedy_commit_", "greedy_commit")(
            block.contiguous(), post.contiguous(), rows, n_out, start, last, out_tokens,
            stop_ids, max_new, *outs)
        return outs
    from ..triton.accept import greedy_commit as kernel
    return kernel(block, post, rows, n_out, start, last, out_tokens, stop_ids, max_new)


def check_commit_args(op: str, block, rows, n_out, start, last, out_tokens, stop_ids,
                      post=None, probs=None) -> None:
    """ValueError naming the argument (expected vs given) before anything is written: block
    [R, B] int64 (B >= 2 with ``probs``), post [R, B] int64, rows [R], n_out / start / last
    [N] and stop_ids [S] contiguous int64, out_tokens [N, W] int64 with unit column stride, all
    on block's device; ``probs`` = (p, q, u, u_res): fp32 [R, B, V], [R, B-1, V], [R, B-1],
    [R], unit stride in the last dim."""
    def fail(msg):
        raise ValueError(f"{op}: {msg}")

    def desc(t):
        return f"{t.dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}"

    dev = block.device
    if block.dtype != torch.long or block.dim() != 2 or block.shape[1] < (2 if probs else 1):
        fail(f"block must be int64 [R, B] with B >= {2 if probs else 1}, got {desc(block)}")
    r, b = block.shape
    ints = [("rows", rows, (r,)), ("n_out", n_out, None), ("start", start, None),
            ("last", last, None), ("stop_ids", stop_ids, None)]
    n = n_out.shape[0] if n_out.dim() == 1 else -1
    for name, t, shape in ints:
        want = shape or ((n,) if name != "stop_ids" else tuple(t.shape))
        if (t.dtype != torch.long or t.dim() != 1 or tuple(t.shape) != want
                or not t.is_contiguous() or t.device != dev):
            fail(f"{name} must be a contiguous 1-D int64 tensor of {list(want)} on {dev}, "
                 f"got {desc(t)}")
    if (out_tokens.dtype != torch.long or out_tokens.dim() != 2 or out_tokens.shape[0] != n
            or out_tokens.stride(1) != 1 or out_tokens.device != dev):
        fail(f"out_tokens must be int64 [{n}, W] with unit column stride on {dev}, got "
             f"{desc(out_tokens)}")
    if post is not None and (post.dtype != torch.long or tuple(post.shape) != (r, b)
                             or post.device != dev):
        fail(f"post must be int64 {[r, b]} on {dev}, got {desc(post)}")
    if probs is not None:
        p = probs[0]
        v = p.shape[-1] if p.dim() == 3 else -1
        for name, t, shape in zip(("p", "q", "u", "u_res"), probs,
                                  ((r, b, v), (r, b - 1, v), (r, b - 1), (r,))):
            if (t.dtype != torch.float32 or tuple(t.shape) != shape or t.device != dev
                    or (t.numel() and t.stride(-1) != 1)):
                fail(f"{name} must be fp32 {list(shape)} with unit stride in its last dim on "
                     f"{dev}, got {desc(t)}")


def _backend(backend: str, caller: str, block: torch.Tensor) -> str:
    """The backend to run: "auto" is triton on CUDA tensors when installed, else torch."""
    if backend not in ("auto", "torch", "triton", "cuda"):
        raise ValueError(f"{caller}: backend must be auto, torch, triton or cuda, got "
                         f"{backend!r}")
    if backend == "auto":
        from .. import triton as _tr
        backend = "triton" if block.is_cuda and _tr.AVAILABLE else "torch"
    return backend


def _outputs(block: torch.Tensor) -> tuple:
    """(kept [R] int64, done [R] bool, ctx_pos [R, B] int64), uninitialised, for the CUDA ops."""
    r, b = block.shape
    return (torch.empty(r, dtype=torch.long, device=block.device),
            torch.empty(r, dtype=torch.bool, device=block.device),
            torch.empty(r, b, dtype=torch.long, device=block.device))


def _spec_op(name: str, caller: str):
    """torch.ops.dflash_spec.<name> (csrc/accept.cu), or a RuntimeError saying why not."""
    op = getattr(getattr(torch.ops, "dflash_spec", None), name, None) \
        if _cuda_extension_loaded() else None
    if op is None:
        raise RuntimeError(f"{caller}: backend 'cuda' needs the CUDA extension "
                           f"(dflash_ops._C), which is not loaded")
    return op


def _cuda_extension_loaded() -> bool:
    from .. import _ext
    return _ext.load()["how"] != "absent"
