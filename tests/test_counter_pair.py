"""The hand-built counter pair (``models.synthetic``): a target that counts and a drafter that
copies the token V + 1 positions back, so every draft is right. The loop must accept whole
blocks on it (a drafter reading the wrong positions, layer caches or heads would not), its
output must equal plain greedy, and a drafter copying from one position off must get nothing
accepted: the acceptance check can fail."""
from __future__ import annotations

import pytest
import torch

from dflash_ops.models import save_target, save_zlab
from dflash_ops.models.config import DFlashConfig
from dflash_ops.models.drafter import DFlashDrafter
from dflash_ops.models.synthetic import counter_pair, counter_prompts
from dflash_ops.models.target import Target, TargetConfig
from dflash_ops.models.weights import load_state
from dflash_ops.speculator.loop import plain_greedy, speculative_generate

SMALL = dict(hidden=128, vocab=64, target_layers=3, draft_layers=2, heads=4, kv_heads=2,
             head_dim=32, intermediate=128, block_size=8)
LENGTHS = (70, 93, 81)
NEW = 25  # the prefill token + 3 whole blocks of 8


def build(device="cpu", dtype=torch.float32, delta=None, from_dir=None, **over):
    kw = dict(SMALL, **over)
    if from_dir is None:
        tc, ts, dc, ds = counter_pair(delta=delta, **kw)
    else:
        tc, ts, dc, ds = from_dir
    cache = dict(dtype=dtype, device=device, max_requests=4, max_len=160, num_blocks=4 * 10)
    dcfg = DFlashConfig.from_dict(dc) if isinstance(dc, dict) else DFlashConfig.from_pretrained(dc)
    target = Target(TargetConfig.from_hf(tc), ts, block_size=16, **cache)  # tc: dict or dir
    drafter = DFlashDrafter(dcfg, ds, embed_tokens=target.embed,
                            lm_head=target.lm_head, cache_block_size=16, **cache)
    return target, drafter


def prompts(vocab=SMALL["vocab"]):
    return counter_prompts(3, vocab=vocab, lengths=LENGTHS, seed=3)


def check_accepts(target, drafter, steps="direct"):
    ps = prompts()
    want = plain_greedy(target, ps, NEW)
    assert want == [[(p[-1] + 1 + j) % SMALL["vocab"] for j in range(NEW)] for p in ps], \
        "the counter target does not count"
    got, stats = speculative_generate(target, drafter, ps, NEW, steps=steps, policy=False)
    assert got == want
    return stats


def test_counter_pair_drafts_are_accepted():
    stats = check_accepts(*build())
    b = SMALL["block_size"]
    assert stats.iterations == (NEW - 1) // b and stats.mean_acceptance == b, stats


def test_counter_pair_through_checkpoint_files(tmp_path):
    """The pair as vLLM reads it: saved in HF / z-lab format and loaded back."""
    tc, ts, dc, ds = counter_pair(**SMALL)
    save_target(tmp_path / "target", tc, {k: v.to(torch.bfloat16) for k, v in ts.items()})
    save_zlab(tmp_path / "drafter", dc, {k: v.to(torch.bfloat16) for k, v in ds.items()})
    loaded = (tmp_path / "target", load_state(tmp_path / "target"), tmp_path / "drafter",
              load_state(tmp_path / "drafter"))
    stats = check_accepts(*build(from_dir=loaded, dtype=torch.bfloat16))
    assert stats.mean_acceptance == SMALL["block_size"], stats


def test_counter_pair_wrong_offset_accepts_nothing():
    stats = check_accepts(*build(delta=SMALL["vocab"]))  # one position off
    assert stats.mean_acceptance == 1.0, stats


def test_counter_pair_swapped_layer_caches_accept_less():
    """Layer 0's K/V weights in layer 1 (its values then carry layer 0's permutation): the
    drafter is wrong where layer 1 decides, so fewer tokens are accepted."""
    tc, ts, dc, ds = counter_pair(**SMALL)
    bad = dict(ds)
    for n in ("k_proj", "v_proj"):
        bad[f"layers.1.self_attn.{n}.weight"] = ds[f"layers.0.self_attn.{n}.weight"]
    stats = check_accepts(*build(from_dir=(tc, ts, dc, bad)))
    assert stats.mean_acceptance < SMALL["block_size"] / 2, stats


def test_counter_pair_bad_sizes():
    with pytest.raises(ValueError, match="vocab must be <= kv_heads"):
        counter_pair(hidden=128, vocab=100, kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="lengths must be > vocab"):
        counter_prompts(1, vocab=64, lengths=(60,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", ["direct", "graphs"])
def test_counter_pair_gpu(dtype, steps):
    """Default backends (CUDA / Triton) and the graphed steps accept whole blocks."""
    stats = check_accepts(*build(device="cuda", dtype=dtype), steps=steps)
    assert stats.mean_acceptance == SMALL["block_size"], stats
