"""One drafter step with static buffers, replayable as a CUDA graph per padded batch size.

A step = the context precompute for up to ``max_batch * block_size`` newly committed tokens
(``add_context``) + the block forward of up to ``max_batch`` requests + the LM head on the mask
rows + argmax. Inputs are copied into static buffers (``load``); the batch is padded to a
bucket: padded context rows get position -1 (their slot is -1: written nowhere), padded block
rows run as a scratch request slot whose cache blocks nobody reads. ``run(bucket)`` runs the
step eagerly; ``capture(bucket)`` records it in a CUDA graph (``dispatch.capture_graph``: a
warm-up on a side stream, then the capture) and later ``run`` calls replay it. Outputs: ``tokens``
[bucket, B-1] (greedy drafts) and ``logits`` [bucket, B-1, V] (``DFlashDrafter.logits``: the
model dtype unless the config scales or soft-caps them; None with ``logits=False``: greedy
drafting), static tensors overwritten by each run. A DFlash 2 drafter sampling
(``select_temperature`` > 0) draws its drafts in the selector from the static uniforms ``u``
(the caller fills them before each run) and ``logits`` is then the selector's sparse q:
(q [bucket, B-1, k], candidate ids [bucket, B-1, k]).
``close()`` gives the scratch slot back.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import dispatch
from ..models.drafter import DFlashDrafter
from ..ops.loop import prepare_step_


class DraftStep:
    def __init__(self, drafter: DFlashDrafter, max_batch: int, scratch_request: int,
                 block_size: Optional[int] = None, logits: bool = True,
                 select_temperature: float = 0.0, own_scratch: bool = True):
        cfg = drafter.cfg
        self.want_logits = logits  # False (greedy): ``logits`` is None, argmax on the raw output
        # DFlash 2 sampling: the selector draws the drafts from the uniforms ``u`` (filled by
        # the caller before each run) and ``logits`` is its q [bucket, B-1, V]
        self.select_temperature = float(select_temperature)
        dev = drafter.device
        self.drafter, self.max_batch = drafter, max_batch
        self.b = cfg.block_size if block_size is None else block_size
        if self.b < 2:
            raise ValueError(f"DraftStep: block_size must be >= 2 (or None: the config's), got "
                             f"{block_size}")
        self.scratch = scratch_request
        n_ctx = max_batch * self.b
        width = cfg.n_taps * cfg.target_hidden_size
        self.ctx_hidden = torch.zeros(n_ctx, width, dtype=drafter.dtype, device=dev)
        self.ctx_req = torch.full((n_ctx,), scratch_request, dtype=torch.long, device=dev)
        self.ctx_pos = torch.full((n_ctx,), -1, dtype=torch.long, device=dev)
        self.block_ids = torch.full((max_batch, self.b), cfg.mask_token_id, dtype=torch.long,
                                    device=dev)
        self.requests = torch.full((max_batch,), scratch_request, dtype=torch.long, device=dev)
        self.start = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.u = torch.zeros(max_batch, max(self.b - 1, 0), dtype=torch.float32, device=dev)
        self.tokens: Optional[torch.Tensor] = None
        self.logits: Optional[torch.Tensor] = None
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._outs: Dict[int, tuple] = {}
        # padded block rows run at positions [0, B) of this slot: nobody reads its blocks (taken
        # last, so a failure above leaves the cache as it was); own_scratch=False: the caller
        # holds the slot (with room for B positions) for several steps
        self.own_scratch = own_scratch
        if own_scratch:
            drafter.cache.add_request(scratch_request, self.b)

    def bucket(self, n: int) -> int:
        """The padded batch size for n requests: the next power of two, at most max_batch."""
        if not 0 < n <= self.max_batch:
            raise ValueError(f"DraftStep: batch {n} outside [1, {self.max_batch}]")
        return min(self.max_batch, 1 << (n - 1).bit_length())

    def load(self, ctx_hidden, ctx_requests, ctx_positions, block_ids, requests, start) -> int:
        """Copy one step's inputs into the static buffers; returns the bucket to run."""
        n_ctx, r = ctx_hidden.shape[0], block_ids.shape[0]
        if n_ctx > self.ctx_hidden.shape[0]:
            raise ValueError(f"DraftStep.load: {n_ctx} context rows, at most "
                             f"{self.ctx_hidden.shape[0]} (max_batch * block_size)")
        if block_ids.shape[1] != self.b:
            raise ValueError(f"DraftStep.load: block_ids must be [R, {self.b}], got "
                             f"{list(block_ids.shape)}")
        bucket = self.bucket(r)
        self.ctx_hidden[:n_ctx].copy_(ctx_hidden)
        self.ctx_req[:n_ctx].copy_(ctx_requests)
        self.ctx_pos[:n_ctx].copy_(ctx_positions)
        self.ctx_req[n_ctx:].fill_(self.scratch)
        self.ctx_pos[n_ctx:].fill_(-1)
        self.block_ids[:r].copy_(block_ids)
        self.requests[:r].copy_(requests)
        self.start[:r].copy_(start)
        self.block_ids[r:bucket].fill_(self.drafter.cfg.mask_token_id)
        self.requests[r:bucket].fill_(self.scratch)
        self.start[r:bucket].fill_(0)
        return bucket

    def load_next(self, rows, last, start, ctx_hidden, ctx_rows, ctx_pos) -> int:
        """The loop's load, from the per-request state on the device: the block ``[last[rows[i]],
        MASK...]`` at ``start[rows[i]]`` for each active request (rows [R]; last, start [N] per
        request slot), and the previous verify's committed rows as context: ctx_hidden [Rc * B,
        width] with ctx_rows [Rc] (their requests) and ctx_pos [Rc, B] (positions, -1: not
        committed). One copy (ctx_hidden) + one ``prepare_step_`` launch; returns the bucket."""
        n_ctx = ctx_hidden.shape[0]
        if n_ctx > self.ctx_hidden.shape[0] or n_ctx != ctx_pos.numel():
            raise ValueError(f"DraftStep.load_next: ctx_hidden has {n_ctx} rows; it must have "
                             f"one per ctx_pos entry ({ctx_pos.numel()}) and at most "
                             f"{self.ctx_hidden.shape[0]} (max_batch * block_size)")
        bucket = self.bucket(rows.shape[0])
        self.ctx_hidden[:n_ctx].copy_(ctx_hidden)
        prepare_step_(rows, last, start, None, ctx_rows, ctx_pos, self.drafter.cfg.mask_token_id,
                      self.scratch, self.block_ids[:bucket], self.requests[:bucket],
                      self.start[:bucket], self.ctx_req, self.ctx_pos)
        return bucket

    def close(self) -> None:
        """Give the scratch request slot back to the drafter's cache (if this step took it)."""
        if self.own_scratch:
            self.drafter.cache.free_request(self.scratch)

    def _step(self, bucket: int) -> tuple:
        d = self.drafter
        d.add_context(self.ctx_hidden, self.ctx_req, self.ctx_pos)
        if self.select_temperature > 0:  # (drafts, (q [bucket, B-1, k], candidates))
            drafts, q, cand = d.propose_sampled(self.block_ids[:bucket], self.requests[:bucket],
                                                self.start[:bucket], self.select_temperature,
                                                self.u[:bucket])
            return drafts, (q, cand)
        return d.propose(self.block_ids[:bucket], self.requests[:bucket], self.start[:bucket],
                         logits=self.want_logits)

    def run(self, bucket: int) -> tuple:
        """(tokens [bucket, B-1], logits [bucket, B-1, V] or None); replays the graph if
        captured."""
        g = self._graphs.get(bucket)
        if g is None:
            self.tokens, self.logits = self._step(bucket)
            return self.tokens, self.logits
        g.replay()
        self.tokens, self.logits = self._outs[bucket]
        return self.tokens, self.logits

    def captured(self, bucket: int) -> bool:
        return bucket in self._graphs

    def capture(self, bucket: int) -> None:
        """Record the step for ``bucket`` in a CUDA graph (inputs: the static buffers). The
        warm-up before capture runs the step once for real on the loaded inputs (its cache
        writes are the ones a replay repeats, so load the step's inputs first)."""
        self._graphs[bucket], self._outs[bucket] = dispatch.capture_graph(
            lambda: self._step(bucket), self.drafter.device)
