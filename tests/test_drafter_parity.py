"""Our DFlashDrafter against the ``dflash`` package's DFlashDraftModel (the independent reference)
on CPU in fp32 with the torch backend: random weights saved as a checkpoint (z-lab and
speculators formats), loaded by both, several draft steps with context appended between steps
(the reference's own DynamicCache + crop protocol, as its dflash_generate runs it); logits and
greedy drafts compared at every step. Configurations: non-causal full attention; a sliding
(causal by default) layer next to a full one; a speculators checkpoint whose layer ids are shifted
by one; all-layers-causal.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

dm = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

from dflash_ops.models.config import DFlashConfig  # noqa: E402
from dflash_ops.models.drafter import DFlashDrafter  # noqa: E402
from dflash_ops.bench.drafter import RefHead  # noqa: E402
from dflash_ops.models.weights import load_state, save_speculators, save_zlab  # noqa: E402

H, VOCAB, MASK = 64, 101, 100


def _cfg_dict(layer_types=("full_attention", "full_attention"), sliding_window=None,
              is_causal=None, block_size=4):
    d = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H,
             num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, rope_theta=10000.0,
             vocab_size=VOCAB, max_position_embeddings=512, attention_bias=False,
             num_target_layers=6, block_size=block_size, layer_types=list(layer_types),
             dflash_config={"target_layer_ids": [1, 3], "mask_token_id": MASK})
    if sliding_window is not None:
        d.update(sliding_window=sliding_window, use_sliding_window=True)
    if is_causal is not None:
        d["is_causal"] = is_causal
    return d


def _reference(cfg_dict, seed):
    torch.manual_seed(seed)
    hf = transformers.Qwen3Config(**cfg_dict)
    for k in ("is_causal",):
        if k in cfg_dict:
            setattr(hf, k, cfg_dict[k])
    ref = dm.DFlashDraftModel(hf).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return ref


def _close_fp32(got, want, step):
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4,
                               msg=lambda m: f"step {step}: {m}")
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {step}: drafts differ"


def _run(cfg_dict, fmt, tmp_path, seed=0, steps=(7, 2, 4, 1, 3), device="cpu",
         dtype=torch.float32, compare=_close_fp32):
    """Reference (fp32, CPU) vs ours (``dtype`` on ``device``, whatever backends are active)."""
    ref = _reference(cfg_dict, seed)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    if fmt == "zlab":
        save_zlab(tmp_path, cfg_dict, state)
    else:
        save_speculators(tmp_path, cfg_dict, state)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    assert cfg.target_layer_ids == [1, 3]
    embed = torch.randn(VOCAB, H)
    head = torch.randn(VOCAB, H) * H ** -0.5
    ours = DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=embed, lm_head=head,
                         dtype=dtype, device=device, num_blocks=16, cache_block_size=4,
                         max_requests=2, max_len=64)
    ours.cache.add_request(1)  # request slot 1 (slot 0 stays unused: tables must not mix)
    req = torch.tensor([1], device=device)
    bsz = cfg.block_size
    cache = dm._make_cache(ref.config)
    gen = torch.Generator().manual_seed(seed + 1)
    start, tok = 0, 5
    with torch.no_grad():
        for step, n_new in enumerate(steps):
            f = torch.randn(1, n_new, len(cfg.target_layer_ids) * H, generator=gen)
            ours.add_context(f[0].to(device), req.expand(n_new),
                             torch.arange(start, start + n_new, device=device))
            start += n_new
            ids = torch.tensor([[tok] + [MASK] * (bsz - 1)])
            noise = F.embedding(ids, embed)
            pos = torch.arange(start - n_new, start + bsz)[None]
            hid = ref(target_hidden=f, noise_embedding=noise, position_ids=pos,
                      past_key_values=cache, use_cache=True)[:, 1 - bsz:, :]
            dm._crop_to(cache, start)
            want = ref.compute_logits(hid, RefHead(head))[0]
            drafts, got = ours.propose(ids.to(device), req, torch.tensor([start], device=device))
            compare(got[0].float().cpu(), want, step)
            tok = int(want.argmax(-1)[0])


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_parity_noncausal(fmt, tmp_path):
    _run(_cfg_dict(), fmt, tmp_path)


def test_parity_sliding_and_full(tmp_path):
    _run(_cfg_dict(("sliding_attention", "full_attention"), sliding_window=5), "zlab", tmp_path,
         seed=1)


def test_parity_all_causal(tmp_path):
    _run(_cfg_dict(is_causal=True), "zlab", tmp_path, seed=2)


def _saved(tmp_path, fmt="zlab"):
    cfg_dict = _cfg_dict()
    state = {k: v.detach().clone() for k, v in _reference(cfg_dict, 0).state_dict().items()}
    return cfg_dict, state


def _build(tmp_path, cfg_dict, state):
    save_zlab(tmp_path, cfg_dict, state)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    return DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=torch.zeros(VOCAB, H),
                         lm_head=torch.zeros(VOCAB, H), dtype=torch.float32, num_blocks=4,
                         cache_block_size=4, max_requests=1, max_len=16)


def test_bad_checkpoint_missing_tensor(tmp_path):
    cfg_dict, state = _saved(tmp_path)
    del state["layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing: layers\.1\.self_attn\.k_norm\.weight"):
        _build(tmp_path, cfg_dict, state)


def test_bad_checkpoint_wrong_shape_and_unexpected(tmp_path):
    cfg_dict, state = _saved(tmp_path)
    state["fc.weight"] = state["fc.weight"][:, :-1].clone()
    state["layers.0.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError) as e:
        _build(tmp_path, cfg_dict, state)
    assert "fc.weight" in str(e.value) and "layers.0.extra.weight" in str(e.value)


def test_bad_checkpoint_no_mask_token(tmp_path):
    cfg_dict, state = _saved(tmp_path)
    del cfg_dict["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        _build(tmp_path, cfg_dict, state)


def test_no_embedding_anywhere_is_an_error(tmp_path):
    cfg_dict, state = _saved(tmp_path)
    save_zlab(tmp_path, cfg_dict, state)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="embed_tokens"):
        DFlashDrafter(cfg, load_state(tmp_path), lm_head=torch.zeros(VOCAB, H),
                      dtype=torch.float32, num_blocks=4, cache_block_size=4)
