"""Speculation that pays: the loop's choice, each iteration, of a block size or of no drafting.

Every choice is lossless (a draft-and-verify iteration of any block size, or a plain decode
step, commits tokens the target would have produced), so the policy only decides speed. For
the active requests it picks the option with the most expected tokens a second:

    rate(b) = sum over requests of E_r(b) / cost(b, bucket, context)

- ``E_r(b)``, the tokens request r commits with block b: 1 + a + ... + a^(b-1) = (1 - a^b) /
  (1 - a) under a geometric model of acceptance, a = the request's running rate at which a
  draft is accepted given the previous one was (accepted drafts over drafts judged: a
  rejection is judged, drafts after it are not), decayed so that it follows the text; a new
  request's prior is worth sixteen judged drafts at the pair's acceptance over earlier
  requests (eight accepted and eight rejected before any; a prior of two let a couple of
  unlucky probes decide, a simulation near the break-even acceptance: 0.91 -> 0.97 of the
  better strategy at p 0.4, batch 1; eight let a poor stretch at a request's start pull the
  estimate under the break-even, 0.965 on the H200 at p 0.4, batch 1 x 8k, 0.92 median in a
  simulation of that run, 1.00 with sixteen). b = 1 is plain decoding: one token, or
  ``decode_tokens`` (the loop's graphed greedy decode iteration runs several steps); an
  iteration the loop cuts short (no request has that many tokens left) costs its steps plus
  a fixed part (``DECODE_FIXED``), not a whole iteration. Every count is capped by the tokens
  the request may still commit (its max_new_tokens).
- ``cost``: the seconds of one iteration of that option for this batch bucket (the steps'
  padded batch) and context bucket (the next power of two of the longest active request), the
  wall time the loop measures around the iteration (which ends in the loop's one host read),
  capture excluded. The first run of an option in a batch bucket is a warm-up (autotuning,
  the graph's first replay) and is not used. An option never run at a context bucket takes
  its estimate from the nearest measured context bucket of the same batch bucket, one never
  run in a batch bucket from the nearest measured batch bucket (the larger one first: a bound
  from above; the tail of a batch, as its requests finish, runs ever smaller buckets, and
  exploring each there cost up to 30% of a short run at p 0.95 in a simulation); only an
  option never run in any batch bucket is explored (run once to warm up, once to measure).
- Costs, the pair's acceptance and the probe interval outlive a call (``PolicyMemory``, kept
  by the loop per drafter, target, steps mode, sampling and options): a warm-up call measures,
  later calls start from its table.
- It keeps its last choice unless another option's rate is more than ``SWITCH`` higher
  (estimates near a tie would flip it back and forth; a switch from drafting to decoding also
  costs one eager add of the verify's pending context rows).
- While it decodes, the acceptance rates cannot move, so after ``interval`` consecutive decode
  iterations (of ``decode_tokens`` tokens each) it drafts once with the largest block to look
  again. The interval is priced: a probe loses cost(probe) * (1 - rate(probe) / rate(decode))
  against decoding, by the current estimates (at least SWITCH of its cost), and the interval is the fewest decode
  iterations that keep that loss within ``PROBE_BUDGET`` of their time (1 to ``PROBE_MAX``):
  near a tie it probes often (a probe costs little and may flip the choice), where drafting
  is far behind rarely. (The first version doubled the interval after every probe that left
  decoding ahead and kept it across calls: on the H200 at p 0.4, batch 1 x 8k, where drafting
  paid 16%, three unlucky probes left it decoding for whole runs at 0.85 of always drafting.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

PRIOR = (8.0, 16.0)  # (accepted, judged) drafts before any evidence: a = 0.5
DECAY = 0.95        # weight of the past per observation of a request
PAIR_DECAY = 0.99   # the same for the pair's acceptance over all requests (new ones' prior)
SWITCH = 0.02  # stay with the last option unless another's expected rate is this much higher
PROBE_BUDGET = 0.01  # while decoding, probes lose at most this share of the time (as estimated)
PROBE_MAX = 256      # decode iterations between probes at most
# the share of a decode iteration's time that does not scale with its steps (flush, the host
# read): H200, Qwen3-8B B 8 x 1k, 22.9 ms for four steps of ~5.39 ms each
DECODE_FIXED = 0.06


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
    warm-up run is done and the pair's decayed acceptance [accepted, judged] (new requests'
    prior)."""
    cost: Dict[Tuple[int, int], Dict[int, float]] = field(default_factory=dict)
    warm: set = field(default_factory=set)
    pair: List[float] = field(default_factory=lambda: [0.0, 0.0])

    def forget_acceptance(self) -> None:
        """Keep the costs, drop what was learnt about acceptance (a new workload)."""
        self.pair[:] = [0.0, 0.0]


class Policy:
    """``options``: the block sizes the loop can run (1: decode without drafting; others: a
    draft of b - 1 tokens + a verify of b rows), ``n``: the request slots. ``choose`` before an
    iteration, ``observe`` after it (the loop's Stats.blocks counts the choices)."""

    def __init__(self, options: Sequence[int], n: int, memory: Optional[PolicyMemory] = None,
                 decode_tokens: int = 1):
        """``memory``: a PolicyMemory of earlier runs of the same pair and settings, shared and
        updated, so that a later run starts measured, with the pair's acceptance as its
        requests' prior. ``decode_tokens``:
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
        self._last: Optional[int] = None  # the last choice that was not a probe

    # -- estimates -------------------------------------------------------------------------
    def rate(self, r: int) -> float:
        a, j = self.acc[r]
        return a / j

    def cost_of(self, b: int, bucket: int, ctx: int) -> Optional[float]:
        by_ctx = self.cost.get((b, bucket))
        if not by_ctx:  # the nearest measured batch bucket, larger first (an upper bound)
            known = [k for (o, k), v in self.cost.items() if o == b and v]
            if not known:
                return None
            near = min(known, key=lambda k: (abs(k.bit_length() - bucket.bit_length()), -k))
            by_ctx = self.cost[(b, near)]
        if ctx in by_ctx:
            return by_ctx[ctx]
        near = min(by_ctx, key=lambda c: abs(c.bit_length() - ctx.bit_length()))
        return by_ctx[near]

    def rates(self, requests: Sequence[int], bucket: int, ctx: int,
              left: Optional[Sequence[int]] = None) -> Dict[int, float]:
        """Expected tokens a second of each option with a cost estimate; ``left``: the most
        tokens each request may still commit (max_new_tokens), which caps its count."""
        cap = list(left) if left is not None else [1 << 30] * len(requests)
        out = {}
        for b in self.options:
            c = self.cost_of(b, bucket, ctx)
            if c is not None and c > 0 and b == 1 and cap:
                k = max(1, min(self.decode_tokens, max(cap)))  # the steps the loop will run
                c *= DECODE_FIXED + (1.0 - DECODE_FIXED) * k / self.decode_tokens
            if c is not None and c > 0:
                tokens = (sum(min(self.decode_tokens, m) for m in cap) if b == 1 else
                          sum(expected_tokens(self.rate(r), min(b, m))
                              for r, m in zip(requests, cap)))
                out[b] = tokens / c
        return out

    # -- the choice --------------------------------------------------------------------------
    def choose(self, requests: Sequence[int], bucket: int, longest: int,
               left: Optional[Sequence[int]] = None) -> int:
        """The block size of the next iteration of ``requests`` (slots) in batch ``bucket``, the
        longest being ``longest`` tokens; ``left``: the most tokens each may still commit."""
        ctx = context_bucket(longest)
        # explore: an option without a measured cost in any batch bucket (largest block first)
        for b in sorted(self.options, reverse=True):
            if not any(v for (o, _), v in self.cost.items() if o == b):
                return self._take(b, probing=False)
        rates = self.rates(requests, bucket, ctx, left)
        best = max(rates, key=lambda b: (rates[b], b))
        last = self._last
        if last in rates and rates[best] <= (1.0 + SWITCH) * rates[last]:
            best = last
        if (best == 1 and len(self.options) > 1
                and self._decoding >= self.probe_interval(rates, bucket, ctx, requests)):
            return self._take(self.options[-1], probing=True)
        return self._take(best, probing=False)

    def probe_interval(self, rates: Dict[int, float], bucket: int, ctx: int,
                       requests: Optional[Sequence[int]] = None) -> int:
        """Decode iterations before a probe with the largest block: the fewest whose time holds
        the probe's estimated loss against decoding within PROBE_BUDGET (1 to PROBE_MAX).
        ``requests``: the active ones. A decode iteration moves every request the same
        tokens, and a batch ends with its slowest request, so a probe is worth what it moves
        the slowest one: the fewest tokens any request commits, whose mean is E(prod_r a_r, b)
        (its chance of passing a draft is every request's); counted n times against decoding's
        n requests. (Pricing it by the sum of the requests' tokens, as the choice does, halved
        its loss at batch 8, p 0.2: a probe every 6 decode iterations, 0.961 of decoding on
        the H200; 0.99 simulated with this price.) Batch 1: the same as the sum."""
        b = self.options[-1]
        c1, cb = self.cost_of(1, bucket, ctx), self.cost_of(b, bucket, ctx)
        if not (rates.get(1) and rates.get(b) and c1 and cb):
            return 1
        rate_b = rates[b]
        if requests is not None and len(requests) > 1:
            a = 1.0
            for r in requests:
                a *= self.rate(r)
            rate_b = len(requests) * expected_tokens(a, b) / cb
        loss = cb * max(SWITCH, 1.0 - rate_b / rates[1])  # at least a switch's margin
        return int(min(PROBE_MAX, max(1, math.ceil(loss / (PROBE_BUDGET * c1)))))

    def _take(self, b: int, probing: bool) -> int:
        if not probing:
            self._last = b
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
