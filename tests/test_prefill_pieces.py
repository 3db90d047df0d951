"""The loop's prefill in forwards of at most PREFILL_TOKENS tokens (speculator.loop._prefill):
the split itself, and that a prefill in pieces leaves the same logits, target K/V and drafter
context as one forward of every prompt, and the same tokens (fp32, CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from dflash_ops.speculator import loop, plain_greedy, speculative_generate
from tests.test_speculator import _pair, _prompts


@pytest.mark.parametrize("seed", range(40))
def test_pieces_cover_every_prompt_in_order(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
    cap = rng.randint(1, 50)
    fwds = loop._prefill_pieces(lens, cap)
    sizes = [sum(q for _, _, q in f) for f in fwds]
    assert all(1 <= n <= cap for n in sizes)
    assert all(n == cap for n in sizes[:-1])  # packed: only the last forward is short
    for f in fwds:  # a request at most once a forward
        assert len({r for r, _, _ in f}) == len(f)
    flat = [p for f in fwds for p in f]
    assert [r for r, _, _ in flat] == sorted(r for r, _, _ in flat)  # request order
    for r, n in enumerate(lens):  # each prompt's pieces tile [0, n) in order
        mine = [(s, q) for rr, s, q in flat if rr == r]
        assert mine[0][0] == 0 and all(q >= 1 for _, q in mine)
        assert all(a[0] + a[1] == b[0] for a, b in zip(mine, mine[1:]))
        assert mine[-1][0] + mine[-1][1] == n


def test_pieces_examples():
    assert loop._prefill_pieces([3, 10, 2], 5) == [
        [(0, 0, 3), (1, 0, 2)], [(1, 2, 5)], [(1, 7, 3), (2, 0, 2)]]
    assert loop._prefill_pieces([4], 4) == [[(0, 0, 4)]]
    assert loop._prefill_pieces([2, 2], 100) == [[(0, 0, 2), (1, 0, 2)]]


@pytest.mark.parametrize("cap", [0, -3])
def test_no_tokens_a_forward_is_an_error_naming_the_setting(cap, monkeypatch):
    target, drafter = _pair(4, seed=1)
    monkeypatch.setattr(loop, "PREFILL_TOKENS", cap)
    with pytest.raises(ValueError, match=rf"PREFILL_TOKENS: expected >= 1, got {cap}"):
        plain_greedy(target, _prompts(2, seed=2), 3)
    assert not target.cache._owned  # the requests given back


def _state(target, drafter, prompts, cap, monkeypatch):
    """Logits of the last tokens and both caches' rows of the prompts after ``_prefill`` with
    PREFILL_TOKENS = cap (the requests freed after)."""
    monkeypatch.setattr(loop, "PREFILL_TOKENS", cap)
    for r, p in enumerate(prompts):
        target.add_request(r, len(p) + 4)
        drafter.cache.add_request(r, len(p) + 4)
    try:
        logits = loop._prefill(target, prompts, drafter.cfg.target_layer_ids,
                               context=drafter.add_context)
        rows = []
        for c in (target.cache, drafter.cache):
            for r, p in enumerate(prompts):
                slots = c.slots(torch.full((len(p),), r), torch.arange(len(p)))
                rows.append(torch.stack([torch.stack([k.flatten(0, 1)[slots] for k in c.k]),
                                         torch.stack([v.flatten(0, 1)[slots] for v in c.v])]))
        return logits, rows
    finally:
        for r in range(len(prompts)):
            target.free_request(r)
            drafter.cache.free_request(r)


@pytest.mark.parametrize("cap", [1, 3, 7, 16])
def test_prefill_in_pieces_equals_one_forward(cap, monkeypatch):
    target, drafter = _pair(4, seed=3)
    prompts = _prompts(4, seed=5)
    assert max(len(p) for p in prompts) > 3 and sum(len(p) for p in prompts) > 16
    want_logits, want_rows = _state(target, drafter, prompts, 10 ** 6, monkeypatch)
    got_logits, got_rows = _state(target, drafter, prompts, cap, monkeypatch)
    assert got_logits.shape == (len(prompts), target.cfg.vocab_size)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_rows, want_rows):
        assert w.abs().sum() > 0  # the rows were written
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", ["direct", "static"])
def test_loop_with_small_prefill_forwards_equals_plain_greedy(steps, monkeypatch):
    target, drafter = _pair(4, seed=7)
    prompts = _prompts(3, seed=8)
    want = plain_greedy(target, prompts, 12)
    monkeypatch.setattr(loop, "PREFILL_TOKENS", 4)
    assert plain_greedy(target, prompts, 12) == want
    got, _ = speculative_generate(target, drafter, prompts, 12, steps=steps)
    assert got == want
