"""Bad calls of ``speculative_generate`` and ``plain_greedy`` (CPU, tiny random models).

Each bad call raises a ValueError naming the argument (what was expected, what was given) before
anything is allocated: afterwards both caches hold no request, and a normal call on the same
model pair decodes as before.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from dflash_ops.models.drafter import DFlashDrafter, random_drafter_state
from dflash_ops.speculator import plain_greedy, speculative_generate
from dflash_ops.speculator.step import Iteration

from .test_speculator import MASK, VOCAB, _pair

PROMPTS = [[1, 2, 3], [4, 5]]


def _spec(target, drafter, prompts, n, **kw):
    return speculative_generate(target, drafter, prompts, n, steps="direct", **kw)[0]


def _plain(target, drafter, prompts, n, **kw):
    return plain_greedy(target, prompts, n, **kw)


BOTH = pytest.mark.parametrize("fn", [_spec, _plain], ids=["speculative", "plain"])


def _still_works(target, drafter):
    """Nothing left allocated, and the pair still decodes (slot 0 is free again)."""
    assert not target.cache._owned and not drafter.cache._owned
    want = plain_greedy(target, PROMPTS, 5)
    got, _ = speculative_generate(target, drafter, PROMPTS, 5, steps="direct")
    assert got == want and all(len(o) == 5 for o in got)
    assert not target.cache._owned and not drafter.cache._owned


@BOTH
def test_empty_prompt_rejected(fn):
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        fn(target, drafter, [[1, 2], [], [3]], 4)
    _still_works(target, drafter)


@BOTH
@pytest.mark.parametrize("n", [0, -1])
def test_max_new_tokens_below_one_rejected(fn, n):
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 1, got {n}"):
        fn(target, drafter, PROMPTS, n)
    _still_works(target, drafter)


@pytest.mark.parametrize("b", [0, 1, -3])
def test_block_size_below_two_rejected(b):
    """Only block_size=None means the config's block size."""
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=rf"block_size must be >= 2 \(or None\), got {b}"):
        speculative_generate(target, drafter, PROMPTS, 5, block_size=b)
    _still_works(target, drafter)


def test_block_size_none_is_the_configs():
    target, drafter = _pair(4)
    _, stats = speculative_generate(target, drafter, PROMPTS, 9, block_size=None)
    assert max(stats.acceptance) <= 4  # at most a block of the config's size an iteration


@BOTH
def test_no_prompts_rejected(fn):
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=r"prompts: expected at least one prompt, got 0"):
        fn(target, drafter, [], 4)
    _still_works(target, drafter)


@BOTH
def test_more_prompts_than_request_slots_rejected(fn):
    target, drafter = _pair(4, max_requests=2)
    with pytest.raises(ValueError, match=r"prompts: 3 prompts, but the target cache has 2 "
                                         r"request slots"):
        fn(target, drafter, [[1], [2], [3]], 4)
    _still_works(target, drafter)


@BOTH
def test_prompt_longer_than_the_cache_allows_rejected(fn):
    """The second prompt does not fit (max_len 128): the first is never allocated."""
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: 125 tokens \+ max_new_tokens=4 .* "
                                         r"positions in the target cache, which allows 128"):
        fn(target, drafter, [[1, 2], [7] * 125], 4)
    _still_works(target, drafter)


@BOTH
def test_prompts_needing_more_blocks_than_free_rejected(fn):
    target, drafter = _pair(4, num_blocks=16)
    with pytest.raises(ValueError, match=r"prompts: they need \d+ blocks of the target cache, "
                                         r"16 are free"):
        fn(target, drafter, [[3] * 40, [4] * 40], 4)
    _still_works(target, drafter)


@BOTH
def test_request_slot_in_use_rejected(fn):
    target, drafter = _pair(4)
    target.add_request(1, 8)
    with pytest.raises(ValueError, match=r"request slots \[1\] of the target cache are in use"):
        fn(target, drafter, [[1], [2]], 4)
    assert list(target.cache._owned) == [1] and not drafter.cache._owned
    target.free_request(1)
    _still_works(target, drafter)


@BOTH
@pytest.mark.parametrize("tok", [VOCAB, VOCAB + 5, -1])
def test_out_of_vocabulary_token_rejected(fn, tok):
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=rf"prompts\[1\] has token {tok} outside the "
                                         rf"vocabulary \[0, {VOCAB}\)"):
        fn(target, drafter, [[1, 2], [3, tok, 4]], 4)
    _still_works(target, drafter)


@BOTH
@pytest.mark.parametrize("prompt, got", [
    ([3, 1.7, 4], "1.7"), (torch.tensor([3.0, 4.0]), "a float32 tensor"), ([3, True], "True"),
    ([3, None], "None")])
def test_token_ids_that_are_not_integers_rejected(fn, prompt, got):
    """Floats passed the range check and were truncated by the long tensor the prefill built."""
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=rf"prompts\[1\]: token ids must be integers, got "
                                         rf"{re.escape(got)}"):
        fn(target, drafter, [[1, 2], prompt], 4)
    _still_works(target, drafter)


@BOTH
@pytest.mark.parametrize("stop, got", [([None], "None"), ([2.5], "2.5"),
                                       (torch.tensor([1.0]), "1.0")])
def test_stop_ids_that_are_not_integers_rejected(fn, stop, got):
    target, drafter = _pair(4)
    with pytest.raises(ValueError, match=rf"stop_token_ids: token ids must be integers, got "
                                         rf"{re.escape(got)}"):
        fn(target, drafter, PROMPTS, 4, stop_token_ids=stop)
    _still_works(target, drafter)


@pytest.mark.parametrize("kind", ["tensor", "numpy", "set"])
def test_stop_ids_as_a_tensor_stop_like_a_list(kind):
    """A tensor of stop ids built a set of 0-d tensors (hashed by identity): the host checks
    never matched, so plain greedy ignored the stop and the speculative loop stopped on the
    device's copy only. Every container now stops where the list does, in both."""
    import numpy as np
    target, drafter = _pair(4)
    free = plain_greedy(target, PROMPTS, 8)
    for stop_at in (free[0][0], free[0][3]):  # the first generated token, and a later one
        want = plain_greedy(target, PROMPTS, 8, stop_token_ids=[stop_at])
        stop = {"tensor": torch.tensor([stop_at]), "numpy": np.array([stop_at]),
                "set": {stop_at}}[kind]
        assert plain_greedy(target, PROMPTS, 8, stop_token_ids=stop) == want
        assert _spec(target, drafter, PROMPTS, 8, stop_token_ids=stop) == want
        assert want[0][-1] == stop_at and len(want[0]) <= 4  # the stop ended request 0
    _still_works(target, drafter)


def _drafter_like(drafter, target, **cfg_changes):
    """A drafter of another config, reading the target's embedding and LM head."""
    cfg = dataclasses.replace(drafter.cfg, **cfg_changes)
    return DFlashDrafter(cfg, random_drafter_state(cfg, 1), embed_tokens=target.embed,
                         lm_head=target.lm_head, dtype=torch.float32, num_blocks=64,
                         cache_block_size=4, max_requests=5, max_len=128)


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size=VOCAB + 3), rf"vocabulary: the target's is {VOCAB}, the drafter's "
                                 rf"{VOCAB + 3}"),
    (dict(target_hidden_size=32), r"tap hidden states: the drafter reads 2 x 32 = 64 "
                                  r"\(n_taps x target_hidden_size\), the target gives 2 x 64 "
                                  r"= 128"),
    (dict(hidden_size=32, num_heads=2, num_kv_heads=1, target_hidden_size=64),
     r"embedding: the drafter's is \[97, 64\], its hidden_size 32"),
])
def test_target_drafter_mismatch_rejected(change, message):
    target, good = _pair(4)
    bad = _drafter_like(good, target, **change)
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, bad, PROMPTS, 5, steps="direct")
    with pytest.raises(ValueError, match=message):  # the iteration combines them too
        Iteration(target, bad, 4)
    assert not target.cache._owned and not bad.cache._owned
    _still_works(target, good)


def test_tap_layers_outside_the_target_rejected():
    target, good = _pair(4)
    bad = _drafter_like(good, target, target_layer_ids=[1, 4])
    with pytest.raises(ValueError, match=r"target_layer_ids: the drafter taps \[1, 4\], the "
                                         r"target has layers 0..3"):
        speculative_generate(target, bad, PROMPTS, 5, steps="direct")
    _still_works(target, good)


def test_max_new_tokens_one_still_gives_one_token():
    target, drafter = _pair(4)
    want = plain_greedy(target, PROMPTS, 1)
    got, stats = speculative_generate(target, drafter, PROMPTS, 1)
    assert got == want and [len(o) for o in got] == [1, 1] and stats.iterations == 0


def test_mask_token_prompt_is_in_the_vocabulary():
    """The mask token is a valid prompt token (it is < the vocabulary size)."""
    target, drafter = _pair(4)
    got, _ = speculative_generate(target, drafter, [[MASK, 1]], 4, steps="direct")
    assert got == plain_greedy(target, [[MASK, 1]], 4)
