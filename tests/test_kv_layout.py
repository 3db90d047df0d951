"""The paged caches' head-major layout (PagedKVCache(layout="head") / DFLASH_OPS_KV_LAYOUT=head):
the same [num_blocks, block_size, Hkv, D] view over [num_blocks, Hkv, block_size, D] memory; the
models and the loop give what the default layout gives (CPU: torch backend; GPU: the default
backends, eager and under CUDA graphs)."""
from __future__ import annotations

import pytest
import torch

from dflash_ops.models.cache import PagedKVCache
from dflash_ops.speculator import plain_greedy, speculative_generate
from tests.test_speculator import _pair, _prompts


def test_head_layout_is_a_strided_view():
    c = PagedKVCache(2, 5, 16, 4, 32, max_requests=2, max_len=64, dtype=torch.float32,
                     layout="head")
    assert c.layout == "head"
    for t in c.k + c.v:
        assert t.shape == (5, 16, 4, 32)
        assert t.stride() == (4 * 16 * 32, 32, 16 * 32, 1)  # a head's 16 rows are contiguous
    token = PagedKVCache(1, 5, 16, 4, 32, max_requests=2, max_len=64, dtype=torch.float32)
    assert token.layout == "token" and token.k[0].is_contiguous()


def test_layout_from_env_and_bad_layout(monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_KV_LAYOUT", "head")
    assert PagedKVCache(1, 2, 4, 2, 16, 1, 8, torch.float32).layout == "head"
    monkeypatch.setenv("DFLASH_OPS_KV_LAYOUT", "heads")
    with pytest.raises(ValueError, match=r"DFLASH_OPS_KV_LAYOUT\) must be one of .*'heads'"):
        PagedKVCache(1, 2, 4, 2, 16, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="layout"):
        PagedKVCache(1, 2, 4, 2, 16, 1, 8, torch.float32, layout="block")


def _run(monkeypatch, layout, device="cpu", batch=3, block_size=4):
    monkeypatch.setenv("DFLASH_OPS_KV_LAYOUT", layout)
    target, drafter = _pair(block_size, seed=5, device=device, max_requests=batch + 1,
                            num_blocks=(batch + 1) * 16)
    assert target.cache.layout == drafter.cache.layout == layout
    prompts = _prompts(batch, seed=6)
    # the target's logits for a whole prompt (prefill) and the loop's output
    target.add_request(0, 64)
    n = len(prompts[0])
    logits, _ = target.forward(torch.tensor(prompts[0]), torch.tensor([0]), torch.tensor([0]),
                               torch.tensor([n]), None)
    target.free_request(0)
    got, stats = speculative_generate(target, drafter, prompts, 14, time_stages=False)
    return logits.cpu(), got, plain_greedy(target, prompts, 14), stats


def test_models_and_loop_agree_across_layouts(monkeypatch):
    z_tok, got_tok, want, _ = _run(monkeypatch, "token")
    z_head, got_head, want_head, _ = _run(monkeypatch, "head")
    torch.testing.assert_close(z_head, z_tok, atol=1e-5, rtol=1e-5)
    assert got_tok == want and got_head == want_head == want


@pytest.mark.gpu
def test_models_and_loop_agree_across_layouts_gpu(monkeypatch):
    """fp32 models on CUDA, default backends (eager forward; the loop's "auto" steps capture
    CUDA graphs): the head layout gives the token layout's logits and plain greedy's output."""
    z_tok, got_tok, want, _ = _run(monkeypatch, "token", device="cuda")
    z_head, got_head, want_head, stats = _run(monkeypatch, "head", device="cuda")
    torch.testing.assert_close(z_head, z_tok, atol=1e-4, rtol=1e-4)
    assert got_tok == want and got_head == want_head == want
    assert stats.steps == "graphs"
