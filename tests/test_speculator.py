"""The greedy draft-and-verify loop on CPU with tiny random models (torch backend, fp32).

Speculative output equals plain greedy decoding token for token (many prompts, batch 1..4 with
ragged lengths, block sizes 2/4/8, stop tokens and max_new_tokens landing mid-block); oracle
drafters pin the acceptance: one that proposes the target's own continuation commits B tokens an
iteration, one always wrong commits 1, one wrong at a known offset k commits k + 1.
"""
from __future__ import annotations

import re

import pytest
import torch

from dflash_ops.models.config import DFlashConfig
from dflash_ops.models.drafter import DFlashDrafter, random_drafter_state
from dflash_ops.models.target import Target, TargetConfig
from dflash_ops.speculator import plain_greedy, speculative_generate

VOCAB, MASK, H = 97, 96, 64


def _pair(block_size=4, seed=0, max_requests=5, device="cpu", num_blocks=64):
    tcfg = TargetConfig(hidden_size=H, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=VOCAB, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=512,
                        tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                        source="<test>")
    target = Target.random(tcfg, seed=seed, dtype=torch.float32, num_blocks=num_blocks,
                           block_size=4,
                           max_requests=max_requests, max_len=128, device=device)
    dcfg = DFlashConfig(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=VOCAB, mask_token_id=MASK,
                        target_layer_ids=[1, 2], block_size=block_size,
                        max_position_embeddings=512, source="<test>")
    drafter = DFlashDrafter(dcfg, random_drafter_state(dcfg, seed + 1),
                            embed_tokens=target.embed, lm_head=target.lm_head,
                            dtype=torch.float32, num_blocks=num_blocks, cache_block_size=4,
                            max_requests=max_requests, max_len=128, device=device)
    return target, drafter


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (int(torch.randint(1, 12, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("steps", ["direct", "static"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_equals_plain_greedy(block_size, batch, steps):
    target, drafter = _pair(block_size, seed=block_size)
    prompts = _prompts(batch, seed=batch * 10 + block_size)
    want = plain_greedy(target, prompts, 13)
    free_t, free_d = len(target.cache._free), len(drafter.cache._free)
    got, stats = speculative_generate(target, drafter, prompts, 13, steps=steps)
    assert got == want
    assert all(len(o) == 13 for o in got)
    assert stats.committed == 13 * batch and stats.steps == steps
    # every slot given back (the requests' and the steps' scratch slot)
    assert (len(target.cache._free), len(drafter.cache._free)) == (free_t, free_d)
    assert not target.cache._owned and not drafter.cache._owned


@pytest.mark.parametrize("steps", ["direct", "static"])
def test_batch_of_eight_ragged_block_16(steps):
    """Eight ragged prompts, block 16: the static steps pad 8 -> bucket 8, then smaller buckets
    as requests finish at different times (stop token + max_new_tokens)."""
    target, drafter = _pair(16, seed=21, max_requests=9, num_blocks=160)
    prompts = _prompts(8, seed=22)
    free = plain_greedy(target, prompts, 30)
    stop = [free[1][4], free[5][12]]
    want = plain_greedy(target, prompts, 30, stop)
    got, stats = speculative_generate(target, drafter, prompts, 30, stop, steps=steps)
    assert got == want
    assert len({len(o) for o in got}) > 1  # requests finished at different iterations
    assert not target.cache._owned and not drafter.cache._owned


def test_untimed_loop_gives_the_same_tokens():
    target, drafter = _pair(4, seed=4)
    prompts = _prompts(3, seed=6)
    want = plain_greedy(target, prompts, 11)
    got, stats = speculative_generate(target, drafter, prompts, 11, time_stages=False)
    assert got == want and stats.seconds["draft"] >= 0


@pytest.mark.parametrize("steps", ["direct", "static"])
def test_stop_tokens_mid_block(steps):
    target, drafter = _pair(4, seed=3)
    prompts = _prompts(4, seed=5)
    free = plain_greedy(target, prompts, 20)
    stop = [free[0][6], free[2][3]]  # tokens the plain decode emits mid-way
    want = plain_greedy(target, prompts, 20, stop)
    got, _ = speculative_generate(target, drafter, prompts, 20, stop, steps=steps)
    assert got == want
    for o in got:
        assert len(o) == 20 or o[-1] in stop
        assert not any(t in stop for t in o[:-1])


def test_steps_need_a_spare_request_slot():
    target, drafter = _pair(4, seed=1, max_requests=2)
    prompts = _prompts(2, seed=2)
    with pytest.raises(ValueError, match=r"spare request slot \(2, past the batch of 2\)"):
        speculative_generate(target, drafter, prompts, 5, steps="static")
    # nothing left allocated: the same pair still decodes directly
    assert not target.cache._owned and not drafter.cache._owned
    got, _ = speculative_generate(target, drafter, prompts, 5, steps="direct")
    assert got == plain_greedy(target, prompts, 5)


def test_auto_steps_on_cpu_are_direct():
    target, drafter = _pair(4, seed=1)
    prompts = _prompts(2, seed=2)
    got, stats = speculative_generate(target, drafter, prompts, 5)
    assert stats.steps == "direct" and got == plain_greedy(target, prompts, 5)


def test_auto_steps_fall_back_to_direct_without_room(monkeypatch):
    """Where graphs are available, "auto" picks them only with a spare request slot, and falls
    back to direct calls (leaking no slot) when the spare slot finds no free blocks."""
    from dflash_ops.speculator import loop

    calls = []

    class Refuse:  # stands in for the step classes: the spare slot's blocks are not there
        def __init__(self, *a, **k):
            calls.append(k)
            raise RuntimeError("PagedKVCache.add_request: 1 blocks needed, 0 free")

    monkeypatch.setattr(loop, "_graphs_available", lambda dev: True)
    monkeypatch.setattr(loop, "DraftStep", Refuse)
    prompts = _prompts(2, seed=2)
    # no spare slot (max_requests == batch): direct, the steps never constructed
    target, drafter = _pair(4, seed=1, max_requests=2)
    got, stats = speculative_generate(target, drafter, prompts, 5)
    assert stats.steps == "direct" and not calls and got == plain_greedy(target, prompts, 5)
    # a spare slot, but its step cannot take it: direct, nothing left allocated
    target, drafter = _pair(4, seed=1, max_requests=3)
    got, stats = speculative_generate(target, drafter, prompts, 5)
    assert stats.steps == "direct" and len(calls) == 1
    assert got == plain_greedy(target, prompts, 5)
    assert not target.cache._owned and not drafter.cache._owned
    # the real DraftStep takes the drafter's spare slot, then the verify step is refused: the
    # drafter's slot is given back
    monkeypatch.undo()
    monkeypatch.setattr(loop, "_graphs_available", lambda dev: True)
    monkeypatch.setattr(loop, "VerifyStep", Refuse)
    target, drafter = _pair(4, seed=1, max_requests=3)
    got, stats = speculative_generate(target, drafter, prompts, 5)
    assert stats.steps == "direct" and len(calls) == 2
    assert got == plain_greedy(target, prompts, 5)
    assert not target.cache._owned and not drafter.cache._owned
    # an explicit steps= still raises
    with pytest.raises(ValueError, match="spare request slot"):
        speculative_generate(target, drafter, prompts, 5, steps="static")


def test_steps_argument_checked():
    target, drafter = _pair(4, seed=1)
    with pytest.raises(ValueError, match="steps must be"):
        speculative_generate(target, drafter, [[1, 2]], 3, steps="eager")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        speculative_generate(target, drafter, [[1, 2]], 3, steps="graphs")


def test_untimed_static_loop_reads_the_host_once_an_iteration():
    target, drafter = _pair(4, seed=4)
    prompts = _prompts(3, seed=8)
    got, stats = speculative_generate(target, drafter, prompts, 11, steps="static",
                                      time_stages=False)
    assert got == plain_greedy(target, prompts, 11)
    assert stats.host_syncs == stats.iterations + 1  # + the first token's done flags


@pytest.mark.gpu
@pytest.mark.parametrize("batch, block_size", [(1, 4), (3, 4), (8, 16)])
def test_graphed_loop_equals_plain_greedy_gpu(batch, block_size):
    """The loop with both steps captured as CUDA graphs (fp32, so the batched verify and the
    one-token plain decode round alike), ragged prompts, stop tokens mid-block; at batch 8 the
    requests finish at different iterations, so smaller active sets run padded to a bucket
    (the scratch slot's rows under capture)."""
    import math

    target, drafter = _pair(block_size, seed=11, device="cuda", max_requests=batch + 1,
                            num_blocks=(batch + 1) * 16)
    prompts = _prompts(batch, seed=12 + batch)
    free = plain_greedy(target, prompts, 24)
    stop = [free[0][9]] + ([free[3][5], free[6][14]] if batch == 8 else [])
    want = plain_greedy(target, prompts, 24, stop)
    got, stats = speculative_generate(target, drafter, prompts, 24, stop, steps="graphs",
                                      time_stages=False)
    assert got == want
    assert stats.seconds["capture"] > 0
    buckets = int(math.log2(batch)) + 2  # at most: 8, 4, 2, 1 (or n itself when n < 2^k)
    assert stats.host_syncs <= stats.iterations + 1 + 2 * buckets  # + one a graph captured
    assert not target.cache._owned and not drafter.cache._owned
    if batch == 3:  # the default on CUDA: graphs where the caches have the spare slot
        got, stats = speculative_generate(target, drafter, prompts, 24, stop, time_stages=False)
        assert stats.steps == "graphs" and got == want


class _ScriptedDrafter:
    """Proposes the target's own continuation (from a plain greedy run), optionally wrong from
    draft index ``wrong_at`` on."""

    def __init__(self, real, sequences, wrong_at=None):
        self.cfg, self.cache = real.cfg, real.cache
        self.sequences, self.wrong_at = sequences, wrong_at

    def add_context(self, *a):
        pass

    def propose(self, block, requests, start, logits=True):
        b = block.shape[1]
        out = torch.zeros(block.shape[0], b - 1, dtype=torch.long)
        for i, (r, s) in enumerate(zip(requests.tolist(), start.tolist())):
            seq = self.sequences[r]
            for j in range(b - 1):
                t = seq[s + 1 + j] if s + 1 + j < len(seq) else 0
                if self.wrong_at is not None and j >= self.wrong_at:
                    t = (t + 1) % MASK
                out[i, j] = t
        return out, None


@pytest.mark.parametrize("wrong_at, per_iter", [(None, 4), (0, 1), (2, 3)])
def test_scripted_drafters_pin_acceptance(wrong_at, per_iter):
    target, real = _pair(4, seed=7)
    prompts = _prompts(2, seed=9)
    n_new = 1 + 4 * 5  # the first token, then five full iterations
    plain = plain_greedy(target, prompts, n_new + 8)
    seqs = [p + o for p, o in zip(prompts, plain)]
    got, stats = speculative_generate(target, _ScriptedDrafter(real, seqs, wrong_at), prompts,
                                    n_new)
    assert got == [o[:n_new] for o in plain]
    full = stats.acceptance[:-2]  # the last iteration may be cut by max_new_tokens
    assert full and all(a == per_iter for a in full), stats.acceptance


def test_demo_command_runs_and_matches_plain_greedy(capsys):
    from dflash_ops.cli import main
    rc = main(["demo", "--device", "cpu", "--batch", "2", "--prompt-len", "5",
               "--max-new-tokens", "6", "--block-size", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "output equals plain greedy decoding: yes" in out
    assert "acceptance length" in out and "tokens/s" in out
    assert re.search(r"^steps +direct$", out, re.M), out  # "auto" resolved: direct on CPU


def _small_vocab_pair(vocab=4, block_size=4, requests=16, device="cpu", dflash2=False):
    tcfg = TargetConfig(hidden_size=H, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=vocab, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=512,
                        tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                        source="<test>")
    target = Target.random(tcfg, seed=11, dtype=torch.float32, num_blocks=8 * requests,
                           block_size=4, max_requests=requests, max_len=32, device=device)
    with torch.no_grad():  # sharper than random init: a distribution far from uniform
        target.lm_head.mul_(3.0)
    v2 = dict(model_type="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8,
              selector_top_k=min(3, vocab)) if dflash2 else {}
    dcfg = DFlashConfig(hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=vocab, mask_token_id=vocab - 1,
                        target_layer_ids=[0, 1], block_size=block_size,
                        max_position_embeddings=512, source="<test>", **v2)
    drafter = DFlashDrafter(dcfg, random_drafter_state(dcfg, 12), embed_tokens=target.embed,
                            lm_head=target.lm_head, dtype=torch.float32, num_blocks=8 * requests,
                            cache_block_size=4, max_requests=requests, max_len=32,
                            device=device)
    return target, drafter


def _exact_joint(target, prompt, n, temperature, top_k):
    """P(first n new tokens) of plain sampling from the target, by enumeration."""
    from dflash_ops.speculator.step import probs_from_logits
    vocab = target.cfg.vocab_size
    joint = {}

    def cond(prefix):
        target.add_request(0, 32)
        try:
            logits, _ = target.forward(torch.tensor(prefix), [0], [0], [len(prefix)])
        finally:
            target.free_request(0)
        return probs_from_logits(logits[-1], temperature, top_k=top_k).double()

    def walk(prefix, prob, depth):
        if depth == n:
            joint[tuple(prefix[len(prompt):])] = prob
            return
        p = cond(prefix)
        for t in range(vocab):
            if p[t] > 0:
                walk(prefix + [t], prob * float(p[t]), depth + 1)
    walk(list(prompt), 1.0, 0)
    return joint


def assert_matches_joint(counts: dict, total: int, want: dict) -> None:
    """Chi-square of the observed sequence counts against the exact joint ``want`` at 0.1%
    significance (cells with expected count < 5 pooled); no sequence outside its support."""
    assert set(counts) <= {k for k, v in want.items() if v > 0}, "a token outside the support"
    stat, df, pool_e, pool_o = 0.0, -1, 0.0, 0
    for k, pk in want.items():
        e, o = pk * total, counts.get(k, 0)
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + o
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    z = 3.09  # the 0.999 quantile of N(0, 1); Wilson-Hilferty for the chi-square quantile
    limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f} (df {df}); counts {counts}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("top_k,drafter_kind", [(0, "dflash"), (3, "dflash"), (0, "dflash2"),
                                                (3, "dflash2")])
def test_sampling_matches_target_distribution(top_k, drafter_kind, device):
    """Chi-square over the joint of the first three new tokens (the first from the prefill, the
    next two from one draft-and-verify iteration with block 4): speculative rejection sampling
    must reproduce plain sampling from the target. 0.1% significance. On CUDA the acceptance
    runs as the Triton kernel (direct steps: no graph capture per call). DFlash 2: the drafts
    come from the candidate selector's sampled walk and q is its distribution (top 3 of 4)."""
    target, drafter = _small_vocab_pair(device=device, dflash2=drafter_kind == "dflash2")
    prompt = [0, 2, 1, 1, 0]
    temp, n_new, reps = 1.0, 3, 16
    want = _exact_joint(target, prompt, n_new, temp, top_k)
    gen = torch.Generator(device=device).manual_seed(0)
    counts, total, accepted = {}, 0, []
    for _ in range(250):
        got, st = speculative_generate(target, drafter, [prompt] * reps, n_new, temperature=temp,
                                     top_k=top_k, generator=gen, steps="direct")
        accepted += st.acceptance
        for o in got:
            counts[tuple(o)] = counts.get(tuple(o), 0) + 1
            total += 1
    assert_matches_joint(counts, total, want)
    # the drafter is random: both acceptances and rejections happened
    assert min(accepted) >= 1 and max(accepted) >= 2, accepted[:20]


def test_commit_block_cases():
    from dflash_ops.ops.loop import commit_block
    block = torch.tensor([[9, 1, 2, 3], [9, 4, 5, 6], [9, 7, 8, 1], [9, 2, 2, 2]])
    post = torch.tensor([[1, 2, 5, 0], [0, 0, 0, 0], [7, 8, 1, 4], [2, 2, 2, 3]])
    match = torch.tensor([2, 0, 3, 3])  # accepted drafts per request
    n_out = torch.tensor([0, 0, 5, 0])
    out = torch.full((4, 12), -1)
    kept, done, last = commit_block(block, post, match, n_out, 7, torch.tensor([8]), out,
                                     torch.arange(4))
    # r0: drafts 1, 2 + target's 5; r1: only the target's 0; r2: room 2 of 7 -> 7, then stop 8
    # cuts at 8 (also the room); r3: all three drafts + bonus 3
    assert kept.tolist() == [3, 1, 2, 4]
    assert done.tolist() == [False, False, True, False]
    assert last.tolist() == [5, 0, 8, 3]
    assert out[0, :3].tolist() == [1, 2, 5] and out[1, :1].tolist() == [0]
    assert out[2, 5:7].tolist() == [7, 8] and out[3, :4].tolist() == [2, 2, 2, 3]
    kept, done, _ = commit_block(block[:1], post[:1], match[:1], torch.tensor([0]), 7,
                                 torch.tensor([1]), out, torch.tensor([0]))
    assert kept.tolist() == [1] and done.tolist() == [True]  # stop token as the first new token
