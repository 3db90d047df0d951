"""The target's verify step with static buffers, replayable as a CUDA graph per padded batch size
(the counterpart of ``draft_step.DraftStep``).

A step = the target forward of up to ``max_batch`` blocks of B tokens (causal, paged KV) + the
greedy tokens per row + the tap hidden states the drafter needs. Inputs are copied into static
buffers (``load``); padded requests run as a scratch request slot at positions [0, B) whose
cache blocks nobody reads. Outputs (static, overwritten by each run): ``logits`` [bucket, B, V] fp32
(None with ``logits=False``: greedy verification, the argmax taken on the model-dtype logits),
``post`` [bucket, B] (argmax per row) and ``taps`` [bucket * B, n_taps * H]. ``close()`` gives
the scratch slot back.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .. import dispatch
from ..ops.loop import prepare_step_
from ..ops.select import argmax_last


class VerifyStep:
    def __init__(self, target, max_batch: int, block_size: int, tap_layers: Sequence[int],
                 scratch_request: int, logits: bool = True, own_scratch: bool = True,
                 context_drafter=None):
        dev = target.device
        self.want_logits = logits  # False (greedy): ``logits`` is None, argmax on model dtype
        self.target, self.max_batch, self.b = target, max_batch, block_size
        self.tap_layers = list(tap_layers)
        self.scratch = scratch_request
        self.ids = torch.zeros(max_batch, block_size, dtype=torch.long, device=dev)
        self.requests = torch.full((max_batch,), scratch_request, dtype=torch.long, device=dev)
        self.start = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.q_lens = torch.full((max_batch,), block_size, dtype=torch.long, device=dev)
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._outs: Dict[int, tuple] = {}
        self.own_scratch = own_scratch  # False: the caller holds the slot for several steps
        # a decode step (block 1) of the policy: the input token's taps go to this drafter's
        # context inside the step (and its graph); the token is committed already, so its row
        # is context whatever the step's outcome (padded rows: the drafter's scratch slot)
        if context_drafter is not None and block_size != 1:
            raise ValueError(f"VerifyStep: context_drafter is for block_size 1 (decode), got "
                             f"block_size {block_size}")
        self.context_drafter = context_drafter
        # False: the caller adds the step's context rows itself (the policy's decode iteration
        # gathers a whole iteration's rows and adds them in one call: one weight read)
        self.add_context_in_step = True
        if own_scratch:  # last: a failure above changes nothing
            target.add_request(scratch_request, block_size)

    def bucket(self, n: int) -> int:
        if not 0 < n <= self.max_batch:
            raise ValueError(f"VerifyStep: batch {n} outside [1, {self.max_batch}]")
        return min(self.max_batch, 1 << (n - 1).bit_length())

    def load(self, ids: torch.Tensor, requests: torch.Tensor, start: torch.Tensor) -> int:
        r = ids.shape[0]
        if ids.shape[1] != self.b:
            raise ValueError(f"VerifyStep.load: ids must be [R, {self.b}], got {list(ids.shape)}")
        bucket = self.bucket(r)
        self.ids[:r].copy_(ids)
        self.requests[:r].copy_(requests)
        self.start[:r].copy_(start)
        self.ids[r:bucket].zero_()
        self.requests[r:bucket].fill_(self.scratch)
        self.start[r:bucket].zero_()
        return bucket

    def load_next(self, rows, last, start, drafts) -> int:
        """The loop's load, from the per-request state on the device: the block ``[last[rows[i]],
        drafts[i]...]`` at ``start[rows[i]]`` (rows [R]; last, start [N] per request slot; drafts
        [R, B-1]) in one ``prepare_step_`` launch; returns the bucket. ``ids[:R]`` is then the
        verified block."""
        bucket = self.bucket(rows.shape[0])
        prepare_step_(rows, last, start, drafts.contiguous(), None, None, 0, self.scratch,
                      self.ids[:bucket], self.requests[:bucket], self.start[:bucket])
        return bucket

    def close(self) -> None:
        """Give the scratch request slot back to the target's cache (if this step took it)."""
        if self.own_scratch:
            self.target.free_request(self.scratch)

    def _step(self, bucket: int) -> tuple:
        logits, taps = self.target.forward(self.ids[:bucket].reshape(-1),
                                           self.requests[:bucket], self.start[:bucket],
                                           self.q_lens[:bucket], self.tap_layers,
                                           fp32_logits=self.want_logits)
        if self.context_drafter is not None and self.add_context_in_step:
            self.context_drafter.add_context(taps, self.requests[:bucket], self.start[:bucket])
        logits = logits.view(bucket, self.b, -1)
        post = argmax_last(logits)  # = logits.argmax(-1), on row_argmax's kernels
        return (logits if self.want_logits else None), post, taps

    def run(self, bucket: int) -> tuple:
        """(logits [bucket, B, V] or None, post [bucket, B], taps); replays the graph if
        captured."""
        g: Optional[torch.cuda.CUDAGraph] = self._graphs.get(bucket)
        if g is None:
            return self._step(bucket)
        g.replay()
        return self._outs[bucket]

    def captured(self, bucket: int) -> bool:
        return bucket in self._graphs

    def capture(self, bucket: int) -> None:
        """Record the step for ``bucket`` (the warm-up runs it once on the loaded inputs)."""
        self._graphs[bucket], self._outs[bucket] = dispatch.capture_graph(
            lambda: self._step(bucket), self.target.device)
