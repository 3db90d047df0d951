"""The drafter's context window (``DFlashDrafter.set_context_window``, ``window_table``), on CPU.

- ``window_table`` + ``block_attention`` equals dense attention over exactly the kept keys (the
  first pages and the last ones), for requests short enough to keep everything, ones cut, page
  sizes 4 / 16, keep counts on and off page boundaries;
- a window wide enough for every request changes nothing (bit for bit), one that cuts changes
  the drafts (the control: it can fail);
- the loop stays lossless with a window (output equal to plain greedy), which only moves
  acceptance; bad arguments are refused with the argument named.
"""
from __future__ import annotations

import math

import pytest
import torch

from dflash_ops.models.drafter import window_table
from dflash_ops.speculator import plain_greedy, speculative_generate
from tests.test_speculator import _pair, _prompts


def _dense(q, kc, vc, table, seq, keep, scale):
    """Per request: softmax over the keys j < seq[b] with keep(b, j), non-causal, GQA."""
    r, qlen = len(seq), q.shape[0] // len(seq)
    hq, hkv = q.shape[1], kc.shape[2]
    bs = kc.shape[1]
    out = torch.zeros_like(q, dtype=torch.float64)
    for b in range(r):
        js = [j for j in range(int(seq[b])) if keep(b, j)]
        k = torch.stack([kc[table[b, j // bs], j % bs] for j in js]).double()  # [n, hkv, d]
        v = torch.stack([vc[table[b, j // bs], j % bs] for j in js]).double()
        for h in range(hq):
            qq = q[b * qlen:(b + 1) * qlen, h].double()
            s = qq @ k[:, h // (hq // hkv)].T * scale
            out[b * qlen:(b + 1) * qlen, h] = torch.softmax(s, -1) @ v[:, h // (hq // hkv)]
    return out


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("first,last", [(1, 8), (16, 37), (0, 64)])
def test_window_table_keeps_exactly_the_first_and_last_keys(bs, first, last):
    import dflash_ops
    torch.manual_seed(bs + first + last)
    seq = torch.tensor([5, 40, 97, 300, 301], dtype=torch.int32)
    qlen, hkv, hq, d = 4, 2, 4, 16
    m = -(-int(seq.max()) // bs) + 1
    nb = len(seq) * m
    table = torch.randperm(nb).view(len(seq), m).to(torch.int32)
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    q = torch.randn(len(seq) * qlen, hq, d)
    qsl = torch.arange(len(seq) + 1, dtype=torch.int32) * qlen
    wt, wseq = window_table(table, seq, bs, first, last)
    f = -(-first // bs)

    def keep(b, j):  # the first f pages, and the pages from the one holding seq - last on
        t0 = max(f, (int(seq[b]) - last) // bs)
        return j < f * bs or j >= t0 * bs

    scale = 1 / math.sqrt(d)
    got = dflash_ops.block_attention(q, kc, vc, wt, wseq, qsl, scale)
    want = _dense(q, kc, vc, table, seq, keep, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for b in range(len(seq)):  # at least `last` keys at the end, and the first `first`
        kept = [j for j in range(int(seq[b])) if keep(b, j)]
        assert set(range(max(0, int(seq[b]) - last), int(seq[b]))) <= set(kept)
        assert set(range(min(first, int(seq[b])))) <= set(kept)
        assert int(wseq[b]) == len(kept)


@pytest.mark.parametrize("steps", ["direct", "static"])
def test_loop_stays_lossless_with_a_window(steps):
    target, drafter = _pair(block_size=4, max_requests=3)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 96, (60,)).tolist(), torch.randint(0, 96, (45,)).tolist()]
    want = plain_greedy(target, prompts, 24)
    accepted = {}
    for name, window in (("off", None), ("wide", 200), ("cut", 8)):
        drafter.set_context_window(window, first=4)
        got, stats = speculative_generate(target, drafter, prompts, 24, policy=False,
                                          steps=steps)
        assert got == want, f"window {name}: output differs from plain greedy (must be lossless)"
        accepted[name] = stats.acceptance
    drafter.set_context_window(None)
    assert accepted["wide"] == accepted["off"]  # the same drafts, the same commits


def test_window_moves_the_drafts_of_long_contexts():
    """The control: a window that cuts must change some draft's logits on long contexts."""
    target, drafter = _pair(block_size=4, max_requests=3)
    prompts = [torch.randint(0, 96, (90,)).tolist(), torch.randint(0, 96, (70,)).tolist()]
    zs = {}
    for name, window in (("off", None), ("wide", 200), ("cut", 8)):
        drafter.set_context_window(window, first=4)
        seen = []
        orig = drafter.propose

        def spy(*a, **k):
            out = orig(*a, **k)
            seen.append(out[0].clone())
            return out
        drafter.propose = spy
        try:
            speculative_generate(target, drafter, prompts, 12, policy=False, steps="direct")
        finally:
            drafter.propose = orig
        zs[name] = torch.cat([s.flatten() for s in seen])
    drafter.set_context_window(None)
    assert torch.equal(zs["off"], zs["wide"])
    assert not torch.equal(zs["off"][:len(zs["cut"])], zs["cut"][:len(zs["off"])])


def test_window_arguments_are_checked():
    _, drafter = _pair(block_size=4)
    with pytest.raises(ValueError, match=r"last must be >= the block size 4.*last=3"):
        drafter.set_context_window(3)
    with pytest.raises(ValueError, match=r"first >= 0.*first=-1"):
        drafter.set_context_window(8, first=-1)
    drafter.set_context_window(8, first=0)
    assert drafter.context_window == (0, 8)
