"""The DFlash draft-and-verify loop: direct calls, or static-buffer steps replayed as CUDA graphs.

Per request: prefill the target on the prompt (logits of the last token -> the first new token;
tap hidden states of every prompt token -> the drafter's context K/V). Then per iteration, for
every active request at once:

1. draft: the block ``[last committed token, MASK x (B-1)]`` at positions ``start ..
   start + B - 1`` (``start`` = the committed length before ``last``) -> B-1 draft tokens;
2. verify: the target runs the block (causal, its own paged KV) -> posterior = argmax per row;
3. accept the longest prefix where ``draft[j] == posterior[j-1]``, plus the target's token at the
   first mismatch (the bonus): ``accepted + 1`` tokens committed, cut at the request's stop
   token or max_new_tokens;
   (``accept.commit_block``, on the device: the host reads only the done flags and committed
   counts, once an iteration);
4. the committed block tokens' tap hidden states (rows ``0 .. accepted`` of the verify) become
   context K/V of the drafter; KV of rejected positions stays in both caches but is never
   visible (attention is bounded by each request's length) and is overwritten next iteration.

With ``temperature > 0`` (``top_p``, ``top_k`` as usual) drafts are sampled from the drafter's
distribution q and accepted by speculative rejection sampling against the target's p: draft j is
kept with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection the token is drawn
from normalise(max(p - q, 0)); after B-1 acceptances the bonus is drawn from p
(``accept.sample_commit``: uniforms from ``generator``, an inverse-CDF draw; one Triton kernel
with the commit on CUDA). The output then has the target's distribution exactly
(tests/test_speculator.py checks it with a chi-square test).

Steps (``steps="graphs"``, the default on CUDA (``"auto"``) where the caches have the spare slot
below; ``"static"`` runs the same path without capture, the CPU test of it; ``"direct"`` the plain
calls): the draft step (``models.draft_step``) takes the previous iteration's committed rows
as its context precompute and runs the block forward + LM head + argmax; the verify step
(``models.verify_step``) runs the target on the block. Both work on static buffers padded to a
bucket (the next power of two of the active requests, at most the batch), filled from the
device state (``last``, ``start``, the drafts, the committed context rows) by one
``prepare.prepare_step_`` launch each (``load_next``), captured as one CUDA graph per bucket on first use (Stats.seconds["capture"]); the
padded rows run as a scratch request slot (the first slot past the batch: both caches need one
spare slot). A request that finishes frees its cache slots at once; its pending context rows
then map to slot -1 and are written nowhere.

``plain_greedy`` decodes with the target alone (one token per step), the reference the
speculative output must equal token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from .accept import greedy_commit, sample_commit


@dataclass
class Stats:
    iterations: int = 0
    committed: int = 0
    host_syncs: int = 0  # device-to-host reads, and synchronisations on CUDA
    steps: str = "direct"
    acceptance: List[int] = field(default_factory=list)  # tokens committed per request-iteration
    seconds: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0,
                                                   "verify": 0.0, "accept": 0.0,
                                                   "capture": 0.0})

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance) / max(1, len(self.acceptance))


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                      top_k: int = 0) -> torch.Tensor:
    """Sampling distribution over the last dim: softmax(logits / temperature), cut to the top_k
    tokens (0: all) and to the smallest set whose mass reaches top_p, renormalised."""
    if temperature <= 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sampling needs temperature > 0, top_p in (0, 1], top_k >= 0; got "
                         f"{temperature}, {top_p}, {top_k}")
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


def _sample(p: torch.Tensor, gen) -> torch.Tensor:
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=gen).view(p.shape[:-1])


def _prefill(target, prompts, tap_layers):
    dev = target.device
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
    reqs = torch.arange(len(prompts), device=dev)
    q_lens = torch.tensor([len(p) for p in prompts], device=dev)
    logits, taps = target.forward(ids, reqs, torch.zeros_like(q_lens), q_lens, tap_layers)
    last = torch.cumsum(q_lens, 0) - 1
    return logits[last], taps


def plain_greedy(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_token_ids: Sequence[int] = ()) -> List[List[int]]:
    """Target-only greedy decoding of every prompt (the speculative output's reference)."""
    dev = target.device
    stop = set(stop_token_ids)
    for r, p in enumerate(prompts):
        target.add_request(r, len(p) + max_new_tokens + 1)
    try:
        first_logits, _ = _prefill(target, prompts, None)
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
        for r in range(len(prompts)):
            target.free_request(r)


def _graphs_available(device) -> bool:
    """Whether steps="auto" may capture CUDA graphs on this device (tests patch it)."""
    return torch.device(device).type == "cuda"


def speculative_generate(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       stop_token_ids: Sequence[int] = (), block_size: Optional[int] = None,
                       on_iteration: Optional[Callable[[int], None]] = None,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       generator: Optional[torch.Generator] = None, time_stages: bool = True,
                       steps: str = "auto"):
    """(new tokens per prompt, Stats): DFlash decoding. Greedy (temperature 0) equals
    ``plain_greedy``; with temperature > 0 the output follows the target's sampling
    distribution (speculative rejection sampling). ``generator``: a torch.Generator on the
    target's device for the random draws. ``time_stages``: synchronise after each stage to
    time it (Stats.seconds); off, the loop's only device-to-host read is the done flags and
    committed counts once an iteration (and the active index list is uploaded only when a
    request finishes). ``steps``: "direct", "static" or "graphs" (module docstring); "auto" is
    "graphs" on CUDA when both caches have a spare request slot (max_requests > batch) with
    room for one block, else "direct" (Stats.steps says which ran)."""
    sampling = temperature > 0
    if sampling:
        probs_from_logits(torch.zeros(1), temperature, top_p, top_k)  # validates the arguments
        if getattr(drafter, "d2t", None) is not None:
            raise NotImplementedError("speculative sampling with a reduced draft vocabulary "
                                      "(d2t) is not implemented")
    dev = target.device
    cfg = drafter.cfg
    bsz = block_size or cfg.block_size
    if bsz < 2:
        raise ValueError(f"speculative_generate: block_size must be >= 2, got {bsz}")
    auto = steps == "auto"
    if auto:  # graphs on CUDA where both caches have the steps' spare slot; else direct calls
        n_req = len(prompts)
        spare = all(c.block_table.shape[0] > n_req for c in (target.cache, drafter.cache))
        steps = "graphs" if _graphs_available(dev) and spare else "direct"
    if steps not in ("direct", "static", "graphs"):
        raise ValueError(f"speculative_generate: steps must be 'auto', 'direct', 'static' or "
                         f"'graphs', got {steps!r}")
    if steps == "graphs" and not _graphs_available(dev):
        raise ValueError(f"speculative_generate: steps='graphs' needs a CUDA device, the "
                         f"target is on {dev}")
    stop = set(stop_token_ids)
    stats = Stats(steps=steps)
    n = len(prompts)
    owned = set()
    for r, p in enumerate(prompts):
        cap = len(p) + max_new_tokens + bsz + 1
        target.add_request(r, cap)
        drafter.cache.add_request(r, cap)
        owned.add(r)

    def release(r):
        if r in owned:
            owned.discard(r)
            target.free_request(r)
            drafter.cache.free_request(r)

    dstep = vstep = None
    try:
        if steps != "direct":
            from ..models.draft_step import DraftStep
            from ..models.verify_step import VerifyStep
            try:
                dstep = DraftStep(drafter, max_batch=n, scratch_request=n, block_size=bsz,
                                  logits=sampling)
                vstep = VerifyStep(target, max_batch=n, block_size=bsz,
                                   tap_layers=cfg.target_layer_ids, scratch_request=n,
                                   logits=sampling)
            except (ValueError, RuntimeError) as e:
                if auto:  # no room for the scratch slot (e.g. no free blocks): direct calls
                    if dstep is not None:
                        drafter.cache.free_request(n)
                    dstep = vstep = None
                    steps = stats.steps = "direct"
                else:
                    raise ValueError(f"speculative_generate(steps={steps!r}): the steps need "
                                     f"a spare request slot ({n}, past the batch of {n}) with "
                                     f"{bsz} positions in both caches (max_requests >= "
                                     f"{n + 1}); or use steps='direct'. Cause: {e}") from e
        t0 = time.perf_counter()
        first_logits, taps = _prefill(target, prompts, cfg.target_layer_ids)
        first = (_sample(probs_from_logits(first_logits, temperature, top_p, top_k), generator)
                 if sampling else first_logits.argmax(-1))
        reqs = torch.cat([torch.full((len(p),), r, device=dev) for r, p in enumerate(prompts)])
        pos = torch.cat([torch.arange(len(p), device=dev) for p in prompts])
        drafter.add_context(taps, reqs, pos)
        _sync(dev)
        stats.seconds["prefill"] += time.perf_counter() - t0
        # steps: the committed rows of the last verify, added to the drafter's context by the
        # next draft step (hidden rows [Rc * B], their request slots [Rc], positions [Rc, B];
        # -1 = not committed)
        width_taps = cfg.n_taps * cfg.target_hidden_size
        pending = (taps.new_zeros(0, width_taps), reqs[:0], pos.new_zeros(0, bsz))
        # device state: the token buffer and per-request counters; the host reads only the
        # done flags and committed counts, once an iteration
        width = max_new_tokens + bsz + 1
        out_tokens = torch.zeros(n, width, dtype=torch.long, device=dev)
        out_tokens[:, 0] = first
        n_out = torch.ones(n, dtype=torch.long, device=dev)
        last = first.clone()
        start_t = torch.tensor([len(p) for p in prompts], device=dev)  # position of `last`
        stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=dev)
        done = [t in stop or max_new_tokens <= 1 for t in first.tolist()]
        stats.host_syncs += 1
        for r in range(n):
            if done[r]:
                release(r)
        committed = n
        on_cuda = torch.device(dev).type == "cuda"

        def sync():
            if time_stages and on_cuda:
                _sync(dev)
                stats.host_syncs += 1

        def capture(step, bucket) -> float:
            """Capture the step's graph for bucket on first use; returns the seconds spent."""
            if steps != "graphs" or bucket in step._graphs:
                return 0.0
            tc = time.perf_counter()
            step.capture(bucket)
            _sync(dev)
            stats.host_syncs += 1
            spent = time.perf_counter() - tc
            stats.seconds["capture"] += spent
            return spent
        act, ra = None, None
        while not all(done):
            now = [r for r in range(n) if not done[r]]
            if now != act:
                act, ra = now, torch.tensor(now, device=dev)
            t0 = time.perf_counter()
            r_n = len(act)
            if dstep is not None:  # the block and context rows: one prepare_step_ launch
                bucket = dstep.load_next(ra, last, start_t, *pending)
                t0 += capture(dstep, bucket)  # capture time is not draft time
                drafts, dlogits = dstep.run(bucket)
                drafts = drafts[:r_n]
                dlogits = dlogits[:r_n] if sampling else None
            else:
                st = start_t[ra]
                block = torch.full((r_n, bsz), cfg.mask_token_id, dtype=torch.long, device=dev)
                block[:, 0] = last[ra]
                drafts, dlogits = drafter.propose(block, ra, st, logits=sampling)
            if sampling:
                q = probs_from_logits(dlogits, temperature, top_p, top_k)  # [R, B-1, V]
                drafts = _sample(q, generator)
            sync()
            t1 = time.perf_counter()
            if vstep is not None:
                bucket = vstep.load_next(ra, last, start_t, drafts)
                t1 += capture(vstep, bucket)
                logits, vpost, taps = vstep.run(bucket)
                block = vstep.ids[:r_n]  # [last, drafts] of each request
                vpost, taps = vpost[:r_n], taps[:r_n * bsz]
                logits = logits[:r_n] if sampling else None
            else:
                block[:, 1:] = drafts
                logits, taps = target.forward(block.reshape(-1), ra, st,
                                              torch.full((len(act),), bsz, device=dev),
                                              cfg.target_layer_ids, fp32_logits=sampling)
                logits = logits.view(len(act), bsz, -1)
                vpost = None
            sync()
            t2 = time.perf_counter()
            if sampling:  # rejection sampling, commit and state update: one kernel on CUDA
                p = probs_from_logits(logits, temperature, top_p, top_k)  # [R, B, V]
                u = torch.rand((len(act), bsz - 1), device=dev, generator=generator)
                u_res = torch.rand((len(act),), device=dev, generator=generator)
                kept, fin, ctx_pos = sample_commit(block, p, q, u, u_res, ra, n_out, start_t,
                                                   last, out_tokens, stop_t, max_new_tokens)
            else:  # match, commit, n_out / start / last and ctx_pos: one kernel on CUDA
                post = logits.argmax(-1) if vpost is None else vpost
                kept, fin, ctx_pos = greedy_commit(block, post, ra, n_out, start_t, last,
                                                   out_tokens, stop_t, max_new_tokens)
            if dstep is not None:  # added by the next draft step
                pending = (taps, ra, ctx_pos)
            else:
                drafter.add_context(taps, ra[:, None].expand(-1, bsz).reshape(-1),
                                    ctx_pos.reshape(-1))
            flags = torch.stack([fin.long(), kept]).tolist()  # the iteration's one sync
            stats.host_syncs += 1
            t3 = time.perf_counter()
            for i, r in enumerate(act):
                done[r] = bool(flags[0][i])
                if done[r]:
                    release(r)
            stats.acceptance.extend(flags[1])
            committed += sum(flags[1])
            stats.seconds["draft"] += t1 - t0
            stats.seconds["verify"] += t2 - t1
            stats.seconds["accept"] += t3 - t2
            stats.iterations += 1
            if on_iteration is not None:
                on_iteration(committed)
        counts = n_out.tolist()
        out = [out_tokens[r, :counts[r]].tolist() for r in range(n)]
        stats.committed = sum(len(o) for o in out)
        return out, stats
    finally:
        for r in list(owned):
            release(r)
        if dstep is not None:  # each step took its scratch slot as its constructor's last act
            drafter.cache.free_request(n)
        if vstep is not None:
            target.free_request(n)
