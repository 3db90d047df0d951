"""Preparing a step's static inputs on the device: one kernel instead of a dozen small copies.

Before each draft step the loop needs, in the step's static buffers, the block of every active
request (``[last token, MASK x (B-1)]``), its request slot and start position, padding rows up
to the bucket, and the context rows the previous verify committed (their request slot and
position, -1 past them); before the verify step the same block with the drafts in place of the
masks. ``prepare_step_`` writes all of it in one launch from the per-request state the commit
kernels keep on the device (``last``, ``start``); the torch version (``prepare_step_ref``) is
~10 indexing / copy / fill launches. Shapes alone decide the launch (graph-safe; nothing is
read on the host).

Backends as ``accept.greedy_commit``: ``"triton"`` (triton/accept.py ``prepare_step``),
``"cuda"`` (``torch.ops.dflash_spec.prepare_step_``, csrc/prepare.cu), ``"torch"``; ``"auto"``
is triton on CUDA tensors when installed, else torch.
"""
from __future__ import annotations

from typing import Optional

import torch

from .accept import _backend, _spec_op


def prepare_step_ref(rows, last, start, drafts, ctx_rows, ctx_pos, fill_id: int, scratch: int,
                     block_out, requests_out, start_out, ctx_req_out, ctx_pos_out) -> None:
    """``prepare_step_``'s contract in torch ops (arguments there)."""
    r, p_rows, b = rows.shape[0], block_out.shape[0], block_out.shape[1]
    rows = rows.long()
    block_out[:r, 0] = last[rows]
    block_out[:r, 1:] = drafts if drafts is not None else fill_id
    block_out[r:] = fill_id
    requests_out[:r] = rows
    requests_out[r:p_rows] = scratch
    start_out[:r] = start[rows]
    start_out[r:p_rows] = 0
    if ctx_req_out is not None:
        n = ctx_rows.shape[0] * b if ctx_rows is not None else 0
        if n:
            ctx_req_out[:n] = ctx_rows.long()[:, None].expand(-1, b).reshape(-1)
            ctx_pos_out[:n] = ctx_pos.reshape(-1)
        ctx_req_out[n:] = scratch
        ctx_pos_out[n:] = -1


def prepare_step_(rows, last, start, drafts: Optional[torch.Tensor],
                  ctx_rows: Optional[torch.Tensor], ctx_pos: Optional[torch.Tensor],
                  fill_id: int, scratch: int, block_out, requests_out, start_out,
                  ctx_req_out: Optional[torch.Tensor] = None,
                  ctx_pos_out: Optional[torch.Tensor] = None, backend: str = "auto") -> None:
    """Write a step's inputs in place (all int64, contiguous, on one device):

    * rows [R]: the state row (request slot) of each active request; last [N], start [N]: per
      slot, the last committed token and its position (what the commit kernels keep);
    * drafts [R, B-1] or None: the tokens after ``last`` (None: ``fill_id``, the draft step's
      block of masks);
    * block_out [P, B] (P >= R), requests_out [P], start_out [P]: row i < R gets
      ``[last[rows[i]], drafts[i] or fill_id...]``, ``rows[i]``, ``start[rows[i]]``; padding
      rows i >= R get ``fill_id`` tokens, the ``scratch`` slot and start 0;
    * ctx_rows [Rc] and ctx_pos [Rc, B] (or both None: no context rows): the previous verify's
      requests and their rows' context positions (-1: not committed); ctx_req_out / ctx_pos_out
      [C] (C a multiple of B, >= Rc * B; or both None for the verify step): entry i < Rc * B gets
      ``(ctx_rows[i // B], ctx_pos[i // B, i % B])``, the rest ``(scratch, -1)``."""
    backend = _backend(backend, "prepare_step_", rows)
    check_prepare_args(rows, last, start, drafts, ctx_rows, ctx_pos, block_out, requests_out,
                       start_out, ctx_req_out, ctx_pos_out)
    if backend == "torch":
        return prepare_step_ref(rows, last, start, drafts, ctx_rows, ctx_pos, fill_id, scratch,
                                block_out, requests_out, start_out, ctx_req_out, ctx_pos_out)
    b = block_out.shape[1]
    args = (rows, last, start,  # absent tensors: distinct empties (the outputs are mutable)
            drafts if drafts is not None else rows.new_empty(0, b - 1),
            ctx_rows if ctx_rows is not None else rows.new_empty(0),
            ctx_pos if ctx_pos is not None else rows.new_empty(0, b),
            int(fill_id), int(scratch), block_out, requests_out, start_out,
            ctx_req_out if ctx_req_out is not None else rows.new_empty(0),
            ctx_pos_out if ctx_pos_out is not None else rows.new_empty(0))
    if backend == "cuda":
        _spec_op("prepare_step_", "prepare_step_")(*args)
        return None
    from ..triton.accept import prepare_step as kernel
    kernel(*args)
    return None


def check_prepare_args(rows, last, start, drafts, ctx_rows, ctx_pos, block_out, requests_out,
                       start_out, ctx_req_out, ctx_pos_out) -> None:
    """ValueError naming the argument (expected vs given) before anything is written."""
    def fail(msg):
        raise ValueError(f"prepare_step_: {msg}")

    def desc(t):
        return f"{t.dtype} {list(t.shape)} on {t.device}"

    dev = rows.device

    def want(name, t, shape):
        if (t.dtype != torch.long or tuple(t.shape) != tuple(shape) or not t.is_contiguous()
                or t.device != dev):
            fail(f"{name} must be a contiguous int64 tensor of {list(shape)} on {dev}, got "
                 f"{desc(t)}")

    if rows.dtype != torch.long or rows.dim() != 1 or not rows.is_contiguous():
        fail(f"rows must be a contiguous 1-D int64 tensor, got {desc(rows)}")
    r = rows.shape[0]
    if last.dim() != 1:
        fail(f"last must be a contiguous 1-D int64 tensor, got {desc(last)}")
    n = last.shape[0]
    want("last", last, (n,))
    want("start", start, (n,))
    if block_out.dim() != 2 or block_out.shape[0] < r or block_out.shape[1] < 1:
        fail(f"block_out must be int64 [P, B] with P >= {r} (rows' length), got "
             f"{desc(block_out)}")
    p_rows, b = block_out.shape
    want("block_out", block_out, (p_rows, b))
    want("requests_out", requests_out, (p_rows,))
    want("start_out", start_out, (p_rows,))
    if drafts is not None:
        want("drafts", drafts, (r, b - 1))
    if (ctx_rows is None) != (ctx_pos is None):
        fail("ctx_rows and ctx_pos go together (both None: no context rows)")
    if (ctx_req_out is None) != (ctx_pos_out is None):
        fail("ctx_req_out and ctx_pos_out go together (both None: no context outputs)")
    if ctx_rows is not None:
        if ctx_req_out is None:
            fail("ctx_rows given without ctx_req_out / ctx_pos_out to write them to")
        if ctx_rows.dim() != 1:
            fail(f"ctx_rows must be a contiguous 1-D int64 tensor, got {desc(ctx_rows)}")
        want("ctx_rows", ctx_rows, (ctx_rows.shape[0],))
        want("ctx_pos", ctx_pos, (ctx_rows.shape[0], b))
    if ctx_req_out is not None:
        c = ctx_req_out.shape[0] if ctx_req_out.dim() == 1 else -1
        rc = ctx_rows.shape[0] if ctx_rows is not None else 0
        if c < rc * b or c % b:
            fail(f"ctx_req_out must be int64 [C] with C a multiple of B = {b} and >= "
                 f"{rc * b} (ctx_rows x B), got {desc(ctx_req_out)}")
        want("ctx_req_out", ctx_req_out, (c,))
        want("ctx_pos_out", ctx_pos_out, (c,))
