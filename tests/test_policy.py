"""The loop's policy (speculator.policy): its choice from acceptance and measured costs, and the
loop running mixed block sizes and decode iterations. Every choice is lossless, so the output
must equal plain greedy whatever the policy does; on the counter pair (whose drafts are all right
once the drafter's context holds the tokens V + 1 back) every drafting iteration must accept its
whole block, which only holds if decode iterations and block-size switches keep the drafter's
context complete (the prompts are short enough that late blocks copy from rows the loop itself
committed)."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from dflash_ops.models.config import DFlashConfig
from dflash_ops.models.drafter import DFlashDrafter
from dflash_ops.models.synthetic import counter_pair, counter_prompts
from dflash_ops.models.target import Target, TargetConfig
from dflash_ops.speculator import policy as P
from dflash_ops.speculator.loop import plain_greedy, speculative_generate

SMALL = dict(hidden=128, vocab=64, target_layers=3, draft_layers=2, heads=4, kv_heads=2,
             head_dim=32, intermediate=128, block_size=8)


# ----------------------------------------------------------------------------- the policy
def test_expected_tokens():
    assert P.expected_tokens(0.3, 1) == 1.0
    assert P.expected_tokens(0.0, 8) == 1.0
    assert P.expected_tokens(1.0, 8) == 8.0
    assert P.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)


def _feed(pol, b, bucket, seconds, committed, n=2, times=1, longest=100):
    for _ in range(times):
        pol.observe(b, bucket, longest, seconds, list(range(n)), [committed] * n, [False] * n)


def test_explores_each_option_twice_largest_first_then_takes_the_faster():
    pol = P.Policy([1, 8], 2)
    order = []
    for _ in range(4):
        b = pol.choose([0, 1], 2, 100)
        order.append(b)
        _feed(pol, b, 2, {8: 0.010, 1: 0.004}[b], 8 if b == 8 else 1)  # every draft accepted
    assert order == [8, 8, 1, 1]  # the first run of each is a warm-up, not a measurement
    assert pol.choose([0, 1], 2, 100) == 8  # ~8 tokens / 10 ms beats 1 / 4 ms


def test_decodes_when_nothing_is_accepted_and_prices_its_probes():
    pol = P.Policy([1, 8], 1)
    for b in (8, 8, 1, 1):
        assert pol.choose([0], 1, 50) == b
        _feed(pol, b, 1, {8: 0.012, 1: 0.004}[b], 1, n=1)  # no draft accepted
    picks = []
    for _ in range(1000):  # (the prior of sixteen judged drafts falls over more probes)
        b = pol.choose([0], 1, 50)
        picks.append(b)
        _feed(pol, b, 1, {8: 0.012, 1: 0.004}[b], 1, n=1)
    probes = [i for i, b in enumerate(picks) if b == 8]
    assert picks.count(1) > 970 and len(probes) >= 2  # decoding, with a few probes
    # a probe loses up to 12 ms * (1 - (1 / 12) / (1 / 4)) = 8 ms against decoding: at most 1%
    # of the decode time between probes (4 ms each): <= 200, nearing it as the estimate falls
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and 150 < gaps[-1] <= 200, gaps
    lost = 0.008 * len(probes) / (0.004 * picks.count(1))
    assert lost < 2 * P.PROBE_BUDGET, lost


def test_probes_often_near_a_tie_and_returns_to_drafting():
    # drafting at a = 0.4 commits 1.67 tokens in 8 ms, decoding 4 tokens in 22.3 ms (the H200's
    # batch 1 x 8k): drafting pays 16%; a run of rejections must not leave it decoding for long
    pol = P.Policy([1, 16], 1, decode_tokens=4)
    for b in (16, 16, 1, 1):
        pol.choose([0], 1, 8000)
        _feed(pol, b, 1, {16: 0.008, 1: 0.0223}[b], 1, n=1, longest=8000)
    _feed(pol, 16, 1, 0.008, 1, n=1, times=10, longest=8000)  # a run of rejections
    assert pol.rate(0) < 0.3 and pol.choose([0], 1, 8000) == 1  # decoding
    rates = pol.rates([0], 1, 8192)
    assert pol.probe_interval(rates, 1, 8192) <= 20
    picks = []
    for i in range(40):  # the drafts now accept a geometric 0.4's mean (2 of 3 tokens)
        b = pol.choose([0], 1, 8000)
        picks.append(b)
        _feed(pol, b, 1, {16: 0.008, 1: 0.0223}[b], 2 if b == 16 else 4, n=1, longest=8000)
    assert picks[-10:] == [16] * 10, picks


def test_probe_that_finds_acceptance_again_returns_to_drafting():
    pol = P.Policy([1, 8], 1)
    for b in (8, 8, 1, 1):
        pol.choose([0], 1, 50)
        _feed(pol, b, 1, {8: 0.012, 1: 0.004}[b], 1, n=1)
    picks = []
    for _ in range(300):  # the text turns predictable: each probe accepts the whole block
        b = pol.choose([0], 1, 50)
        picks.append(b)
        _feed(pol, b, 1, {8: 0.012, 1: 0.004}[b], 8 if b == 8 else 1, n=1)
    # the first probe after <= 200 decodes (priced at a low estimate), drafting for good
    # within a few probes (the first may leave drafting short of the switch margin; with the
    # prior of sixteen judged drafts the second comes ~50 decodes later)
    first = picks.index(8)
    assert first <= 200 and picks[first + 60:] == [8] * (240 - first), picks


def test_costs_are_per_batch_bucket_and_fall_back_across_context_buckets():
    pol = P.Policy([1, 4], 4)
    for b in (4, 4, 1, 1):
        assert pol.choose([0, 1], 2, 1000) == b
        _feed(pol, b, 2, 0.01, 2)
    assert pol.cost_of(4, 2, P.context_bucket(1000)) == pytest.approx(0.01)
    assert pol.cost_of(4, 2, P.context_bucket(9000)) == pytest.approx(0.01)  # nearest bucket
    # a batch bucket not yet run: the nearest measured one's costs (the larger first), no
    # exploration (it ran 30% of a short run's time in the tail of a batch)
    _feed(pol, 4, 8, 0.03, 2)  # bucket 8's warm-up
    _feed(pol, 4, 8, 0.03, 2)
    assert pol.cost_of(4, 4, 1024) == pytest.approx(0.03)  # 8 before 2, equally near
    assert pol.cost_of(1, 4, 1024) == pytest.approx(0.01)  # only bucket 2 measured
    assert pol.cost_of(1, 64, 1024) == pytest.approx(0.01)
    assert pol.choose([0, 1, 2, 3], 4, 1000) in (1, 4)
    assert P.Policy([1, 4], 4).cost_of(4, 4, 1024) is None  # nothing measured at all


def test_finished_requests_are_not_evidence():
    pol = P.Policy([1, 8], 2)
    pol.observe(8, 1, 10, 0.01, [0, 1], [2, 8], [True, False])
    assert pol.rate(0) == pytest.approx(P.PRIOR[0] / P.PRIOR[1])  # cut by max_new: ignored
    assert pol.rate(1) == pytest.approx((0.95 * P.PRIOR[0] + 7) / (0.95 * P.PRIOR[1] + 7))
    assert pol.rate(1) > 0.65  # 7 of 7 judged drafts accepted over the prior (0.5)


def test_bad_policy_blocks_name_the_argument():
    target, drafter = _pair()
    with pytest.raises(ValueError, match=r"policy_blocks must be block sizes in \[1, 8\]"):
        speculative_generate(target, drafter, [[1, 2, 3]], 4, policy_blocks=[1, 9])
    with pytest.raises(ValueError, match="policy_blocks"):
        speculative_generate(target, drafter, [[1, 2, 3]], 4, policy_blocks=[0, 8])


# ----------------------------------------------------------------------------- in the loop
def _pair(max_len=320, device="cpu"):
    tc, ts, dc, ds = counter_pair(**SMALL)
    cache = dict(dtype=torch.float32, device=device, max_requests=4, max_len=max_len,
                 num_blocks=4 * (max_len // 16))
    target = Target(TargetConfig.from_hf(tc), ts, block_size=16, **cache)
    drafter = DFlashDrafter(DFlashConfig.from_dict(dc), ds, embed_tokens=target.embed,
                            lm_head=target.lm_head, cache_block_size=16, **cache)
    return target, drafter


@pytest.mark.parametrize("steps,device", [
    ("direct", "cpu"), ("static", "cpu"),
    pytest.param("graphs", "cuda", marks=pytest.mark.gpu),
    pytest.param("direct", "cuda", marks=pytest.mark.gpu)])
def test_mixed_blocks_and_decodes_keep_the_drafter_context(steps, device, monkeypatch):
    """A fixed cycle of choices over blocks 8, 4, 2 and decoding; 150 new tokens on prompts of
    70-90 tokens: from about the 70th new token on, every draft copies a token the loop
    committed, including tokens committed by decode iterations."""
    cycle = itertools.cycle([8, 1, 1, 4, 1, 8, 2, 2, 1, 8, 4])
    monkeypatch.setattr(P.Policy, "choose", lambda self, *a: self._take(next(cycle), False))
    target, drafter = _pair(device=device)
    prompts = counter_prompts(3, vocab=SMALL["vocab"], lengths=(70, 90, 81), seed=3)
    want = plain_greedy(target, prompts, 150)
    got, st = speculative_generate(target, drafter, prompts, 150, steps=steps,
                                   policy_blocks=(1, 2, 4, 8))
    assert got == want
    assert set(st.blocks) == {1, 2, 4, 8} and sum(st.blocks.values()) == st.iterations
    # per drafting iteration and request: the whole block accepted (a request's last
    # iteration may be cut by max_new_tokens: it commits fewer)
    assert st.drafted > 0 and sum(a - 1 for a in st.acceptance) >= 0.9 * st.drafted, st


@pytest.mark.parametrize("steps,device", [
    ("direct", "cpu"), ("static", "cpu"),
    pytest.param("graphs", "cuda", marks=pytest.mark.gpu)])
def test_decode_only_equals_plain_greedy(steps, device, monkeypatch):
    """Decode iterations only (on the GPU with graphs: each iteration one graph of prepare,
    decode, commit), requests ending at different iterations on a stop token, so the active
    set and its bucket shrink (padded rows must commit nothing). The drafter's context after
    decode iterations: test_mixed_blocks_and_decodes_keep_the_drafter_context."""
    target, drafter = _pair(device=device)
    prompts = counter_prompts(3, vocab=SMALL["vocab"], lengths=(70, 75, 81), seed=1)
    free = plain_greedy(target, prompts, 40)
    stop = [free[0][9], free[2][24]]  # request 0 ends at its 10th new token at the latest
    want = plain_greedy(target, prompts, 40, stop_token_ids=stop)
    assert len({len(w) for w in want}) > 1, want  # they end at different iterations
    # with DFLASH_OPS_DEBUG=1: the padded rows (-1) the decode steps pass are no error
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "1")
    got, st = speculative_generate(target, drafter, prompts, 40, steps=steps,
                                   policy_blocks=(1,), stop_token_ids=stop)
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "0")
    assert got == want
    assert st.blocks == {1: st.iterations} and st.acceptance == [] and st.drafted == 0
    # static steps (graphed or not): DECODE_STEPS steps an iteration, finished requests masked
    from dflash_ops.speculator.step import DECODE_STEPS
    if steps == "direct":
        assert st.decode_steps == st.iterations
    else:  # every iteration but the last (cut to the tokens left) runs DECODE_STEPS steps
        assert DECODE_STEPS * (st.iterations - 1) < st.decode_steps <= DECODE_STEPS * st.iterations
    # 40 new tokens, none stopped (the prefill gives the first): 39 steps, not one more
    got, st = speculative_generate(target, drafter, prompts, 40, steps=steps,
                                   policy_blocks=(1,))
    assert got == free and st.decode_steps == 39, st.decode_steps


def test_policy_drafts_when_drafts_are_right_and_decodes_when_wrong(monkeypatch):
    """The real policy in the loop, its measured costs replaced by a fixed model (an iteration
    of block 8 costs 3 decode steps; CPU timings are too noisy for a test, and on this CPU the
    real ratio is near the break-even): the counter pair accepts every draft, so drafting a
    block of 8 wins; the same pair with the drafter copying from one position off accepts
    nothing, so decoding wins."""
    observe = P.Policy.observe
    monkeypatch.setattr(P.Policy, "observe", lambda self, b, bucket, longest, seconds, *a:
                        observe(self, b, bucket, longest, {1: 1.0, 8: 3.0}[b], *a))
    target, drafter = _pair()
    prompts = counter_prompts(2, vocab=SMALL["vocab"], lengths=(70, 75), seed=1)
    _, st = speculative_generate(target, drafter, prompts, 120, steps="direct")
    assert st.blocks.get(8, 0) > st.blocks.get(1, 0), st.blocks
    tc, ts, dc, ds = counter_pair(delta=SMALL["vocab"] + 2, **SMALL)  # one position off
    wrong = DFlashDrafter(DFlashConfig.from_dict(dc), ds, embed_tokens=target.embed,
                          lm_head=target.lm_head, cache_block_size=16, dtype=torch.float32,
                          device="cpu", max_requests=4, max_len=320, num_blocks=80)
    got, st = speculative_generate(target, wrong, prompts, 120, steps="direct")
    assert got == plain_greedy(target, prompts, 120)
    assert st.blocks.get(1, 0) > 3 * st.blocks.get(8, 0), st.blocks


@pytest.mark.parametrize("cycle", [(1,), (1, 4)], ids=["decode", "decode-then-block-4"])
def test_sampling_through_decode_iterations_matches_target_distribution(cycle, monkeypatch):
    """test_speculator's chi-square over the joint of the first three new tokens, with the
    second drawn by a decode iteration (sampled from the target's p, committed without drafts)
    and the third by a decode iteration or a block of 4 (rejection sampling)."""
    from tests.test_speculator import _exact_joint, _small_vocab_pair, assert_matches_joint
    picks = itertools.cycle(cycle)
    monkeypatch.setattr(P.Policy, "choose", lambda self, *a: self._take(next(picks), False))
    target, drafter = _small_vocab_pair(device="cpu", dflash2=False)
    prompt, temp, n_new, reps = [0, 2, 1, 1, 0], 1.0, 3, 16
    want = _exact_joint(target, prompt, n_new, temp, 0)
    gen = torch.Generator().manual_seed(0)
    counts, total = {}, 0
    for _ in range(250):
        got, st = speculative_generate(target, drafter, [prompt] * reps, n_new, temperature=temp,
                                       generator=gen, steps="direct",
                                       policy_blocks=(1, 4) if len(cycle) > 1 else (1,))
        assert st.blocks.get(1, 0) >= 1
        for o in got:
            counts[tuple(o)] = counts.get(tuple(o), 0) + 1
            total += 1
    assert_matches_joint(counts, total, want)


def test_costs_outlive_the_call(monkeypatch):
    """The warm-up call measures; a later call on the same pair starts from its costs (the
    demo's timed run does not explore again). Costs from a fixed model, as above."""
    from dflash_ops.speculator import loop
    observe = P.Policy.observe
    monkeypatch.setattr(P.Policy, "observe", lambda self, b, bucket, longest, seconds, *a:
                        observe(self, b, bucket, longest, {1: 1.0, 8: 3.0}[b], *a))
    target, drafter = _pair()
    prompts = counter_prompts(2, vocab=SMALL["vocab"], lengths=(70, 75), seed=1)
    speculative_generate(target, drafter, prompts, 20, steps="direct")
    (key, mem), = loop.policy_memory(drafter).items()
    assert key == (id(target), "direct", False, (1, 8), False)
    assert {b for b, _ in mem.cost} == {1, 8} and all(mem.cost.values()) and len(mem.warm) == 2
    assert mem.pair[1] > 0 and mem.pair[0] / mem.pair[1] > 0.9  # every draft accepted
    seen = []
    real = P.Policy.choose
    monkeypatch.setattr(P.Policy, "choose",
                        lambda self, *a: seen.append(real(self, *a)) or seen[-1])
    got, _ = speculative_generate(target, drafter, prompts, 20, steps="direct")
    assert got == plain_greedy(target, prompts, 20)
    # every draft is right, so with costs and the pair's acceptance known it drafts from the
    # start; exploring again would run 8, 8, 1, 1 first
    assert len(seen) >= 2 and 1 not in seen[:4], seen


@pytest.mark.parametrize("steps", ["direct", "static"])
def test_oracle_drafter_is_right_with_probability_p(steps):
    """bench.policy's oracle on a drafter that is always wrong (the counter drafter one position
    off): p = 1 makes every draft right, p = 0 none, p = 0.5 about geometric; the output is the
    target's whatever p."""
    from dflash_ops.bench.policy import OracleDrafter
    target, _ = _pair()
    tc, ts, dc, ds = counter_pair(delta=SMALL["vocab"] + 2, **SMALL)
    wrong = DFlashDrafter(DFlashConfig.from_dict(dc), ds, embed_tokens=target.embed,
                          lm_head=target.lm_head, cache_block_size=16, dtype=torch.float32,
                          device="cpu", max_requests=4, max_len=320, num_blocks=80)
    prompts = counter_prompts(2, vocab=SMALL["vocab"], lengths=(70, 75), seed=1)
    want = plain_greedy(target, prompts, 40)
    oracle = OracleDrafter(wrong)
    oracle.set_reference(prompts, want, 4)
    means = {}
    for p in (1.0, 0.0, 0.5):
        oracle.p = p
        got, st = speculative_generate(target, oracle, prompts, 40, steps=steps, policy=False)
        assert got == want
        means[p] = sum(a - 1 for a in st.acceptance) / st.drafted
        last = st.acceptance
    assert means[1.0] > 0.9 and means[0.0] == 0.0 and 0.05 < means[0.5] < 0.5, means
    # right or wrong is fixed per position: the same run again accepts the same counts
    again = speculative_generate(target, oracle, prompts, 40, steps=steps, policy=False)[1]
    assert again.acceptance == last


def test_memory_keeps_costs_and_acceptance_and_forgets_acceptance_on_request():
    mem = P.PolicyMemory()
    pol = P.Policy([1, 8], 1, memory=mem)
    for _ in range(120):  # nothing accepted, drafting 3x a decode's cost: decoding, probing
        b = pol.choose([0], 1, 50)
        _feed(pol, b, 1, {8: 0.012, 1: 0.004}[b], 1, n=1)
    assert mem.pair[1] > 0 and mem.pair[0] == 0
    again = P.Policy([1, 8], 1, memory=mem)  # a later call: measured, decoding at once
    assert again.rate(0) == 0.0 and again.choose([0], 1, 50) == 1
    mem.forget_acceptance()
    assert mem.pair == [0.0, 0.0] and mem.cost
    assert P.Policy([1, 8], 1, memory=mem).rate(0) == pytest.approx(0.5)  # the prior again


def test_keeps_its_choice_unless_another_is_clearly_faster():
    pol = P.Policy([1, 8], 1)
    for b in (8, 8, 1, 1):
        pol.choose([0], 1, 50)
        _feed(pol, b, 1, {8: 0.010, 1: 0.005}[b], 2 if b == 8 else 1, n=1)
    e8 = P.expected_tokens(pol.rate(0), 8)
    pol.cost[(1, 1)][64] = 0.004  # decoding clearly ahead: taken
    pol.cost[(8, 1)][64] = e8 * 0.004 * 1.10  # (rate: expected tokens / cost)
    assert pol.choose([0], 1, 50) == 1
    pol.cost[(8, 1)][64] = e8 * 0.004 / 1.01  # drafting now 1% faster: no switch
    assert pol.choose([0], 1, 50) == 1
    pol.cost[(8, 1)][64] = e8 * 0.004 / 1.04  # 4% faster: switch
    assert pol.choose([0], 1, 50) == 8
    pol.cost[(1, 1)][64] = 0.004 / 1.04 / 1.01  # decoding 1% faster again: stays drafting
    assert pol.choose([0], 1, 50) == 8


def test_bench_policy_cases_from_the_environment(monkeypatch):
    from dflash_ops.bench import policy as bp
    monkeypatch.setenv(bp.ENV_CASES, "2x1q")
    with pytest.raises(ValueError, match="DFLASH_OPS_BENCH_POLICY_CASES: '2x1q' is not BxS"):
        bp.run()
    monkeypatch.setenv(bp.ENV_CASES, "2x1k")
    monkeypatch.setenv(bp.ENV_PS, "0.2,0.3")
    with pytest.raises(ValueError, match=r"DFLASH_OPS_BENCH_POLICY_PS: '0.2,0.3' is not a "
                                         r"comma-separated subset of \(0.0, 0.2"):
        bp.run()
    assert bp.parse_ps("0.95, 0,0.2") == (0.0, 0.2, 0.95)
    monkeypatch.setenv(bp.ENV_PS, "0.95,0")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU; nothing was run"):
            bp.run()


@pytest.mark.parametrize("blocks", [(1,), (1, 8), (8,)])
def test_steps_hold_one_scratch_slot_in_both_caches(blocks):
    """Every step set holds request slot n in both caches (the decode step writes its padded
    rows' context into the drafter's) and gives both back on close."""
    from dflash_ops.speculator import loop
    target, drafter = _pair()
    steps = loop._Steps(target, drafter, 2, list(blocks), logits=False)
    try:
        assert 2 in target.cache.in_use() and 2 in drafter.cache.in_use()
        assert set(steps.pairs) == set(blocks)
    finally:
        steps.close()
    assert 2 not in target.cache.in_use() and 2 not in drafter.cache.in_use()


def _counter_target(dtype=torch.float32):
    """A tiny Qwen3 target (random weights) made a counter by bench.policy.counter_target: its
    greedy next token is t + 1 (mod 900) with a wide margin; CPU."""
    from dflash_ops.bench.e2e import _random_state
    from dflash_ops.bench.policy import counter_target
    from dflash_ops.models.target import expected_target_shapes
    cfg = TargetConfig(hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=512, vocab_size=1000, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=False, attention_bias=False,
                       qk_norm=True, source="test")
    state = _random_state(expected_target_shapes(cfg)[0], 0, "cpu", dtype)
    counter_target(state, successor_of=900)
    return Target(cfg, state, dtype=dtype, device="cpu", max_requests=4, max_len=256,
                  num_blocks=64, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_counter_target_follows_its_successor_with_a_margin(dtype):
    """bench.policy's counter target: random weights of a Qwen3 shape except the embedding,
    the LM head and the output projections; greedy decoding gives t + 1 (mod the successor
    range) after any token, so every strategy commits the same tokens."""
    from dflash_ops.bench.policy import counter_target
    target = _counter_target(dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 900, (n,), generator=g).tolist() for n in (5, 40, 17)]
    prompts[0][-1] = 899  # wraps around
    got = plain_greedy(target, prompts, 30)
    for p, o in zip(prompts, got):
        assert o == [(p[-1] + 1 + i) % 900 for i in range(30)]
    # the margin: the successor's logit far above every other
    logits, _ = target.forward(torch.tensor(prompts[1]), torch.tensor([0]), torch.tensor([0]),
                               torch.tensor([40]), None, fp32_logits=True)
    top2 = logits[-1].topk(2).values
    assert top2[0] > 3 * top2[1].abs(), top2  # ~16 sqrt(H) vs the largest of N(0, 16^2)
    with pytest.raises(ValueError, match="untied LM head"):
        counter_target({"model.embed_tokens.weight": torch.zeros(1000, 256, dtype=dtype)}, 900)


def test_bench_policy_times_the_three_loops_interleaved(monkeypatch):
    """bench.policy's run_case on CPU with the loop runs faked: per p one warm-up of always
    (first p) and of policy, then REPEATS rounds of never / always / policy in a rotated order
    (drift falls on all three alike); rates are each strategy's median, the notes list every
    run's iteration counts."""
    from types import SimpleNamespace

    import dflash_ops.speculator.demo as demo
    from dflash_ops.bench import harness
    from dflash_ops.bench import policy as bp

    calls = []
    speed = {"never": 100.0, "always": 200.0, "policy": 190.0}

    def fake_loop(target, drafter, prompts, n_new, **kw):
        name = ("never" if kw.get("policy_blocks") == (1,) else
                "always" if kw.get("policy") is False else "policy")
        calls.append(name)
        k = sum(c == name for c in calls)
        out = [[1, 2, 3] for _ in prompts]
        blocks = {1: 30} if name == "never" else {16: 7 + k % 2}
        st = SimpleNamespace(blocks=blocks, mean_acceptance=1.5)
        return out, speed[name] + k, st, 0.01

    monkeypatch.setattr(bp, "_loop_rate", fake_loop)
    def fake_plain(t, p, n, timings=None):  # 0.5 s a run, of which its own prefill 0.1
        if timings is not None:
            timings["prefill"] = 0.1
        return [[1, 2, 3] for _ in p], 0.5

    monkeypatch.setattr(demo, "_decode_graphed", fake_plain)
    target = SimpleNamespace(cfg=SimpleNamespace(vocab_size=50), forward=None)
    drafter = SimpleNamespace(cfg=SimpleNamespace(mask_token_id=49, vocab_size=50),
                              cache=SimpleNamespace(block_table=torch.zeros(3, 4)),
                              device=torch.device("cpu"))
    res = harness.Results("policy-test", floors={"copy_GBps": 1.0, "gemm_TFLOPs": 1.0})
    bp.run_case(res, target, drafter, 2, 8, ps=(0.0, 0.5), n_new=3, repeats=3)
    first = calls[:1 + 3]  # never's warm-up and its three runs (the reference tokens)
    assert first == ["never"] * 4
    p0 = calls[4:4 + 2 + 9]
    assert p0[:2] == ["always", "policy"]  # warm-ups at the first p
    assert p0[2:] == ["never", "always", "policy", "always", "policy", "never",
                      "policy", "never", "always"]
    p1 = calls[15:]
    assert p1[0] == "policy" and len(p1) == 10  # the policy's warm-up only
    rows = res.tables()[bp.TABLE]
    pol = [r for r in rows if r["strategy"] == "policy" and r["p"] == 0.5][0]
    assert pol["note"].count("block 16") == 3 and "runs:" in pol["note"]
    plain = [r["tokens_per_s"] for r in rows if r["strategy"] == "plain decode"]
    assert plain == [pytest.approx(2 * 3 / 0.4)] * 2  # less its own prefill, not the loop's 0.01
    summary = res.tables()[bp.SUMMARY]
    assert len(summary) == 2 and all(not r["ok (>= 0.97)"] for r in summary)  # 190 vs 200


def test_bench_policy_trace_records_choices_and_costs(tmp_path):
    from dflash_ops.bench import policy as bp
    path = tmp_path / "trace.jsonl"
    with bp._traced(str(path), case="B=1 S=8", p=0.2, run=0):
        pol = P.Policy([1, 8], 1)
        for b in (8, 8, 1):
            got = pol.choose([0], 1, 50, [10])
            assert got == b
            pol.observe(got, 1, 50, 0.01, [0], [1], [False])
    assert P.Policy.choose.__name__ == "choose"  # unpatched after the block
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["choice"] for r in rows] == [8, 8, 1]
    assert rows[0]["case"] == "B=1 S=8" and rows[0]["p"] == 0.2 and rows[0]["left"] == [10, 10]
    assert all(r["seconds"] == 0.01 for r in rows) and not any(r["probe"] for r in rows)
    with bp._traced(None):  # no path: nothing patched, nothing written
        assert P.Policy.choose.__name__ == "choose"


def test_a_cut_decode_iteration_costs_its_steps():
    # the loop runs no more decode steps than the most tokens a request has left: two steps
    # cost the fixed part and half the steps' part of a four-step iteration
    pol = P.Policy([1, 8], 2, decode_tokens=4)
    for b in (8, 8, 1, 1):
        pol.choose([0, 1], 2, 100)
        _feed(pol, b, 2, {8: 0.012, 1: 0.020}[b], 1)
    full = pol.rates([0, 1], 2, 128, left=[50, 60])[1]
    cut = pol.rates([0, 1], 2, 128, left=[2, 1])[1]
    assert full == pytest.approx(8 / 0.020)
    assert cut == pytest.approx(3 / (0.020 * (P.DECODE_FIXED + (1 - P.DECODE_FIXED) * 0.5)))


def test_probes_are_priced_by_the_slowest_request():
    # eight requests at a = 0.2: a block moves each ~1.25 tokens but the slowest ~1.0 (all
    # eight must pass a draft), so a probe loses more than the sum prices it at: sparser
    pol = P.Policy([1, 16], 8, decode_tokens=4)
    reqs = list(range(8))
    for b in (16, 16, 1, 1):
        pol.choose(reqs, 8, 1000)
        _feed(pol, b, 8, {16: 0.0083, 1: 0.0229}[b], 1, n=8, longest=1000)
    for r in reqs:
        pol.acc[r] = [0.2, 1.0]
    rates = pol.rates(reqs, 8, 1024)
    by_sum = pol.probe_interval(rates, 8, 1024)
    slowest = pol.probe_interval(rates, 8, 1024, reqs)
    assert slowest > by_sum
    one = P.Policy([1, 16], 1, decode_tokens=4, memory=pol.memory)
    one.acc[0] = [0.2, 1.0]
    r1 = one.rates([0], 8, 1024)
    assert one.probe_interval(r1, 8, 1024, [0]) == one.probe_interval(r1, 8, 1024)  # batch 1


@pytest.mark.parametrize("steps,device", [
    ("static", "cpu"), pytest.param("graphs", "cuda", marks=pytest.mark.gpu)])
def test_drafting_iteration_as_one_step(steps, device, monkeypatch):
    """Greedy static steps, untimed: a drafting iteration is one step (graphed: one graph a
    bucket) of prepare, draft, prepare, verify, commit, context and flags, read once. With
    stop tokens the requests end at different iterations, so the active set and its bucket
    shrink (padded rows must commit nothing and add no context; DFLASH_OPS_DEBUG=1 passes
    their -1 rows). Over 150 new tokens the drafter's context must stay current (late drafts
    copy tokens the loop committed: whole blocks accepted on the counter pair), and the
    staged iteration (the steps' own loads, the pending context rows) gives the same tokens
    and the same acceptance."""
    from dflash_ops.speculator.step import Iteration

    target, drafter = _pair(device=device)
    prompts = counter_prompts(3, vocab=SMALL["vocab"], lengths=(70, 75, 81), seed=1)
    free = plain_greedy(target, prompts, 80)
    stop = [free[0][20], free[2][44]]
    want = plain_greedy(target, prompts, 80, stop_token_ids=stop)
    assert len({len(w) for w in want}) == 3, want  # they end at different iterations
    buckets = []
    one_step = Iteration._one_step
    monkeypatch.setattr(Iteration, "_one_step",
                        lambda self, state, bucket: (buckets.append(bucket),
                                                     one_step(self, state, bucket))[1])
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "1")
    got, st = speculative_generate(target, drafter, prompts, 80, stop, steps=steps,
                                   policy=False, time_stages=False)
    monkeypatch.setenv("DFLASH_OPS_DEBUG", "0")
    assert got == want
    assert set(buckets) == {3, 2, 1}, buckets  # 3 requests (bucket: at most the batch), 2, 1
    assert st.host_syncs == st.iterations + 1 + (3 if steps == "graphs" else 0)  # + captures

    want = plain_greedy(target, prompts, 150)
    got, st = speculative_generate(target, drafter, prompts, 150, steps=steps, policy=False,
                                   time_stages=False)
    assert got == want
    assert st.drafted > 0 and sum(a - 1 for a in st.acceptance) >= 0.9 * st.drafted, st
    init = Iteration.__init__

    def staged(self, *a, **kw):
        init(self, *a, **kw)
        self.one = False

    monkeypatch.setattr(Iteration, "__init__", staged)
    buckets.clear()
    got2, st2 = speculative_generate(target, drafter, prompts, 150, steps=steps, policy=False,
                                     time_stages=False)
    assert not buckets and got2 == want
    if device == "cpu":
        assert st2.acceptance == st.acceptance and st2.iterations == st.iterations
    else:  # cuBLAS may round the context projection by its row count (24 vs bucket x 8 rows)
        # and flip a near-tie draft: the tokens are equal, the acceptance close
        assert abs(sum(st2.acceptance) - sum(st.acceptance)) <= 0.05 * sum(st.acceptance)


def _policy_json(path, cases, ratio, date="2026-12-05", commit="abc"):
    """A policy suite's JSON as run() writes it, with the policy at ``ratio`` of always."""
    from dflash_ops.bench import policy as bp
    rows = []
    for case in cases:
        for p in bp.P_GRID:
            rates = {"plain decode": 100.0, "never": 95.0, "always": 100.0 + 100 * p}
            rates["policy"] = ratio(case, p) * max(rates["always"], rates["never"])
            for name in bp.STRATEGIES:
                rows.append({"table": bp.TABLE, "case": case, "p": p, "strategy": name,
                             "tokens_per_s": rates[name], "x": p, "note": ""})
            best = max(rates["always"], rates["never"])
            rows.append({"table": bp.SUMMARY, "case": case, "p": p,
                         "policy": rates["policy"], "always": rates["always"],
                         "never": rates["never"], "plain": rates["plain decode"],
                         bp.RATIO: rates["policy"] / best,
                         "ok (>= 0.97)": rates["policy"] >= 0.97 * best,
                         "policy / max(always, plain)": rates["policy"] / best})
    path.write_text(json.dumps({"name": "policy-x", "date": date, "gpu": "NVIDIA H200",
                                "commit": commit, "floors": {"copy_GBps": 4200.0},
                                "notes": ["shared note", "verdict: stale"], "rows": rows}))
    return path


def test_bench_policy_merge_joins_runs_and_judges_the_grid(tmp_path):
    """merge(): runs of some cases each (one device call each) become one table, summary and
    figure; a later file's point replaces an earlier one's; the verdict finds the worst point,
    the wins and the grid points not measured."""
    from dflash_ops.bench import policy as bp
    a = _policy_json(tmp_path / "a.json", ["B=1 S=1024", "B=8 S=1024"],
                     lambda c, p: 0.95 if (c, p) == ("B=8 S=1024", 0.4) else 1.0)
    b = _policy_json(tmp_path / "b.json", ["B=8 S=1024", "B=1 S=8192"],
                     lambda c, p: 1.05 if (c, p) == ("B=1 S=8192", 0.6) else 0.99,
                     commit="def")
    out = tmp_path / "out"
    res = bp.merge([str(a), str(b)], out, make_plot=False)
    summary = res.tables()[bp.SUMMARY]
    assert len(summary) == 3 * len(bp.P_GRID)  # B=8 S=1024 once: b's rows replace a's
    assert all(r[bp.RATIO] == pytest.approx(0.99) for r in summary if r["case"] == "B=8 S=1024")
    # cases by batch, then context (not the files' order, not the text's: "8192" < "1024" x 8)
    assert list(dict.fromkeys(r["case"] for r in summary)) == ["B=1 S=1024", "B=1 S=8192",
                                                                "B=8 S=1024"]
    v = [n for n in res.notes if n.startswith("verdict:")]
    assert "at 18 of 18 points" in v[0] and "faster than both at 1 " in v[0]
    assert "best 1.050 at B=1 S=8192 p=0.6" in v[0]
    assert f"{(len(bp.CASES) - 3) * len(bp.P_GRID)} of {len(bp.CASES) * len(bp.P_GRID)} grid " \
           "points not measured" in v[1] and v[1].endswith(", B=32 S=32768")
    assert "verdict: stale" not in res.notes and res.notes.count("shared note") == 1
    assert any("from b.json" in n and "commit def" in n for n in res.notes)
    md = (out / "policy.md").read_text()
    assert "NVIDIA H200" in md and "commit abc" in md and "verdict:" in md
    assert json.loads((out / "policy.json").read_text())["name"] == "policy"
    # the worst point, when it is below the bar
    c = _policy_json(tmp_path / "c.json", ["B=32 S=8192"],
                     lambda c, p: 0.9 if p == 0.2 else 1.0)
    res = bp.merge([str(a), str(c)], out, make_plot=False)
    assert "worst 0.900 at B=32 S=8192 p=0.2" in res.notes[-2]
    assert "at 16 of 18 points" in res.notes[-2]


def test_bench_policy_merge_refuses_other_files(tmp_path):
    from dflash_ops.bench import policy as bp
    other = tmp_path / "e2e.json"
    other.write_text(json.dumps({"name": "e2e", "rows": []}))
    with pytest.raises(ValueError, match="e2e.json is not a policy suite's JSON"):
        bp.merge([str(other)])
    with pytest.raises(ValueError, match="cannot read"):
        bp.merge([str(tmp_path / "missing.json")])
    assert bp.main(["merge", str(other)]) == 2


def test_bench_policy_merge_plots_a_panel_grid(tmp_path):
    pytest.importorskip("matplotlib")
    from dflash_ops.bench import policy as bp
    a = _policy_json(tmp_path / "a.json", [f"B={b} S=1024" for b in (1, 8, 32, 64)],
                     lambda c, p: 1.0)
    assert bp.main(["merge", str(a), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "policy.png").stat().st_size > 10_000


def test_bench_policy_verdict_names_the_missing_p_of_a_case():
    from dflash_ops.bench import policy as bp
    rows = [{"table": bp.SUMMARY, "case": "B=1 S=1024", "p": p, bp.RATIO: 1.0}
            for p in bp.P_GRID[:-1]]
    v = bp.verdict(rows, [(1, 1024), (8, 1024)])
    assert v[1] == (f"verdict: {len(bp.P_GRID) + 1} of {2 * len(bp.P_GRID)} grid points not "
                    f"measured: B=1 S=1024 p={bp.P_GRID[-1]}, B=8 S=1024")


def test_fast_prefill_runs_the_last_tokens_and_keeps_the_tokens():
    """bench.policy.fast_prefill: a prefill (logit_rows given) runs only each prompt's last
    token at its position (T = requests), its logits' argmax is the real prefill's (the counter
    target's successor), taps are zeros but for the last rows; steps (no logit_rows) pass
    through; the method is restored after the block, and plain greedy decoding under it gives
    the real prefill's tokens."""
    from dflash_ops.bench.policy import fast_prefill
    target = _counter_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 900, (n,), generator=g).tolist() for n in (37, 5, 70)]
    want = plain_greedy(target, prompts, 12)
    seen = []
    inner = type(target).forward

    def spy(self, ids, *a, **k):
        seen.append(ids.numel())
        return inner(self, ids, *a, **k)

    type(target).forward = spy
    try:
        with fast_prefill(target):
            got = plain_greedy(target, prompts, 12)
            for r, p in enumerate(prompts):
                target.add_request(r, len(p) + 2)
            try:
                flat = torch.tensor([t for p in prompts for t in p])
                lens = torch.tensor([len(p) for p in prompts])
                logits, taps = target.forward(flat, torch.arange(3), torch.zeros(3, dtype=torch.long),
                                              lens, [0, 2], logit_rows=torch.cumsum(lens, 0) - 1)
            finally:
                for r in range(3):
                    target.free_request(r)
    finally:
        type(target).forward = inner
    assert got == want
    assert seen[0] == 3 and seen[-1] == 3  # the prefills ran one token a request
    assert all(n == 3 for n in seen[1:])  # plain greedy's steps: one token a request, untouched
    assert logits.shape[0] == 3 and logits.argmax(-1).tolist() == [(p[-1] + 1) % 900 for p in prompts]
    last = (torch.cumsum(lens, 0) - 1).tolist()
    assert taps.shape[0] == flat.numel() and taps[last].abs().sum(-1).min() > 0
    others = [i for i in range(flat.numel()) if i not in last]
    assert taps[others].abs().sum() == 0
    assert "forward" not in vars(target)


def test_fast_prefill_in_the_loop_keeps_the_tokens():
    """speculative_generate under bench.policy.fast_prefill (the drafter's context from zero
    taps but for the last rows) on a counter target commits the real prefill's tokens."""
    from dflash_ops.bench.policy import counter_target, fast_prefill
    tc, ts, dc, ds = counter_pair(**SMALL)
    if "lm_head.weight" not in ts:
        ts["lm_head.weight"] = ts["model.embed_tokens.weight"].clone()
        tc["tie_word_embeddings"] = False
    counter_target(ts, successor_of=60)
    cache = dict(dtype=torch.float32, device="cpu", max_requests=4, max_len=320,
                 num_blocks=80)
    target = Target(TargetConfig.from_hf(tc), ts, block_size=16, **cache)
    drafter = DFlashDrafter(DFlashConfig.from_dict(dc), ds, embed_tokens=target.embed,
                            lm_head=target.lm_head, cache_block_size=16, **cache)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (90, 41, 150)]
    want = [[(p[-1] + 1 + i) % 60 for i in range(40)] for p in prompts]
    assert plain_greedy(target, prompts, 40) == want
    with fast_prefill(target):
        out, st = speculative_generate(target, drafter, prompts, 40, policy=False)
    assert out == want and st.seconds["prefill"] > 0
    assert "forward" not in vars(target)


def _shared_cache(share=2, shared_len=40, slots=5, num_blocks=40, max_len=64, shared_slots=None):
    from dflash_ops.bench.e2e import SharedContextCache
    return SharedContextCache(1, num_blocks, 16, 1, 4, slots, max_len, torch.float32, "cpu",
                              share=share, shared_len=shared_len, shared_slots=shared_slots)


def test_shared_context_cache_tables_and_blocks():
    """bench.e2e.SharedContextCache: slots r and r + groups (of the first shared_slots) share
    the blocks of the first shared_len // 16 positions, member k reading them rotated by
    k * 5/16 (at least k); positions past them, and the slots past shared_slots (the steps'
    scratch), take blocks of their own; no block is shared and owned, or in two places;
    blocks_needed predicts what add_request takes; freeing every slot returns every block
    (a group's shared blocks with its last member)."""
    c = _shared_cache(share=2, shared_len=100, slots=6, num_blocks=60, max_len=160,
                      shared_slots=5)
    assert (c.shared, c.groups, c.max_blocks) == (6, 3, 10)
    assert [c.rotation(r) for r in range(5)] == [0, 0, 0, 1, 1]  # max(6 * 5 // 16, 1) = 1
    lens = [160, 100, 33, 160, 20, 40]
    # three groups' 6 shared blocks + own blocks past them (10 - 6, 7 - 6, 0, 10 - 6, 0) +
    # the scratch's 3 of its own
    assert c.blocks_needed(lens) == 3 * 6 + 4 + 1 + 0 + 4 + 0 + 3
    free0 = c.free_blocks()
    for r, n in enumerate(lens):
        c.add_request(r, n)
    assert free0 - c.free_blocks() == 30
    t = c.block_table.tolist()
    head = lambda r, n: t[r][:min(-(-n // 16), 6)]  # noqa: E731
    pools = [c._pool[g] for g in range(3)]
    pooled = [b for p in pools for b in p]
    assert len(set(pooled)) == len(pooled) == 18
    assert head(0, 160) == pools[0] and head(1, 100) == pools[1]  # member 0: unrotated
    assert head(2, 33) == pools[2][:3]
    assert head(3, 160) == pools[0][1:] + pools[0][:1]  # member 1 of group 0: rotated by one
    assert head(4, 20) == pools[1][1:3]
    own = [b for r in range(6) for b in c._owned[r]]
    assert len(set(own)) == len(own) == 12 and not set(own) & set(pooled)
    assert t[0][6:] == c._owned[0] and t[3][6:] == c._owned[3] and t[1][6:7] == c._owned[1]
    assert t[5][:3] == c._owned[5] and len(c._owned[5]) == 3  # the scratch: its own only
    assert all(b == c.num_blocks for b in t[2][3:])  # past its blocks: the table's sentinel
    slots = c.slots(torch.tensor([3, 3]), torch.tensor([0, 17]))  # the mapping follows
    assert slots.tolist() == [t[3][0] * 16, t[3][1] * 16 + 1]
    with pytest.raises(ValueError, match="SharedContextCache.add_request: request slot 3 is in use"):
        c.add_request(3, 16)
    c.free_request(0)
    assert 0 in c._pool  # slot 3 still holds group 0's blocks
    c.free_request(3)
    assert 0 not in c._pool
    for r in (1, 2, 4, 5):
        c.free_request(r)
    assert c.free_blocks() == free0 and not c._pool and not c._members
    assert (c.block_table == c.num_blocks).all()
    c.add_request(3, 160)  # re-added first: its group's blocks again, rotated as before
    assert c.block_table[3, :6].tolist() == c._pool[0][1:] + c._pool[0][:1]


def test_shared_context_cache_sizes_and_errors():
    from dflash_ops.bench.e2e import SharedContextCache
    # 5 slots of 160 positions, 100 shared in pairs: 3 groups x 6 + 5 x 4 own (+ 40 positions
    # of a scratch: 3 blocks)
    assert SharedContextCache.num_blocks_for(5, 160, 16, 2, 100) == 38
    assert SharedContextCache.num_blocks_for(5, 160, 16, 2, 100, extra_len=40) == 41
    assert SharedContextCache.num_blocks_for(5, 160, 16, 1, 100) == 50  # PagedKVCache's
    c = _shared_cache(share=2, shared_len=100, slots=5, num_blocks=18, max_len=160)
    c.add_request(0, 160)  # 6 shared + 4 own: 8 left
    with pytest.raises(RuntimeError, match="10 blocks needed, 8 free"):
        c.add_request(1, 160)  # group 1's 6 + its own 4
    assert c._owned.keys() == {0} and c._members == {0: {0}} and c.free_blocks() == 8
    c.add_request(3, 160)  # group 0's blocks are there: its own 4 only
    assert c.free_blocks() == 4
    for kw, msg in ((dict(share=0), "share must be >= 1, got 0"),
                    (dict(shared_len=-1), "shared_len must be >= 0, got -1"),
                    (dict(shared_slots=6), r"shared_slots must be in \[0, 5\] \(max_requests\), "
                                           "got 6")):
        with pytest.raises(ValueError, match=msg):
            _shared_cache(**kw)


def test_shared_context_cache_in_the_loop_keeps_the_tokens():
    """speculative_generate (static steps with their scratch slot, policy on and off) and
    plain_greedy under fast_prefill, on a counter target and drafter whose caches share the
    prompts' blocks in pairs as bench.policy's cases that do not fit (the scratch with blocks
    of its own), run where caches of their own would not fit (the loop's block check counts
    the shared blocks once), commit the tokens of a real prefill and give every block back."""
    from dflash_ops.bench.e2e import SharedContextCache
    from dflash_ops.bench.policy import counter_target, fast_prefill
    from dflash_ops.models.cache import PagedKVCache
    tc, ts, dc, ds = counter_pair(**SMALL)
    if "lm_head.weight" not in ts:
        ts["lm_head.weight"] = ts["model.embed_tokens.weight"].clone()
        tc["tie_word_embeddings"] = False
    counter_target(ts, successor_of=60)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 60, (160,), generator=g).tolist() for _ in range(4)]
    want = [[(p[-1] + 1 + i) % 60 for i in range(40)] for p in prompts]
    max_len = 160 + 40 + 2 * 16 + 8
    blocks = SharedContextCache.num_blocks_for(4, max_len, 16, 2, 160, extra_len=32)
    cache = dict(dtype=torch.float32, device="cpu", max_requests=5, max_len=max_len,
                 num_blocks=blocks)
    target = Target(TargetConfig.from_hf(tc), ts, block_size=16, **cache)
    drafter = DFlashDrafter(DFlashConfig.from_dict(dc), ds, embed_tokens=target.embed,
                            lm_head=target.lm_head, cache_block_size=16, **cache)
    for m in (target, drafter):
        c = m.cache
        m.cache = SharedContextCache(len(c.k), blocks, 16, c.k[0].shape[2], c.k[0].shape[3],
                                     5, max_len, torch.float32, "cpu", share=2,
                                     shared_len=160, shared_slots=4)
    # blocks of their own for the loop's 4 requests would not fit
    cap = 160 + 40 + drafter.cfg.block_size + 1
    assert PagedKVCache.blocks_needed(target.cache, [cap] * 4) > blocks
    assert target.cache.blocks_needed([cap] * 4) <= blocks
    seen = []
    add = SharedContextCache.add_request

    def spy(self, r, max_len=None):
        add(self, r, max_len)
        seen.append((r, self.block_table[r, 0].item()))

    SharedContextCache.add_request = spy
    try:
        with fast_prefill(target):
            assert plain_greedy(target, prompts, 40) == want
            for policy in (False, True):
                out, st = speculative_generate(target, drafter, prompts, 40, policy=policy,
                                               steps="static")
                assert out == want
    finally:
        SharedContextCache.add_request = add
    assert 4 in {r for r, _ in seen}  # the steps' scratch slot was taken (and given back)
    for m in (target, drafter):
        assert m.cache.free_blocks() == blocks and not m.cache._pool


def test_bench_policy_choose_share():
    """bench.policy.choose_share on B 32 x 32k's caches (case_cache, the bench's Qwen3-8B
    target and drafter): pairs on an H200 (~120 GB free beside the weights), fours on an 80 GB
    H100 (~60 GB free), blocks of their own where they fit, 0 where even fours do not, a
    forced share only if it fits."""
    from dflash_ops.bench import policy as bp
    from dflash_ops.bench.e2e import KV_BLOCK, qwen3_8b_dflash_config, qwen3_8b_target_config
    cfgs = (qwen3_8b_target_config(), qwen3_8b_dflash_config())

    def need(k):
        blocks = bp.case_cache(32, 32768, share=k)[1]
        return sum(2 * c.num_layers * blocks * KV_BLOCK * c.num_kv_heads * c.head_dim * 2
                   for c in cfgs)

    gb = 10 ** 9
    assert [round(need(k) / gb) for k in (1, 2, 4)] == [177, 89, 45]
    assert bp.choose_share(need, 120 * gb) == 2
    assert bp.choose_share(need, 60 * gb) == 4
    assert bp.choose_share(need, 200 * gb) == 1
    assert bp.choose_share(need, 40 * gb) == 0
    assert bp.choose_share(need, 120 * gb, forced=3) == 3
    assert bp.choose_share(need, 60 * gb, forced=2) == 0
    assert bp.choose_share(need, need(2) + bp.HEADROOM) == 2
    assert bp.choose_share(need, need(2) + bp.HEADROOM - 1) == 3
