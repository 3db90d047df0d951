"""The DFlash draft-and-verify loop, ``speculative_generate``, and its reference ``plain_greedy``.

Per request: prefill the target on the prompt (logits of the last token -> the first new token;
tap hidden states of every prompt token -> the drafter's context K/V). Then, until every request
is done, one ``step.Iteration`` for all active requests at once (draft, verify, accept and
commit on the device; the host reads the done flags and committed counts once an iteration).

With ``temperature > 0`` (``top_p``, ``top_k`` as usual) drafts are sampled from the drafter and
accepted by speculative rejection sampling against the target, so the output has the target's
sampling distribution exactly (tests/test_speculator.py checks it with a chi-square test);
greedy output equals ``plain_greedy`` (target-only decoding, one token a step) token for token.

The policy (on by default, ``speculator.policy``) picks each iteration's block size among
``policy_blocks`` (default: 1 and the block size; 1 is a plain decode step that also adds the
committed token's tap hidden states to the drafter's context), for the most expected tokens a
second; every choice is lossless. ``policy=False`` always drafts a whole block.

Steps: ``"direct"`` calls the models; ``"static"`` runs the draft and verify as static-buffer
steps (``draft_step.DraftStep``, ``verify_step.VerifyStep``), the CPU test of ``"graphs"``,
which captures them as one CUDA graph per bucket on first use; ``"auto"`` (the default) is
``"graphs"`` on CUDA where both caches have the steps' scratch request slot (the first slot past
the batch), else ``"direct"``. A request that finishes frees its cache slots at once; its pending
context rows then map to slot -1 and are written nowhere.
"""
from __future__ import annotations

import contextlib
import numbers
import time
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .. import dispatch, triton
from ..models.linear import exact_runs
from .draft_step import DraftStep
from .policy import Policy, PolicyMemory
from .step import DecodeIteration, Iteration, Sampling, State, Stats, check_pair, sync_device
from .verify_step import VerifyStep


# The most prompt tokens one prefill forward takes: longer prompts and larger batches go through
# the target in pieces (a request's may span forwards), so a prefill's transient memory (the
# drafter's tap rows, n_taps x H a token: 40 KB at Qwen3-8B's; the MLP's activations) stays
# that of PREFILL_TOKENS tokens: 32 x 8k prompts in one forward took 10 GiB of taps alone.
PREFILL_TOKENS = 16384


def _prefill_pieces(lens: Sequence[int], max_tokens: int) -> List[List[Tuple[int, int, int]]]:
    """The prompts of lengths ``lens`` as forwards of at most ``max_tokens`` tokens: each a list
    of pieces (request, start, length), in request order, a request split where a forward fills
    up (its pieces in consecutive forwards, never two in one)."""
    if max_tokens < 1:  # (a split of 0 tokens a forward would never end)
        raise ValueError(f"speculator.loop.PREFILL_TOKENS: expected >= 1, got {max_tokens}")
    out, cur, n = [], [], 0
    for r, ln in enumerate(lens):
        s = 0
        while s < ln:
            q = min(ln - s, max_tokens - n)
            cur.append((r, s, q))
            n, s = n + q, s + q
            if n == max_tokens:
                out.append(cur)
                cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def _prefill(target, prompts, tap_layers, fp32_logits: bool = True, context=None):
    """The prompts (request slot r = index r) through the target in forwards of at most
    PREFILL_TOKENS tokens; returns the logits [N, V] of each prompt's last token. ``context``
    (the drafter's ``add_context``) takes each forward's taps of ``tap_layers`` with their
    request slots and positions as the forward ends."""
    dev = target.device
    last = [None] * len(prompts)
    for fwd in _prefill_pieces([len(p) for p in prompts], PREFILL_TOKENS):
        ids = torch.tensor([t for r, s, q in fwd for t in prompts[r][s:s + q]],
                           dtype=torch.long, device=dev)
        reqs = torch.tensor([r for r, _, _ in fwd], device=dev)
        starts = torch.tensor([s for _, s, _ in fwd], device=dev)
        q_lens = torch.tensor([q for _, _, q in fwd], device=dev)
        logits, taps = target.forward(ids, reqs, starts, q_lens, tap_layers,
                                      fp32_logits=fp32_logits,
                                      logit_rows=torch.cumsum(q_lens, 0) - 1)
        for i, (r, s, q) in enumerate(fwd):
            if s + q == len(prompts[r]):  # the prompt's last token: its first new one's logits
                last[r] = logits[i]
        if context is not None:
            context(taps, torch.repeat_interleave(reqs, q_lens),
                    torch.cat([torch.arange(s, s + q, device=dev) for _, s, q in fwd]))
    return torch.stack(last)


def _is_int(t) -> bool:
    """An integer token id: a Python / numpy integer or a 0-d integer tensor (not a bool)."""
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not (t.is_floating_point() or t.is_complex()
                                     or t.dtype == torch.bool)
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _stop_ids(fn: str, stop_token_ids) -> frozenset:
    """``stop_token_ids`` as a set of ints (a list, a tuple, a set or a tensor of ids), or a
    ValueError naming the entry that is not an integer id (None included)."""
    ids = (stop_token_ids.reshape(-1).tolist() if isinstance(stop_token_ids, torch.Tensor)
           else list(stop_token_ids))
    odd = [t for t in ids if not _is_int(t)]
    if odd:
        raise ValueError(f"{fn}: stop_token_ids: token ids must be integers, got {odd[0]!r}")
    return frozenset(int(t) for t in ids)


def _check_requests(fn: str, caches, prompts, max_new_tokens: int, vocab: int,
                    extra: int) -> None:
    """ValueError from ``fn``, naming the argument, unless max_new_tokens >= 1 and the prompts
    (at least one; each a non-empty list of token ids in [0, vocab)) fit every (name, cache)
    of ``caches``: request slots 0 .. n-1 free, room for len(prompt) + ``extra`` positions each
    (the loop's capacity per request), and blocks for all of them. Run before anything is
    allocated, so that the cache's add_request cannot fail half-way through the batch."""
    if max_new_tokens < 1:
        raise ValueError(f"{fn}: max_new_tokens must be >= 1, got {max_new_tokens}")
    n = len(prompts)
    if n == 0:
        raise ValueError(f"{fn}: prompts: expected at least one prompt, got 0")
    for name, c in caches:
        slots = c.block_table.shape[0]
        if n > slots:
            raise ValueError(f"{fn}: prompts: {n} prompts, but the {name} cache has {slots} "
                             f"request slots (max_requests)")
        busy = [r for r in c.in_use() if r < n]
        if busy:
            raise ValueError(f"{fn}: request slots {busy} of the {name} cache are in use; "
                             f"{n} prompts need slots 0..{n - 1}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"{fn}: prompts[{i}] is empty; expected at least one token")
        if isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex()):
            raise ValueError(f"{fn}: prompts[{i}]: token ids must be integers, got a "
                             f"{str(p.dtype).replace('torch.', '')} tensor")
        if not isinstance(p, torch.Tensor):
            odd = [t for t in p if not _is_int(t)]
            if odd:
                raise ValueError(f"{fn}: prompts[{i}]: token ids must be integers, got "
                                 f"{odd[0]!r}")
        bad = next((int(t) for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{fn}: prompts[{i}] has token {bad} outside the vocabulary "
                             f"[0, {vocab})")
    for name, c in caches:
        room = c.max_blocks * c.block_size
        for i, p in enumerate(prompts):
            if len(p) + extra > room:
                raise ValueError(f"{fn}: prompts[{i}]: {len(p)} tokens + max_new_tokens="
                                 f"{max_new_tokens} need {len(p) + extra} positions in the "
                                 f"{name} cache, which allows {room} (max_len)")
        need = c.blocks_needed([len(p) + extra for p in prompts])
        if need > c.free_blocks():
            raise ValueError(f"{fn}: prompts: they need {need} blocks of the {name} cache, "
                             f"{c.free_blocks()} are free (num_blocks)")


@contextlib.contextmanager
def exact_mode(target, exact: Optional[bool] = True):
    """Inside the block ``target.exact`` is ``exact`` (None: left as it is) and, when exact on
    CUDA, every op's eager calls run its graph backend (``dispatch.graph_backends``): a
    verify block's rows and a decode step's row then run the same kernels with results
    independent of the rows sharing the call, so greedy speculative output equals plain greedy
    decoding bit for bit in bf16 / fp16 too (exact mode, issue 19). On CUDA it needs a bf16 /
    fp16 target and triton (ValueError otherwise: cuBLAS would pick its GEMM by row count); on
    the CPU it changes nothing that matters (torch paths; not guaranteed bit-identical)."""
    old = getattr(target, "exact", False)
    on = bool(old if exact is None else exact) and target.device.type == "cuda"
    if on and not exact_runs(target.dtype, target.device):
        raise ValueError(f"exact mode on CUDA needs a bf16 / fp16 target and triton (its "
                         f"GEMMs), got {str(target.dtype).replace('torch.', '')}"
                         f"{'' if triton.AVAILABLE else ', triton missing'}")
    if exact is not None:
        target.exact = bool(exact)
    try:
        with dispatch.graph_backends() if on else contextlib.nullcontext():
            yield
    finally:
        if exact is not None:
            target.exact = old


def plain_greedy(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_token_ids: Sequence[int] = (), exact: Optional[bool] = None
                 ) -> List[List[int]]:
    """Target-only greedy decoding of every prompt (the speculative output's reference):
    max_new_tokens (>= 1) tokens a prompt, fewer where a stop token ends it. ``exact``: run in
    exact mode (``exact_mode``; None: as ``target.exact`` says). Bad arguments (no or empty
    prompts, tokens outside the vocabulary, more prompts or longer ones than the cache holds,
    max_new_tokens < 1) raise a ValueError before anything is allocated."""
    with exact_mode(target, exact):
        return _plain_greedy(target, prompts, max_new_tokens, stop_token_ids)


def _plain_greedy(target, prompts, max_new_tokens, stop_token_ids):
    dev = target.device
    stop = _stop_ids("plain_greedy", stop_token_ids)
    _check_requests("plain_greedy", [("target", target.cache)], prompts, max_new_tokens,
                    target.cfg.vocab_size, max_new_tokens + 1)
    owned = []
    try:
        for r, p in enumerate(prompts):
            target.add_request(r, len(p) + max_new_tokens + 1)
            owned.append(r)
        first_logits = _prefill(target, prompts, None)
        out = [[t] for t in first_logits.argmax(-1).tolist()]
        done = [o[0] in stop or max_new_tokens <= 1 for o in out]
        lens = [len(p) for p in prompts]
        while not all(done):
            act = [r for r in range(len(prompts)) if not done[r]]
            ids = torch.tensor([out[r][-1] for r in act], device=dev)
            logits, _ = target.forward(ids, torch.tensor(act, device=dev),
                                       torch.tensor([lens[r] + len(out[r]) - 1 for r in act],
                                                    device=dev),
                                       torch.ones(len(act), dtype=torch.long, device=dev), None)
            for i, r in enumerate(act):
                t = int(logits[i].argmax())
                out[r].append(t)
                done[r] = t in stop or len(out[r]) >= max_new_tokens
        return out
    finally:
        for r in owned:
            target.free_request(r)


def _graphs_available(device) -> bool:
    """Whether steps="auto" may capture CUDA graphs on this device (tests patch it)."""
    return torch.device(device).type == "cuda"


def _resolve_steps(steps: str, target, drafter, n: int) -> str:
    if steps == "auto":  # graphs on CUDA where both caches have the steps' spare slot
        spare = all(c.block_table.shape[0] > n for c in (target.cache, drafter.cache))
        return "graphs" if _graphs_available(target.device) and spare else "direct"
    if steps not in ("direct", "static", "graphs"):
        raise ValueError(f"speculative_generate: steps must be 'auto', 'direct', 'static' or "
                         f"'graphs', got {steps!r}")
    if steps == "graphs" and not _graphs_available(target.device):
        raise ValueError(f"speculative_generate: steps='graphs' needs a CUDA device, the "
                         f"target is on {target.device}")
    return steps


class _Steps:
    """The static steps of every block size the loop may run, for n requests: for b >= 2 a
    (DraftStep, VerifyStep) pair, for b = 1 (decoding) (None, VerifyStep of one row that also
    adds the input token's taps to the drafter's context, in its graph). They
    share one scratch request slot, n (the first past the batch), held here with room for the
    largest block in both caches; ``close()`` closes the steps and gives the slot back. Nothing
    stays taken if a step cannot be built."""

    def __init__(self, target, drafter, n: int, blocks: Sequence[int], logits: bool,
                 select_temperature: float = 0.0):
        self.target, self.drafter, self.n = target, drafter, n
        self.pairs, self._held = {}, []
        try:
            big = max(blocks)
            target.add_request(n, big)
            self._held.append(target)
            # the drafter's too, even for decoding only: the decode iteration writes its padded
            # rows' context at position 0 of this slot
            drafter.cache.add_request(n, big)
            self._held.append(drafter.cache)
            for b in sorted(blocks, reverse=True):
                dstep = None if b == 1 else DraftStep(
                    drafter, max_batch=n, scratch_request=n, block_size=b, logits=logits,
                    select_temperature=select_temperature, own_scratch=False)
                self.pairs[b] = (dstep, VerifyStep(
                    target, max_batch=n, block_size=b, scratch_request=n, own_scratch=False,
                    tap_layers=drafter.cfg.target_layer_ids, logits=logits,
                    context_drafter=drafter if b == 1 else None))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for pair in self.pairs.values():
            for s in pair:
                if s is not None:
                    s.close()
        self.pairs = {}
        for c in self._held:
            c.free_request(self.n)
        self._held = []


# drafter -> {(id(target), steps, sampling, blocks, exact): PolicyMemory}: the policy's measured
# step costs and the pair's acceptance, kept for the next call on the same pair (a warm-up call
# measures them; exact mode's steps cost other times)
_POLICY_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def policy_memory(drafter) -> dict:
    """The policy's memories for ``drafter`` ({key: PolicyMemory}; empty before a call)."""
    return _POLICY_COSTS.get(drafter, {})


def _policy_blocks(fn: str, policy: bool, policy_blocks, bsz: int) -> list:
    """The block sizes the loop may run: [bsz] with the policy off, else policy_blocks (default
    1 and bsz), each in [1, bsz]."""
    if not policy:
        return [bsz]
    if policy_blocks is None:
        return [1, bsz]
    blocks = sorted(set(int(b) for b in policy_blocks))
    if not blocks or blocks[0] < 1 or blocks[-1] > bsz:
        raise ValueError(f"{fn}: policy_blocks must be block sizes in [1, {bsz}] (1: decode "
                         f"without drafting; at most block_size), got {list(policy_blocks)}")
    return blocks


def speculative_generate(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         stop_token_ids: Sequence[int] = (), block_size: Optional[int] = None,
                         on_iteration: Optional[Callable[[int], None]] = None,
                         temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         generator: Optional[torch.Generator] = None, time_stages: bool = False,
                         steps: str = "auto", policy: bool = True,
                         policy_blocks: Optional[Sequence[int]] = None,
                         exact: Optional[bool] = None):
    """(new tokens per prompt, Stats): DFlash decoding. Greedy (temperature 0) equals
    ``plain_greedy``; with temperature > 0 the output follows the target's sampling
    distribution (speculative rejection sampling). ``generator``: a torch.Generator on the
    target's device for the random draws. ``time_stages``: run the stages apart and
    synchronise after each to time it (Stats.seconds: draft, verify, accept); off (the
    default), the loop's only device-to-host read is the done flags and committed counts once
    an iteration (and the active index list is uploaded only when a request finishes), and a
    greedy drafting iteration on static steps runs as one step (with graphs: one graph), its
    time counted as draft time. ``steps``: "direct", "static" or "graphs" (module docstring); "auto" is
    "graphs" on CUDA when both caches have a spare request slot (max_requests > batch) with
    room for one block, else "direct" (Stats.steps says which ran). The prefill runs the
    prompts through the target in forwards of at most ``PREFILL_TOKENS`` (16,384) tokens, a long
    prompt over several, each forward's taps added to the drafter's context as it ends.

    ``policy`` (on by default): each iteration runs the block size, among ``policy_blocks``
    (default: 1, i.e. a plain decode step that keeps the drafter's context current, and
    ``block_size``), with the most expected tokens a second for the active requests, from their
    running acceptance and the iterations' measured cost (``policy.Policy``); every choice is
    lossless, so greedy output is the same; ``Stats.blocks`` counts the iterations per block
    size. ``policy=False``: always ``block_size`` (as the reference DFlash loop). Sampled output
    follows the same distribution either way, but which tokens a seeded ``generator`` gives
    depends on the block sizes run (each draws its own number of uniforms, and a draft depends
    on its place in the block), and the policy chooses them from measured timings: for
    sampled output that a seed reproduces, pass ``policy=False``.

    ``exact=True``: exact mode (``exact_mode``): greedy output equal to ``plain_greedy(...,
    exact=True)`` bit for bit in bf16 / fp16 as well (without it the two round differently
    near ties: a 16-row verify and a 1-row decode run other kernels); None: as
    ``target.exact`` says.

    ``max_new_tokens`` (>= 1): the tokens a prompt gets, fewer where a stop token ends it;
    ``block_size``: None for the drafter config's, else >= 2. Bad arguments (those, no or empty
    prompts, tokens outside the vocabulary, more prompts or longer ones than the caches hold, a
    drafter that does not fit the target) raise a ValueError before anything is allocated."""
    with exact_mode(target, exact):
        return _speculative_generate(
            target, drafter, prompts, max_new_tokens, stop_token_ids, block_size, on_iteration,
            temperature, top_p, top_k, generator, time_stages, steps, policy, policy_blocks)


def _speculative_generate(target, drafter, prompts, max_new_tokens, stop_token_ids, block_size,
                          on_iteration, temperature, top_p, top_k, generator, time_stages, steps,
                          policy, policy_blocks):
    fn = "speculative_generate"
    check_pair(target, drafter, fn)
    sampling = Sampling(temperature, top_p, top_k, generator) if temperature > 0 else None
    if sampling is not None and getattr(drafter, "d2t", None) is not None:
        raise NotImplementedError("speculative sampling with a reduced draft vocabulary "
                                  "(d2t) is not implemented")
    dev, cfg, n = target.device, drafter.cfg, len(prompts)
    bsz = cfg.block_size if block_size is None else block_size
    if bsz < 2:
        raise ValueError(f"{fn}: block_size must be >= 2 (or None), got {bsz}")
    blocks = _policy_blocks(fn, policy, policy_blocks, bsz)
    _check_requests(fn, [("target", target.cache), ("drafter", drafter.cache)], prompts,
                    max_new_tokens, target.cfg.vocab_size, max_new_tokens + bsz + 1)
    auto = steps == "auto"
    steps = _resolve_steps(steps, target, drafter, n)
    stats = Stats(steps=steps)
    stop = _stop_ids(fn, stop_token_ids)
    owned, pair = set(), None

    def release(r):  # a request's slots in both caches, once
        if r in owned:
            owned.discard(r)
            target.free_request(r)
            drafter.cache.free_request(r)

    try:
        for r, p in enumerate(prompts):
            cap = len(p) + max_new_tokens + bsz + 1
            target.add_request(r, cap)
            drafter.cache.add_request(r, cap)
            owned.add(r)
        if steps != "direct":
            try:
                sel_t = (sampling.temperature if sampling is not None
                         and getattr(drafter, "selector", None) is not None else 0.0)
                pair = _Steps(target, drafter, n, blocks, logits=sampling is not None,
                              select_temperature=sel_t)
            except (ValueError, RuntimeError) as e:
                if not auto:
                    raise ValueError(f"speculative_generate(steps={steps!r}): the steps need "
                                     f"a spare request slot ({n}, past the batch of {n}) with "
                                     f"{max(blocks)} positions in both caches (max_requests >= "
                                     f"{n + 1}); or use steps='direct'. Cause: {e}") from e
                steps = stats.steps = "direct"  # auto: no room for the scratch slot
        t0 = time.perf_counter()
        logits = _prefill(target, prompts, cfg.target_layer_ids, context=drafter.add_context)
        first = logits.argmax(-1) if sampling is None else sampling.draw(sampling.probs(logits))
        sync_device(dev)
        stats.seconds["prefill"] += time.perf_counter() - t0
        state = State.after_prefill(first, [len(p) for p in prompts], stop, max_new_tokens, bsz,
                                    cfg.n_taps * cfg.target_hidden_size, target.dtype)
        done = [t in stop or max_new_tokens <= 1 for t in first.tolist()]
        stats.host_syncs += 1
        for r in range(n):
            if done[r]:
                release(r)
        kw = dict(sampling=sampling, graphs=steps == "graphs", stats=stats,
                  time_stages=time_stages)
        its = {b: DecodeIteration(target, drafter, vstep=pair.pairs[1][1] if pair else None,
                                  **kw) if b == 1 else
               Iteration(target, drafter, b, steps=pair.pairs[b] if pair else None, **kw)
               for b in blocks}
        pol = None
        if len(blocks) > 1:  # step costs remembered per drafter across calls
            mem = _POLICY_COSTS.setdefault(drafter, {}).setdefault(
                (id(target), steps, sampling is not None, tuple(blocks),
                 bool(getattr(target, "exact", False))), PolicyMemory())
            pol = Policy(blocks, n, memory=mem,
                         decode_tokens=its[1].steps if 1 in its else 1)
        lengths = [len(p) + 1 for p in prompts]  # each request's positions, on the host
        committed, act, b = n, None, blocks[-1]
        while not all(done):
            now = [r for r in range(n) if not done[r]]
            if now != act:
                act, rows = now, torch.tensor(now, device=dev)
                bucket = min(n, 1 << (len(act) - 1).bit_length())
            if pol is not None:
                longest = max(lengths[r] for r in act)
                b = pol.choose(act, bucket, longest,
                               [max_new_tokens - (lengths[r] - len(prompts[r])) for r in act])
                t, cap = time.perf_counter(), stats.seconds["capture"]
            full = True
            if b == 1:  # no more decode steps than the most tokens a request has left
                left = max(max_new_tokens - (lengths[r] - len(prompts[r])) for r in act)
                full = left >= its[1].steps
                fin, kept = its[1](state, rows, max_steps=left)
            else:
                fin, kept = its[b](state, rows)
            if pol is not None and full:  # a cut decode iteration's time is not its cost
                spent = time.perf_counter() - t - (stats.seconds["capture"] - cap)
                pol.observe(b, bucket, longest, spent, act, kept, fin)
            for r, f, k in zip(act, fin, kept):
                lengths[r] += k
                if f:
                    done[r] = True
                    release(r)
            committed += sum(kept)
            if on_iteration is not None:
                on_iteration(committed)
        counts = state.n_out.tolist()
        out = [state.out_tokens[r, :counts[r]].tolist() for r in range(n)]
        stats.committed = sum(len(o) for o in out)
        return out, stats
    finally:
        for r in list(owned):
            release(r)
        if pair is not None:
            pair.close()
