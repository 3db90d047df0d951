"""Speculation that pays: the loop's choice, each iteration, of a block size or of no drafting.

Every choice is lossless (a draft-and-verify iteration of any block size, or a plain decode
step, commits tokens the target would have produced), so the policy only decides speed. For
the active requests it picks the option with the most expected tokens a second:

    rate(b) = sum over requests of E_r(b) / cost(b, bucket, context)

- ``E_r(b)``, the tokens request r commits with block b: 1 + a + ... + a^(b-1) = (1 - a^b) /
  (1 - a) under a geometric model of acceptance, a = the request's running rate at which a
  draft is accepted given the previous one was (accepted drafts over drafts judged: a
  rejection is judged, drafts after it are not), decayed so that it follows the text; a new
  request's prior is worth two judged drafts at the pair's acceptance over earlier requests
  (one accepted and one rejected draft before any). b = 1 is plain decoding: one token, or
  ``decode_tokens`` (the loop's graphed greedy decode iteration runs several steps).
- ``cost``: the seconds of one iteration of that option for this batch bucket (the steps'
  padded batch) and context bucket (the next power of two of the longest active request), the
  wall time the loop measures around the iteration (which ends in the loop's one host read),
  capture excluded. The first run of an option in a batch bucket is a warm-up (autotuning,
  the graph's first replay) and is not used. An option never run at a context bucket takes
  its estimate from the nearest measured context bucket of the same batch bucket; an option
  never run in a batch bucket is explored (run once to warm up, once to measure).
- Costs, the pair's acceptance and the probe interval outlive a call (``PolicyMemory``, kept
  by the loop per drafter, target, steps mode, sampling and options): a warm-up call measures,
  later calls start from its table.
- While it decodes, the acceptance rates cannot move: every ``probe`` consecutive decode
  iterations (of ``decode_tokens`` tokens each) it drafts once with the largest block to
  look again; the interval doubles (up to 256) each time the probe leaves decoding the better
  choice, so a pair that never pays costs a vanishing share of probes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

PRIOR = (1.0, 2.0)  # (accepted, judged) drafts before any evidence: a = 0.5
DECAY = 0.95        # weight of the past per observation of a request
PAIR_DECAY = 0.99   # the same for the pair's acceptance over all requests (new ones' prior)
PROBE_FIRST, PROBE_MAX = 8, 256


def expected_tokens(a: float, b: int) -> float:
    """1 + a + ... + a^(b-1): the tokens a block of b commits (b - 1 drafts + the target's)."""
    if b <= 1:
        return 1.0
    if a >= 1.0:
        return float(b)
    return (1.0 - a ** b) / (1.0 - a)


def context_bucket(longest: int) -> int:
    return 1 << max(0, int(longest) - 1).bit_length()


@dataclass
class PolicyMemory:
    """What a policy learns about a pair and keeps across calls (the loop keeps one per
    drafter, target, steps mode, sampling and block options): measured iteration costs
    ``cost`` {(block, bucket): {context bucket: seconds}}, the (block, bucket) keys whose
    warm-up run is done, the pair's decayed acceptance [accepted, judged] (new requests'
    prior) and the probe interval while decoding."""
    cost: Dict[Tuple[int, int], Dict[int, float]] = field(default_factory=dict)
    warm: set = field(default_factory=set)
    pair: List[float] = field(default_factory=lambda: [0.0, 0.0])
    probe: int = PROBE_FIRST

    def forget_acceptance(self) -> None:
        """Keep the costs, drop what was learnt about acceptance (a new workload)."""
        self.pair = [0.0, 0.0]
        self.probe = PROBE_FIRST


class Policy:
    """``options``: the block sizes the loop can run (1: decode without drafting; others: a
    draft of b - 1 tokens + a verify of b rows), ``n``: the request slots. ``choose`` before an
    iteration, ``observe`` after it (the loop's Stats.blocks counts the choices)."""

    def __init__(self, options: Sequence[int], n: int, memory: Optional[PolicyMemory] = None,
                 decode_tokens: int = 1):
        """``memory``: a PolicyMemory of earlier runs of the same pair and settings, shared and
        updated, so that a later run starts measured, with the pair's acceptance as its
        requests' prior and the probe interval where the last run left it. ``decode_tokens``:
        the tokens option 1 (decoding) commits a request an iteration (the loop's graphed
        greedy decode runs several steps between host reads)."""
        opts = sorted(set(int(b) for b in options))
        if not opts or opts[0] < 1:
            raise ValueError(f"Policy: options must be block sizes >= 1, got {list(options)}")
        self.options = opts
        self.decode_tokens = max(1, int(decode_tokens))
        self.memory = memory = memory if memory is not None else PolicyMemory()
        cost, warm, pair = memory.cost, memory.warm, memory.pair
        # the pair's acceptance over earlier requests (decayed), the prior of new ones
        self.pair = pair
        prior = (PRIOR[1] * pair[0] / pair[1], PRIOR[1]) if pair[1] > 0 else PRIOR
        self.acc = [list(prior) for _ in range(n)]  # per request: (accepted, judged)
        self.cost: Dict[Tuple[int, int], Dict[int, float]] = cost  # (b, bucket) -> {ctx: s}
        self.warm: set = warm  # (b, bucket) whose warm-up run is done
        self._decoding = 0  # consecutive decode iterations
        self._probing = False

    # -- estimates -------------------------------------------------------------------------
    def rate(self, r: int) -> float:
        a, j = self.acc[r]
        return a / j

    def cost_of(self, b: int, bucket: int, ctx: int) -> Optional[float]:
        by_ctx = self.cost.get((b, bucket))
        if not by_ctx:
            return None
        if ctx in by_ctx:
            return by_ctx[ctx]
        near = min(by_ctx, key=lambda c: abs(c.bit_length() - ctx.bit_length()))
        return by_ctx[near]

    def rates(self, requests: Sequence[int], bucket: int, ctx: int) -> Dict[int, float]:
        """Expected tokens a second of each option with a cost estimate."""
        out = {}
        for b in self.options:
            c = self.cost_of(b, bucket, ctx)
            if c is not None and c > 0:
                tokens = (self.decode_tokens * len(requests) if b == 1 else
                          sum(expected_tokens(self.rate(r), b) for r in requests))
                out[b] = tokens / c
        return out

    # -- the choice --------------------------------------------------------------------------
    def choose(self, requests: Sequence[int], bucket: int, longest: int) -> int:
        ctx = context_bucket(longest)
        # explore: an option without a measured cost in this bucket (largest block first)
        for b in sorted(self.options, reverse=True):
            if not self.cost.get((b, bucket)):
                return self._take(b, probing=False)
        rates = self.rates(requests, bucket, ctx)
        best = max(rates, key=lambda b: (rates[b], b))
        if best == 1 and len(self.options) > 1 and self._decoding >= self.memory.probe:
            return self._take(self.options[-1], probing=True)
        return self._take(best, probing=False)

    def _take(self, b: int, probing: bool) -> int:
        self._probing = probing
        self._decoding = self._decoding + 1 if b == 1 else 0
        return b

    def observe(self, b: int, bucket: int, longest: int, seconds: float,
                requests: Sequence[int], committed: Sequence[int],
                finished: Sequence[bool]) -> None:
        """After an iteration of block ``b``: its wall time (capture excluded) and, per request,
        the tokens it committed and whether it finished (a finished request's count may be cut
        by max_new_tokens or a stop token: not evidence)."""
        key = (b, bucket)
        if key not in self.warm:
            self.warm.add(key)  # the warm-up run: not a measurement
        else:
            by_ctx = self.cost.setdefault(key, {})
            ctx = context_bucket(longest)
            old = by_ctx.get(ctx)
            by_ctx[ctx] = seconds if old is None else 0.7 * old + 0.3 * seconds
        if b > 1:
            for r, k, f in zip(requests, committed, finished):
                if f:
                    continue
                accepted = max(0, int(k) - 1)
                judged = accepted + (1 if accepted < b - 1 else 0)
                for a, d in ((self.acc[r], DECAY), (self.pair, PAIR_DECAY)):
                    a[0] = d * a[0] + accepted
                    a[1] = d * a[1] + judged
        if self._probing:
            self._probing = False
            rates = self.rates(requests, bucket, context_bucket(longest))
            if rates and max(rates, key=lambda x: (rates[x], x)) == 1:
                self.memory.probe = min(PROBE_MAX, 2 * self.memory.probe)  # still not worth it
            else:
                self.memory.probe = PROBE_FIRST
