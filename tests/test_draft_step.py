"""DraftStep: one drafter step on static buffers with padding to a bucket gives, for the real
rows, what direct add_context + propose calls give (CPU, eager); on the GPU the captured graph
replays with new inputs and changing lengths to the same result as eager."""
from __future__ import annotations

import pytest
import torch

from dflash_ops.speculator.draft_step import DraftStep
from tests.test_speculator import _pair


def _inputs(drafter, step, n_req, gen, device="cpu"):
    cfg = drafter.cfg
    b = cfg.block_size
    width = cfg.n_taps * cfg.target_hidden_size
    n_new = [int(torch.randint(1, b + 1, (1,), generator=gen)) for _ in range(n_req)]
    ctx = torch.randn(sum(n_new), width, generator=gen).to(device)
    req = torch.cat([torch.full((k,), r) for r, k in enumerate(n_new)]).to(device)
    start0 = [5 * step + 3 * r for r in range(n_req)]
    pos = torch.cat([torch.arange(s, s + k) for s, k in zip(start0, n_new)]).to(device)
    start = torch.tensor([s + k for s, k in zip(start0, n_new)], device=device)
    ids = torch.randint(0, cfg.mask_token_id, (n_req, b), generator=gen)
    ids[:, 1:] = cfg.mask_token_id
    return ctx, req, pos, ids.to(device), torch.arange(n_req, device=device), start


def _fresh_pair():
    target, drafter = _pair(4, seed=21)
    for r in range(3):
        drafter.cache.add_request(r, 40)
    return drafter


def test_padded_step_equals_direct_calls():
    direct, padded = _fresh_pair(), _fresh_pair()
    runner = DraftStep(padded, max_batch=4, scratch_request=3)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        ctx, req, pos, ids, reqs, start = _inputs(direct, step, 3, gen)
        direct.add_context(ctx, req, pos)
        want_t, want_z = direct.propose(ids, reqs, start)
        bucket = runner.load(ctx, req, pos, ids, reqs, start)
        assert bucket == 4
        got_t, got_z = runner.run(bucket)
        torch.testing.assert_close(got_z[:3], want_z, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_t[:3], want_t)


def test_propose_runs_no_batched_gemm():
    """The LM head over the mask rows of R blocks is one GEMM, not R (each reading the LM head)."""
    from torch.profiler import profile

    drafter = _fresh_pair()
    ctx, req, pos, ids, reqs, start = _inputs(drafter, 0, 3, torch.Generator().manual_seed(1))
    drafter.add_context(ctx, req, pos)
    with profile(record_shapes=True) as prof:
        drafter.propose(ids, reqs, start)
    v = drafter.cfg.vocab_size
    head = [(e.key, e.input_shapes) for e in prof.key_averages(group_by_input_shape=True)
            if any(v in shape for shape in e.input_shapes if isinstance(shape, list))
            and e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")]
    assert head and all(k in ("aten::mm", "aten::addmm") for k, _ in head), head


def test_load_rejects_bad_sizes():
    runner = DraftStep(_fresh_pair(), max_batch=2, scratch_request=3)
    ctx, req, pos, ids, reqs, start = _inputs(runner.drafter, 0, 3, torch.Generator())
    with pytest.raises(ValueError, match="batch 3"):
        runner.load(ctx[:2], req[:2], pos[:2], ids, reqs, start)
    with pytest.raises(ValueError, match="block_ids"):
        runner.load(ctx[:2], req[:2], pos[:2], ids[:2, :2], reqs[:2], start[:2])


@pytest.mark.gpu
def test_graph_replay_equals_eager():
    from tests.test_speculator import random_drafter_state
    torch.manual_seed(0)

    def build():
        _, d = _pair(4, seed=21)
        d_gpu = d.__class__(d.cfg, random_drafter_state(d.cfg, 22),
                            embed_tokens=d.embed, lm_head=d.lm_head, dtype=torch.bfloat16,
                            device="cuda", num_blocks=64, cache_block_size=4, max_requests=4,
                            max_len=128)
        for r in range(3):
            d_gpu.cache.add_request(r, 40)
        return d_gpu

    eager, graphed = build(), build()
    runner = DraftStep(graphed, max_batch=4, scratch_request=3)
    gen = torch.Generator().manual_seed(1)
    captured = False
    for step in range(5):
        n_req = (3, 2, 3, 1, 3)[step]
        ctx, req, pos, ids, reqs, start = _inputs(eager, step, n_req, gen, device="cuda")
        eager.add_context(ctx, req, pos)
        want_t, want_z = eager.propose(ids, reqs, start)
        bucket = runner.load(ctx, req, pos, ids, reqs, start)
        if bucket == 4 and not captured:
            runner.capture(4)
            captured = True
        got_t, got_z = runner.run(bucket)
        torch.cuda.synchronize()
        scale = want_z.abs().max().item()
        assert (got_z[:n_req] - want_z).abs().max().item() <= 0.02 * scale, f"step {step}"


def test_padded_verify_equals_direct_forward():
    from dflash_ops.speculator.verify_step import VerifyStep
    t_direct, _ = _pair(4, seed=31)
    t_padded, _ = _pair(4, seed=31)
    for t in (t_direct, t_padded):
        for r in range(3):
            t.add_request(r, 40)
    runner = VerifyStep(t_padded, max_batch=4, block_size=4, tap_layers=[1, 2],
                        scratch_request=3)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (n,), generator=gen) for n in (5, 3, 7)]
    for t in (t_direct, t_padded):  # the same prefill in both
        t.forward(torch.cat(prompts), [0, 1, 2], [0, 0, 0], [5, 3, 7])
    start = torch.tensor([5, 3, 7])
    for _ in range(3):
        ids = torch.randint(0, 90, (3, 4), generator=gen)
        want_z, want_taps = t_direct.forward(ids.reshape(-1), [0, 1, 2], start, [4, 4, 4],
                                             [1, 2])
        bucket = runner.load(ids, torch.arange(3), start)
        z, post, taps = runner.run(bucket)
        torch.testing.assert_close(z[:3].reshape(12, -1), want_z, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(taps[:12], want_taps, atol=1e-5, rtol=1e-5)
        assert torch.equal(post[:3].reshape(-1), want_z.argmax(-1))
        start = start + torch.tensor([1, 4, 2])  # accepted + 1 per request


@pytest.mark.gpu
def test_verify_graph_replay_equals_eager():
    from dflash_ops.models.target import Target
    from dflash_ops.speculator.verify_step import VerifyStep
    cpu_target, _ = _pair(4, seed=31)

    def build():
        t = Target(cpu_target.cfg, {k: v for k, v in _target_state(cpu_target).items()},
                   dtype=torch.bfloat16, device="cuda", num_blocks=64, block_size=4,
                   max_requests=4, max_len=128)
        for r in range(3):
            t.add_request(r, 40)
        return t

    eager, graphed = build(), build()
    runner = VerifyStep(graphed, max_batch=4, block_size=4, tap_layers=[1, 2],
                        scratch_request=3)
    gen = torch.Generator().manual_seed(3)
    start = torch.tensor([0, 0, 0], device="cuda")
    captured = False
    for step in range(4):
        ids = torch.randint(0, 90, (3, 4), generator=gen).cuda()
        want_z, want_taps = eager.forward(ids.reshape(-1), [0, 1, 2], start, [4, 4, 4], [1, 2])
        bucket = runner.load(ids, torch.arange(3, device="cuda"), start)
        if not captured:
            runner.capture(bucket)
            captured = True
        z, post, taps = runner.run(bucket)
        torch.cuda.synchronize()
        scale = want_z.abs().max().item()
        assert (z[:3].reshape(12, -1) - want_z).abs().max().item() <= 0.02 * scale, f"step {step}"
        start = start + torch.tensor([1, 4, 2], device="cuda")


def _target_state(t):
    from dflash_ops.models.target import random_state
    return random_state(t.cfg, seed=31)


@pytest.mark.parametrize("multiplier, softcap", [(1.0, None), (2.5, None), (1.0, 0.5)])
def test_greedy_steps_without_logits_give_the_same_tokens(multiplier, softcap):
    """propose(logits=False) / DraftStep(logits=False) / VerifyStep(logits=False) return no
    logits and the tokens of the logits path: the argmax on the raw LM-head output where the
    scale is positive and there is no soft-cap, on the scaled / capped logits otherwise."""
    import dataclasses

    from dflash_ops.speculator.verify_step import VerifyStep

    drafters = [_fresh_pair() for _ in range(3)]
    for d in drafters:
        d.cfg = dataclasses.replace(d.cfg, output_multiplier=multiplier,
                                    final_logit_softcapping=softcap)
    full, greedy, stepped = drafters
    runner = DraftStep(stepped, max_batch=4, scratch_request=3, logits=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        ctx, req, pos, ids, reqs, start = _inputs(full, step, 3, gen)
        for d in (full, greedy):
            d.add_context(ctx, req, pos)
        want_t, want_z = full.propose(ids, reqs, start)
        assert torch.equal(want_t, want_z.argmax(-1))
        got_t, got_z = greedy.propose(ids, reqs, start, logits=False)
        assert got_z is None and torch.equal(got_t, want_t)
        bucket = runner.load(ctx, req, pos, ids, reqs, start)
        got_t, got_z = runner.run(bucket)
        assert got_z is None and torch.equal(got_t[:3], want_t)

    target, _ = _pair(4, seed=5)
    for r in range(3):
        target.add_request(r, 40)
    ids = torch.randint(0, 50, (3, 4), generator=gen)
    reqs, st = torch.arange(3), torch.tensor([0, 2, 5])
    want, _ = target.forward(ids.reshape(-1), reqs, st, torch.full((3,), 4), None)
    assert want.dtype == torch.float32
    vstep = VerifyStep(target, max_batch=4, block_size=4, tap_layers=[1], scratch_request=3,
                       logits=False)
    logits, post, _ = vstep.run(vstep.load(ids, reqs, st))
    assert logits is None and torch.equal(post[:3], want.view(3, 4, -1).argmax(-1))
