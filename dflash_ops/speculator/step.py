"""One draft-and-verify iteration for the active requests: the body of ``speculative_generate``'s
loop and of the e2e benchmark's host loop (``bench.e2e``).

``Iteration(target, drafter, block_size, ...)(state, rows)`` for the active requests ``rows``
(request slots, [R] on the device), reading and updating the per-request device ``State``:

1. draft: the block ``[last, MASK x (B-1)]`` at positions ``start .. start + B - 1`` of each
   request (``start`` = the committed length before ``last``) -> B-1 greedy drafts, or drafts
   sampled from the drafter's distribution q (``sampling``);
2. verify: the target runs the block ``[last, drafts]`` (causal, its own paged KV) -> the
   posterior (argmax per row), or the target's distribution p (``sampling``), and the tap
   hidden states of every row;
3. accept and commit, one ``ops.loop`` kernel on the device: ``greedy_commit`` keeps the
   longest prefix where ``draft[j] == posterior[j-1]`` plus the target's token at the first
   mismatch; ``sample_commit`` keeps draft j with probability min(1, p_{j-1}(d_j) / q_j(d_j)),
   draws the token at the first rejection from normalise(max(p - q, 0)) and, after B-1
   acceptances, the bonus from p (so the output has the target's distribution). Either commits
   ``accepted + 1`` tokens cut at a stop token or max_new, and updates n_out, start, last;
4. the committed rows' tap hidden states (rows ``0 .. accepted``) become the drafter's context
   K/V: added at once (direct calls and the one-step iteration below), or kept in
   ``state.pending`` for the next draft step, which adds them first. KV of rejected positions
   stays in both caches but is never visible (attention is bounded by each request's length)
   and is overwritten next iteration.

The host reads the done flags and committed counts once an iteration (``time_stages`` adds a
synchronisation after the draft and the verify, to time them: ``Stats.seconds``).

``steps=(DraftStep, VerifyStep)`` runs draft and verify on static buffers padded to a bucket
(the next power of two of the active requests, at most the batch), filled from the state by one
``prepare_step_`` launch each; the padded rows run as the steps' scratch request slot. With
``graphs`` each step's CUDA graph is captured on the first use of a bucket (one sync, its time
in ``Stats.seconds["capture"]``) and replayed from then on. Greedy, with those steps and no
stage timing, the iteration runs as one step (``Iteration.one``): 1-4 above and the flags in
one call, with ``graphs`` one CUDA graph a bucket, so the GPU waits for the host once an
iteration instead of between the steps' launches; its time is counted as draft time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .. import dispatch
from ..ops.loop import greedy_commit, prepare_step_, sample_commit
from ..ops.select import argmax_last


@dataclass
class Stats:
    iterations: int = 0
    committed: int = 0
    host_syncs: int = 0  # device-to-host reads, and synchronisations on CUDA
    steps: str = "direct"
    acceptance: List[int] = field(default_factory=list)  # tokens committed per request-iteration
    # (drafting iterations only; the policy's decode iterations commit a token a step)
    drafted: int = 0  # drafts proposed: block - 1 per request of each drafting iteration
    blocks: dict = field(default_factory=dict)  # iterations per block size (1: decode, policy)
    decode_steps: int = 0  # the target's decode steps in decode iterations (greedy with static
    # steps: DECODE_STEPS an iteration; direct or sampling: 1)
    seconds: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0,
                                                   "verify": 0.0, "accept": 0.0,
                                                   "capture": 0.0})

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance) / max(1, len(self.acceptance))


def sync_device(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature <= 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sampling needs temperature > 0, top_p in (0, 1], top_k >= 0; got "
                         f"{temperature}, {top_p}, {top_k}")


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                      top_k: int = 0) -> torch.Tensor:
    """Sampling distribution over the last dim: softmax(logits / temperature), cut to the top_k
    tokens (0: all) and to the smallest set whose mass reaches top_p, renormalised."""
    _check_sampling(temperature, top_p, top_k)
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if top_p < 1:
        sp, order = p.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p  # the tokens needed to reach top_p
        p = torch.zeros_like(p).scatter(-1, order, sp * keep)
        p = p / p.sum(-1, keepdim=True)
    return p


@dataclass(frozen=True)
class Sampling:
    """Sampling settings (``probs_from_logits``'s); ``generator``: on the target's device, for
    every random draw."""
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    generator: Optional[torch.Generator] = None

    def __post_init__(self):
        _check_sampling(self.temperature, self.top_p, self.top_k)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_p, self.top_k)

    def draw(self, p: torch.Tensor) -> torch.Tensor:
        """One token per distribution p [..., V]."""
        return torch.multinomial(p.reshape(-1, p.shape[-1]), 1,
                                 generator=self.generator).view(p.shape[:-1])


@dataclass
class State:
    """The loop's per-request device state, indexed by request slot (N of them; int64):
    out_tokens [N, W] the committed tokens (n_out [N] of them), last [N] the last committed
    token, start [N] its position; the commit kernels update them in place. stop [S]: the stop
    token ids; max_new: the tokens a request may commit. pending: the last verify's committed
    rows, for the next draft step to add as context (steps only): (taps [Rc * B, width], their
    request slots [Rc], positions [Rc, B], -1 where not committed)."""
    out_tokens: torch.Tensor
    n_out: torch.Tensor
    last: torch.Tensor
    start: torch.Tensor
    stop: torch.Tensor
    max_new: int
    pending: tuple

    @classmethod
    def after_prefill(cls, first: torch.Tensor, prompt_lens, stop_ids, max_new: int,
                      block: int, ctx_width: int, ctx_dtype) -> "State":
        """Each request's first token (first [N]) committed at position its prompt length; no
        pending context rows (the prefill added them)."""
        n, dev = first.shape[0], first.device
        out = torch.zeros(n, max_new + block + 1, dtype=torch.long, device=dev)
        out[:, 0] = first
        long = dict(dtype=torch.long, device=dev)
        return cls(out, torch.ones(n, **long), first.clone(), torch.tensor(prompt_lens, **long),
                   torch.tensor(sorted(stop_ids), **long), max_new,
                   (torch.zeros(0, ctx_width, dtype=ctx_dtype, device=dev),
                    torch.zeros(0, **long), torch.zeros(0, block, **long)))


def check_pair(target, drafter, fn: str) -> None:
    """ValueError (from ``fn``, naming both sizes) unless the drafter fits the target: the same
    vocabulary, tap hidden states the drafter's ``fc`` can read (n_taps x target_hidden_size
    from layers the target has), and an embedding and LM head as wide as the drafter's hidden
    size (they are usually the target's) whose token ids are the target's."""
    tc, dc = target.cfg, drafter.cfg
    vocab, hid = tc.vocab_size, dc.hidden_size
    if dc.vocab_size != vocab:
        raise ValueError(f"{fn}: vocabulary: the target's is {vocab}, the drafter's "
                         f"{dc.vocab_size} (drafter.cfg.vocab_size)")
    ids = list(dc.target_layer_ids)
    if not all(0 <= i < tc.num_layers for i in ids):
        raise ValueError(f"{fn}: target_layer_ids: the drafter taps {ids}, the target has "
                         f"layers 0..{tc.num_layers - 1}")
    if dc.target_hidden_size != tc.hidden_size:
        raise ValueError(f"{fn}: tap hidden states: the drafter reads {dc.n_taps} x "
                         f"{dc.target_hidden_size} = {dc.fc_in_features} (n_taps x "
                         f"target_hidden_size), the target gives {dc.n_taps} x "
                         f"{tc.hidden_size} = {dc.n_taps * tc.hidden_size}")
    # draft ids index the target's embedding directly unless d2t maps them; a stand-in
    # drafter without these weights (tests' scripted drafters) is checked on its config only
    rows = vocab if getattr(drafter, "d2t", None) is None else dc.out_vocab_size
    for name, attr, want in (("embedding", "embed", vocab), ("LM head", "lm_head", rows)):
        w = getattr(drafter, attr, None)
        if w is not None and tuple(w.shape) != (want, hid):
            raise ValueError(f"{fn}: {name}: the drafter's is {list(w.shape)}, its hidden_size "
                             f"{hid}; expected [{want}, {hid}] (the target's vocabulary is "
                             f"{vocab}, its hidden size {tc.hidden_size})")


class Iteration:
    """The iteration (module docstring) for a target / drafter pair: direct model calls, or the
    static ``steps`` (a DraftStep and a VerifyStep of ``block_size``), captured as CUDA graphs
    with ``graphs``. ``stats``: where the counters and stage times go (a fresh Stats by
    default)."""

    def __init__(self, target, drafter, block_size: int, *, sampling: Optional[Sampling] = None,
                 steps: Optional[tuple] = None, graphs: bool = False,
                 stats: Optional[Stats] = None, time_stages: bool = False):
        check_pair(target, drafter, "Iteration")
        self.target, self.drafter, self.b = target, drafter, block_size
        self.sampling = sampling
        self.dstep, self.vstep = steps if steps is not None else (None, None)
        self.graphs = graphs
        self.stats = Stats() if stats is None else stats
        self.device = target.device
        self.sync_stages = time_stages and torch.device(self.device).type == "cuda"
        # greedy static steps without stage timing (its stages are not apart, on any device):
        # the whole iteration as one step (``_one_step``; graphed: one graph per bucket):
        # prepare the draft block, draft, prepare the verify block, verify, commit, the
        # committed rows' context, the flags; the host replays it and reads the flags, so the
        # GPU waits for the host once an iteration, not between the steps' eager launches
        # (issue 19)
        ds, vs = self.dstep, self.vstep
        self.one = (sampling is None and ds is not None and vs is not None
                    and not ds.want_logits and not vs.want_logits
                    and ds.select_temperature == 0 and not time_stages)
        self._one_graphs: dict = {}  # bucket -> (graph, outputs) for self._one_state
        self._one_state: Optional[State] = None
        self._rows_key: Optional[torch.Tensor] = None  # the rows self._rows holds
        if self.one:  # the active request slots, -1 past them (padding: no commit)
            long = dict(dtype=torch.long, device=self.device)
            self._rows = torch.full((vs.max_batch,), -1, **long)
            self._acc = torch.zeros(2, vs.max_batch, **long)  # (done, kept)

    def _load_rows(self, rows: torch.Tensor, bucket: int) -> None:
        """``self._rows[:bucket]``: rows, then -1 (a new copy only when the loop's rows tensor
        is a new one: it makes one when the active set changes)."""
        if rows is not self._rows_key:
            self._rows[:bucket].fill_(-1)
            self._rows[:rows.shape[0]].copy_(rows)
            self._rows_key = rows

    def __call__(self, state: State, rows: torch.Tensor) -> Tuple[List[bool], List[int]]:
        """One iteration of the requests ``rows`` [R]: (done, tokens committed) per request."""
        if self.one:
            return self._one_call(state, rows)
        st = self.stats
        t0 = time.perf_counter()
        drafts, q, spent = self._draft(state, rows)
        t0 += spent  # capture time is not draft time
        self._stage_done()
        t1 = time.perf_counter()
        block, post, logits, taps, spent = self._verify(state, rows, drafts)
        t1 += spent
        self._stage_done()
        t2 = time.perf_counter()
        kept, fin = self._commit(state, rows, block, post, logits, q, taps)
        flags = torch.stack([fin.long(), kept]).tolist()  # the iteration's one host read
        t3 = time.perf_counter()
        st.seconds["draft"] += t1 - t0
        st.seconds["verify"] += t2 - t1
        st.seconds["accept"] += t3 - t2
        st.decode_steps += self.b == 1
        self._count(flags)
        return [bool(f) for f in flags[0]], flags[1]

    def _count(self, flags: list) -> None:
        st = self.stats
        st.host_syncs += 1
        if self.b > 1:
            st.acceptance.extend(flags[1])
            st.drafted += (self.b - 1) * len(flags[1])
        st.blocks[self.b] = st.blocks.get(self.b, 0) + 1
        st.iterations += 1

    def _one_call(self, state: State, rows: torch.Tensor) -> Tuple[List[bool], List[int]]:
        """The iteration as one step (graphed: one replay) and one host read; its time counts
        as draft time (the stages are not apart)."""
        st, r = self.stats, rows.shape[0]
        t0 = time.perf_counter()
        flush_pending(self.drafter, state, self.b)  # rows a step of another kind left
        bucket = self.vstep.bucket(r)
        if state is not self._one_state:  # the graphs bake in a call's state tensors
            self._one_graphs, self._one_state, self._rows_key = {}, state, None
        self._load_rows(rows, bucket)
        spent = self._capture_committing(self._one_graphs, bucket, state,
                                         lambda: self._one_step(state, bucket))
        if self.graphs:
            self._one_graphs[bucket][0].replay()
        else:
            self._one_step(state, bucket)
        flags = self._acc[:, :r].tolist()  # the iteration's one host read
        st.seconds["draft"] += time.perf_counter() - t0 - spent
        self._count(flags)
        return [bool(f) for f in flags[0]], flags[1]

    def _one_step(self, state: State, bucket: int) -> None:
        """The iteration on ``self._rows[:bucket]`` (-1: padding, committed nowhere): the
        draft block from the state, the drafter's block forward (its context is current: the
        previous iteration added it), the verify block, the target's step, greedy_commit, the
        committed rows' taps to the drafter's context, the flags into ``self._acc``."""
        ds, vs, s, d = self.dstep, self.vstep, state, self.drafter
        rows = self._rows[:bucket]
        with dispatch.without_debug_checks():  # -1 rows on purpose (DFLASH_OPS_DEBUG=1)
            prepare_step_(rows, s.last, s.start, None, None, None, d.cfg.mask_token_id,
                          ds.scratch, ds.block_ids[:bucket], ds.requests[:bucket],
                          ds.start[:bucket])
        drafts, _ = d.propose(ds.block_ids[:bucket], ds.requests[:bucket], ds.start[:bucket],
                              logits=False)
        with dispatch.without_debug_checks():
            prepare_step_(rows, s.last, s.start, drafts.contiguous(), None, None, 0,
                          vs.scratch, vs.ids[:bucket], vs.requests[:bucket],
                          vs.start[:bucket])
        _, post, taps = vs._step(bucket)
        with dispatch.without_debug_checks():
            kept, fin, ctx_pos = greedy_commit(vs.ids[:bucket], post, rows, s.n_out, s.start,
                                               s.last, s.out_tokens, s.stop, s.max_new)
            # rows not committed (rejected drafts, padding): position -1, written nowhere
            d.add_context(taps, vs.requests[:bucket, None].expand(-1, self.b).reshape(-1),
                          ctx_pos.reshape(-1))
        self._acc[0, :bucket].copy_(fin)
        self._acc[1, :bucket].copy_(kept)

    def _stage_done(self) -> None:
        if self.sync_stages:
            sync_device(self.device)
            self.stats.host_syncs += 1

    def _capture(self, step, bucket: int) -> float:
        """With ``graphs``: capture step's graph for ``bucket`` on first use; the seconds spent."""
        if not self.graphs or step.captured(bucket):
            return 0.0
        t = time.perf_counter()
        step.capture(bucket)
        sync_device(self.device)
        self.stats.host_syncs += 1
        spent = time.perf_counter() - t
        self.stats.seconds["capture"] += spent
        return spent

    def _capture_committing(self, graphs: dict, bucket: int, state: State, fn) -> float:
        """With ``graphs`` on: ``graphs[bucket]`` captured from ``fn`` (a step that commits
        tokens: capture_committing) on first use; the seconds spent."""
        if not self.graphs or bucket in graphs:
            return 0.0
        t = time.perf_counter()
        graphs[bucket] = capture_committing(state, fn, self.device)
        spent = time.perf_counter() - t
        self.stats.seconds["capture"] += spent
        self.stats.host_syncs += 1
        return spent

    def _draft(self, state: State, rows: torch.Tensor) -> tuple:
        """(drafts [R, B-1], q [R, B-1, V] (sampling; DFlash 2: (q [R, B-1, k], its candidate
        ids), the selector's sparse q) or None, seconds spent capturing)."""
        r, spent = rows.shape[0], 0.0
        want_logits = self.sampling is not None
        # DFlash 2 sampling: the selector draws the drafts and gives q (not softmax(logits))
        select = self.sampling is not None and getattr(self.drafter, "selector", None) is not None
        if self.dstep is not None:  # the block and context rows: one prepare_step_ launch
            if state.pending[2].shape[1] != self.b:  # a verify of another block size
                flush_pending(self.drafter, state, self.b)
            bucket = self.dstep.load_next(rows, state.last, state.start, *state.pending)
            if select:  # the uniforms, drawn eagerly into the static buffer
                self.dstep.u[:bucket].uniform_(generator=self.sampling.generator)
            spent = self._capture(self.dstep, bucket)
            drafts, z = self.dstep.run(bucket)
            if select:  # (q [bucket, B-1, k], candidates): the selector's sparse q
                return drafts[:r], (z[0][:r], z[1][:r]), spent
            drafts, z = drafts[:r], (None if z is None else z[:r])
        else:
            block = torch.full((r, self.b), self.drafter.cfg.mask_token_id, dtype=torch.long,
                               device=self.device)
            block[:, 0] = state.last[rows]
            if select:
                u = torch.rand(r, self.b - 1, generator=self.sampling.generator,
                               device=self.device)
                drafts, q, cand = self.drafter.propose_sampled(block, rows, state.start[rows],
                                                               self.sampling.temperature, u)
                return drafts, (q, cand), spent
            drafts, z = self.drafter.propose(block, rows, state.start[rows], logits=want_logits)
        if self.sampling is None:
            return drafts, None, spent
        q = self.sampling.probs(z)  # [R, B-1, V]
        return self.sampling.draw(q), q, spent

    def _verify(self, state: State, rows: torch.Tensor, drafts: torch.Tensor) -> tuple:
        """(block [R, B] = [last, drafts], post [R, B] (greedy) or None, logits [R, B, V] fp32
        (sampling) or unused, taps [R * B, width], seconds spent capturing)."""
        r, spent = rows.shape[0], 0.0
        if self.vstep is not None:  # the block: one prepare_step_ launch
            bucket = self.vstep.load_next(rows, state.last, state.start, drafts)
            spent = self._capture(self.vstep, bucket)
            logits, post, taps = self.vstep.run(bucket)
            block, post, taps = self.vstep.ids[:r], post[:r], taps[:r * self.b]
            logits = None if logits is None else logits[:r]
        else:
            block = torch.cat([state.last[rows, None], drafts], 1)
            logits, taps = self.target.forward(
                block.reshape(-1), rows, state.start[rows],
                torch.full((r,), self.b, device=self.device), self.drafter.cfg.target_layer_ids,
                fp32_logits=self.sampling is not None)
            logits = logits.view(r, self.b, -1)
            post = argmax_last(logits) if self.sampling is None else None
        return block, post, logits, taps, spent

    def _commit(self, state: State, rows, block, post, logits, q, taps) -> tuple:
        """Accept, commit and update the state (one kernel on CUDA); the committed rows' taps
        to the drafter (or state.pending). (kept [R], done [R]) on the device."""
        s = state
        if self.sampling is not None:
            r, g = rows.shape[0], self.sampling.generator
            p = self.sampling.probs(logits)  # [R, B, V]
            u = torch.rand((r, self.b - 1), device=self.device, generator=g)
            u_res = torch.rand((r,), device=self.device, generator=g)
            q_idx = None
            if isinstance(q, tuple):  # DFlash 2: the selector's q on its k candidates (sparse)
                q, q_idx = q
            kept, fin, ctx_pos = sample_commit(block, p, q, u, u_res, rows, s.n_out, s.start,
                                               s.last, s.out_tokens, s.stop, s.max_new,
                                               q_idx=q_idx)
        else:
            kept, fin, ctx_pos = greedy_commit(block, post, rows, s.n_out, s.start, s.last,
                                               s.out_tokens, s.stop, s.max_new)
        if self.dstep is not None:  # added by the next draft step
            s.pending = (taps, rows, ctx_pos)
        else:
            self.drafter.add_context(taps, rows[:, None].expand(-1, self.b).reshape(-1),
                                     ctx_pos.reshape(-1))
        return kept, fin


def capture_committing(state: State, fn, device):
    """``dispatch.capture_graph(fn, device)`` for a step that commits tokens: the capture's
    warm-up runs one real step, so the per-request counters (n_out, start, last) go back to
    before it and the first replay commits those tokens again (the warm-up's cache writes and
    token columns are the ones the replay repeats); a failed capture (e.g. out of memory)
    leaves them as they were too."""
    keep = (state.n_out, state.start, state.last)
    saved = [x.clone() for x in keep]
    try:
        return dispatch.capture_graph(fn, device)
    finally:
        for x, v in zip(keep, saved):
            x.copy_(v)


def flush_pending(drafter, state: State, block: int) -> None:
    """Add ``state.pending`` (the last verify's committed rows, kept for a draft step) to the
    drafter's context now and leave it empty for a step of ``block`` rows a request: the policy
    switched block size or decodes (a draft step takes pending rows of its own block size)."""
    taps, rows, pos = state.pending
    if not taps.shape[0] and pos.shape[1] == block:
        return  # already empty for this block size (every decode iteration after the first)
    if taps.shape[0]:
        drafter.add_context(taps, rows[:, None].expand(-1, pos.shape[1]).reshape(-1),
                            pos.reshape(-1))
    long = dict(dtype=torch.long, device=taps.device)
    state.pending = (taps[:0], torch.zeros(0, **long), torch.zeros(0, block, **long))


DECODE_STEPS = 4  # decode steps of a greedy static-step decode iteration between host reads


class DecodeIteration(Iteration):
    """The policy's iteration without drafting: the target's decode step on each request's last
    token (``vstep``: a VerifyStep of block 1, graphed with ``graphs``; None: a direct call),
    its token committed by ``greedy_commit`` (sampling: drawn from the target's distribution
    first), the input row's tap hidden states added to the drafter's context (greedy with a
    ``context_drafter`` step: gathered by each step and added once the iteration's steps are
    done, the step's own add turned off: this iteration owns ``vstep``; else by the step or at
    once), after any pending rows: plain decoding that keeps the drafter ready to draft
    again."""

    def __init__(self, target, drafter, *, sampling: Optional[Sampling] = None, vstep=None,
                 graphs: bool = False, stats: Optional[Stats] = None, time_stages: bool = False,
                 steps_per_read: int = DECODE_STEPS):
        super().__init__(target, drafter, 1, sampling=sampling, steps=(None, vstep),
                         graphs=graphs, stats=stats, time_stages=time_stages)
        # greedy with static steps whose decode step has the context drafter: one step (one
        # graph per bucket) holds prepare_step_, the target's step, greedy_commit_ and the
        # flags, and it masks the requests that finished (``_live``), so ``steps`` of them run
        # back to back before the host reads the summed flags once: the GPU waits for the host
        # once per ``steps`` tokens. Measured on the H200 (2026-12-02, bench policy, Qwen3-8B,
        # B 1 / 8 x 1k): separate launches and a read a token ran 0.53 / 0.67 ms a token slower
        # than plain graphed decoding; one graph and one read a token, 0.20 / 0.21 ms. Static
        # steps without graphs run the same steps directly (CPU tests see the masking). Its
        # time is all "verify" stage time.
        self.fused = (sampling is None and vstep is not None
                      and vstep.context_drafter is not None)
        self.steps = max(1, int(steps_per_read)) if self.fused else 1  # tokens an iteration
        self._graphs: dict = {}  # bucket -> (graph, outputs) for self._state
        self._state: Optional[State] = None
        if self.fused:  # the active request slots, -1 past them (padding)
            self._rows = torch.full((vstep.max_batch,), -1, dtype=torch.long,
                                    device=self.device)
            # the steps' context rows wait in per-bucket buffers (``_ctx``: taps, request
            # slots, positions of each step's rows, the step's index ``_k`` on the device) and
            # go to the drafter once an iteration, after its steps: one read of the drafter's
            # fc and K/V weights (~250 MB at Qwen3-8B-DFlash-b16's shapes) for ``steps``
            # tokens instead of one a token. The drafter drafts only after the iteration.
            vstep.add_context_in_step = False
            self._ctx: dict = {}
            self._k = torch.zeros(1, dtype=torch.long, device=self.device)

    def __call__(self, state: State, rows: torch.Tensor,
                 max_steps: Optional[int] = None) -> Tuple[List[bool], List[int]]:
        """As Iteration's; ``max_steps``: at most that many decode steps (the most tokens an
        active request may still commit), at least one."""
        if not self.fused:
            return super().__call__(state, rows)
        st, r = self.stats, rows.shape[0]
        t0 = time.perf_counter()
        flush_pending(self.drafter, state, 1)
        if state is not self._state:  # the graphs bake in a call's state tensors
            long = dict(dtype=torch.long, device=self.device)
            self._graphs, self._state, self._rows_key = {}, state, None
            # rows still decoding this iteration: self._rows, a request's entry -1 once done
            self._live = torch.full((self.vstep.max_batch,), -1, **long)
            self._acc = torch.zeros(2, self.vstep.max_batch, **long)  # (done, kept) summed
        vs = self.vstep
        bucket = vs.bucket(r)
        self._load_rows(rows, bucket)
        if bucket not in self._ctx:  # eagerly, before any capture (the graphs keep them)
            long = dict(dtype=torch.long, device=self.device)
            width = self.drafter.cfg.n_taps * self.drafter.cfg.target_hidden_size
            self._ctx[bucket] = (
                torch.zeros(self.steps, bucket, width, dtype=self.drafter.dtype,
                            device=self.device),
                torch.zeros(self.steps, bucket, **long),
                torch.full((self.steps, bucket), -1, **long))
        # the capture's warm-up step runs on this call's rows (live and the sums it moves
        # are reset below)
        if self.graphs and bucket not in self._graphs:
            self._live.copy_(self._rows)
            self._k.zero_()
        spent = self._capture_committing(self._graphs, bucket, state,
                                         lambda: self._step(state, bucket))
        self._live.copy_(self._rows)  # every request in rows is active as the call begins
        self._acc.zero_()
        self._k.zero_()
        todo = self.steps if max_steps is None else max(1, min(self.steps, int(max_steps)))
        for _ in range(todo):
            if self.graphs:
                self._graphs[bucket][0].replay()
            else:
                self._step(state, bucket)
        taps, req, pos = self._ctx[bucket]  # the iteration's context rows, in one call
        self.drafter.add_context(taps[:todo].flatten(0, 1), req[:todo].flatten(),
                                 pos[:todo].flatten())
        got = self._acc[:, :r].tolist()  # the iteration's one host read
        st.host_syncs += 1
        st.seconds["verify"] += time.perf_counter() - t0 - spent
        st.blocks[1] = st.blocks.get(1, 0) + 1
        st.decode_steps += todo
        st.iterations += 1
        return [bool(f) for f in got[0]], got[1]

    def _step(self, state: State, bucket: int) -> None:
        """One decode step of ``bucket`` rows (``self._live``: ``self._rows``, -1 past the
        active ones and where a request finished in an earlier step of the iteration), which
        prepare_step_ pads (the scratch slot) and the commit skips; a row whose request
        finishes now becomes -1; the step's flags are added to ``self._acc``. Three small
        kernels besides the step's own (the row bookkeeping by request slot took ~14)."""
        vs, s = self.vstep, state
        live = self._live[:bucket]
        none = torch.zeros(bucket, 0, dtype=torch.long, device=self.device)
        with dispatch.without_debug_checks():  # -1 rows on purpose (DFLASH_OPS_DEBUG=1)
            prepare_step_(live, s.last, s.start, none, None, None, 0, vs.scratch,
                          vs.ids[:bucket], vs.requests[:bucket], vs.start[:bucket])
        _, post, taps = vs._step(bucket)
        # this step's context rows (the input token's taps at its request and position;
        # padded rows: the scratch slot at 0, as the step would have added them) into row k
        ctx_taps, ctx_req, ctx_pos = self._ctx[bucket]
        ctx_taps.index_copy_(0, self._k, taps.to(ctx_taps.dtype)[None])
        ctx_req.index_copy_(0, self._k, vs.requests[None, :bucket])
        ctx_pos.index_copy_(0, self._k, vs.start[None, :bucket])
        self._k.add_(1)
        with dispatch.without_debug_checks():
            kept, fin, _ = greedy_commit(vs.ids[:bucket], post, live, s.n_out, s.start,
                                         s.last, s.out_tokens, s.stop, s.max_new)
        live.masked_fill_(fin, -1)  # padded and skipped rows never finish: they stay -1
        self._acc[0, :bucket].bitwise_or_(fin)  # in place on the view: no copy back
        self._acc[1, :bucket].add_(kept)

    def _draft(self, state: State, rows: torch.Tensor) -> tuple:
        flush_pending(self.drafter, state, 1)
        return torch.zeros(rows.shape[0], 0, dtype=torch.long, device=self.device), None, 0.0

    def _commit(self, state: State, rows, block, post, logits, q, taps) -> tuple:
        s = state
        if self.sampling is not None:  # one token from p: the commit of a block without drafts
            post = self.sampling.draw(self.sampling.probs(logits))
        kept, fin, ctx_pos = greedy_commit(block, post, rows, s.n_out, s.start, s.last,
                                           s.out_tokens, s.stop, s.max_new)
        if self.vstep is None or self.vstep.context_drafter is None:  # else the step added it
            self.drafter.add_context(taps, rows, ctx_pos.reshape(-1))
        return kept, fin
