"""The DFlash 2 drafter against the ``dflash`` package's ``DFlash2DraftModel`` (CPU, fp32, torch
backend): random weights saved in the z-lab and speculators formats, several steps with context
appended; each step's mask-row logits equal and the selector's drafted path equal. Bad DFlash 2
checkpoints (a missing convolution tensor, a wrong-rank kernel, a group size that does not
divide H) give named errors."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
dm = pytest.importorskip("dflash.model")

from dflash_ops.bench.drafter import RefHead  # noqa: E402
from dflash_ops.models import DFlashConfig  # noqa: E402
from dflash_ops.models.drafter import DFlashDrafter  # noqa: E402
from dflash_ops.models.weights import load_state, save_speculators, save_zlab  # noqa: E402
from tests.test_reference import assert_rule  # noqa: E402

H, VOCAB, MASK = 64, 101, 100


def cfg_dict(block_size=4, k=2, gs=16, rank=8, top_k=4, layer_types=("full_attention",) * 2,
             sliding_window=None):
    d = dict(architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_size=H,
             num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, rope_theta=10000.0,
             vocab_size=VOCAB, max_position_embeddings=512, attention_bias=False,
             num_target_layers=6, block_size=block_size, layer_types=list(layer_types),
             dflash_config={"target_layer_ids": [1, 3], "mask_token_id": MASK,
                            "conv_kernel_size": k, "conv_group_size": gs,
                            "selector_rank": rank, "selector_top_k": top_k})
    if sliding_window is not None:
        d.update(sliding_window=sliding_window, use_sliding_window=True)
    return d


def reference(d, seed):
    torch.manual_seed(seed)
    ref = dm.DFlash2DraftModel(transformers.Qwen3Config(**d)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "codebook" in name:
                p.copy_(torch.randn_like(p))
            elif "base_kernel" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return ref


def run(d, fmt, tmp_path, seed=0, steps=(7, 2, 4, 1, 3), device="cpu", dtype=torch.float32,
        tol=2e-4):
    """Reference (fp32, CPU) vs ours (``dtype`` on ``device``, the default backends). fp32:
    logits within ``tol`` and drafted paths equal. Lower precision: the 2x rule (our logits'
    max error from the fp32 reference at most twice that of the same reference run in
    ``dtype`` on ``device``, plus one ulp of the largest logit); paths may part at near-ties."""
    ref = reference(d, seed)
    low = dtype != torch.float32
    ref_lo = copy.deepcopy(ref).to(device=device, dtype=dtype) if low else None
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    (save_zlab if fmt == "zlab" else save_speculators)(tmp_path, d, state)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    assert cfg.model_type == "dflash2"
    embed = torch.randn(VOCAB, H)
    head = torch.randn(VOCAB, H) * H ** -0.5
    ours = DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=embed, lm_head=head,
                         dtype=dtype, device=device, num_blocks=16, cache_block_size=4,
                         max_requests=2, max_len=64)
    ours.cache.add_request(1)
    req = torch.tensor([1], device=device)
    bsz = cfg.block_size
    cache = dm._make_cache(ref.config)
    cache_lo = dm._make_cache(ref_lo.config) if low else None
    gen = torch.Generator().manual_seed(seed + 1)
    start, tok = 0, 5
    with torch.no_grad():
        for step, n_new in enumerate(steps):
            f = torch.randn(1, n_new, len(cfg.target_layer_ids) * H, generator=gen)
            ours.add_context(f[0].to(device), req.expand(n_new),
                             torch.arange(start, start + n_new, device=device))
            start += n_new
            ids = torch.tensor([[tok] + [MASK] * (bsz - 1)])
            pos = torch.arange(start - n_new, start + bsz)[None]
            hid = ref(target_hidden=f, noise_embedding=F.embedding(ids, embed), position_ids=pos,
                      past_key_values=cache, use_cache=True)[:, 1 - bsz:, :]
            dm._crop_to(cache, start)
            want_logits = ref.compute_logits(hid, RefHead(head))
            want_path, _, _ = ref.propose(hid, ids[:, 0], RefHead(head), 0.0)
            drafts, got = ours.propose(ids.to(device), req, torch.tensor([start], device=device))
            if low:
                lo = dict(device=device, dtype=dtype)
                hid_lo = ref_lo(target_hidden=f.to(**lo),
                                noise_embedding=F.embedding(ids, embed).to(**lo),
                                position_ids=pos.to(device), past_key_values=cache_lo,
                                use_cache=True)[:, 1 - bsz:, :]
                dm._crop_to(cache_lo, start)
                lo_logits = ref_lo.compute_logits(hid_lo, RefHead(head.to(**lo)))
                assert_rule(got.cpu(), want_logits, lo_logits.cpu(), what=f"step {step} logits")
            else:
                torch.testing.assert_close(got.float().cpu(), want_logits, atol=tol, rtol=tol,
                                           msg=lambda m: f"step {step}: {m}")
                assert torch.equal(drafts.cpu(), want_path), (step, drafts, want_path)
            tok = int(want_path[0, 0])


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_dflash2_parity(fmt, tmp_path):
    run(cfg_dict(), fmt, tmp_path)


def test_dflash2_parity_bf16_cpu(tmp_path):
    """bf16 on the CPU (torch backends) under the 2x rule: the rule itself is exercised in CI."""
    run(cfg_dict(block_size=8, k=3, gs=8, top_k=6), "zlab", tmp_path, seed=4,
        dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, None)],
                         ids=["fp32", "bf16"])
def test_dflash2_parity_gpu(tmp_path, dtype, tol):
    """The same on the GPU (default backends: Triton conv and selector, CUDA attention); fp32:
    logits close and paths equal; bf16: the 2x rule against the reference run in bf16 on the
    GPU (a fixed 0.06 failed there on 2026-12-01: 0.127 off, the bf16 reference itself rounds
    each conv tap)."""
    run(cfg_dict(block_size=8, k=3, gs=8, top_k=6), "zlab", tmp_path, seed=4, device="cuda",
        dtype=dtype, tol=tol)


@pytest.mark.gpu
def test_selector_branch_under_graph_gpu(tmp_path):
    """In a graphed call the selector's hidden projection runs on ``streams.side_stream``
    beside the LM head (a branch of the graph, joined before the walk): greedy and sampled
    proposals replayed from one capture each, with other block tokens and uniforms on every
    replay, equal the eager calls' bit for bit (bf16, default backends)."""
    from dflash_ops import dispatch, streams
    d = cfg_dict(block_size=8, k=3, gs=8, rank=16, top_k=6)
    state = {k: v.detach().clone() for k, v in reference(d, 3).state_dict().items()}
    save_zlab(tmp_path, d, state)
    dev, gen = "cuda", torch.Generator().manual_seed(5)
    ours = DFlashDrafter(DFlashConfig.from_pretrained(tmp_path), load_state(tmp_path),
                         embed_tokens=torch.randn(VOCAB, H, generator=gen),
                         lm_head=torch.randn(VOCAB, H, generator=gen) * H ** -0.5,
                         dtype=torch.bfloat16, device=dev, num_blocks=32, cache_block_size=4,
                         max_requests=2, max_len=64)
    for r in (0, 1):
        ours.cache.add_request(r)
    req = torch.tensor([0, 1], device=dev)
    f = torch.randn(2 * 9, 2 * H, generator=gen).to(dev)
    ours.add_context(f, req.repeat_interleave(9), torch.arange(9, device=dev).repeat(2))
    ids = torch.full((2, 8), MASK, device=dev)
    start = torch.tensor([9, 9], device=dev)
    u = torch.rand(2, 7, device=dev)
    g1, (drafts, _) = dispatch.capture_graph(lambda: ours.propose(ids, req, start, logits=False))
    g2, sampled = dispatch.capture_graph(lambda: ours.propose_sampled(ids, req, start, 0.9, u))
    assert torch.device(dev, torch.cuda.current_device()) in streams._SIDE  # the branch ran
    for tok in ((5, 7), (0, 99), (42, 42)):
        ids[:, 0] = torch.tensor(tok, device=dev)
        u.copy_(torch.rand(2, 7, generator=gen).to(dev))
        g1.replay()
        g2.replay()
        want, _ = ours.propose(ids, req, start, logits=False)
        assert torch.equal(drafts, want), (tok, drafts, want)
        for got, w in zip(sampled, ours.propose_sampled(ids, req, start, 0.9, u)):
            assert torch.equal(got, w), tok


def test_dflash2_parity_kernel3_block8_sliding(tmp_path):
    run(cfg_dict(block_size=8, k=3, gs=8, top_k=6,
                 layer_types=("sliding_attention", "sliding_attention"), sliding_window=6),
        "zlab", tmp_path, seed=3)


def _build(tmp_path, d, state):
    save_zlab(tmp_path, d, state)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    return DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=torch.zeros(VOCAB, H),
                         lm_head=torch.zeros(VOCAB, H), dtype=torch.float32, num_blocks=4,
                         cache_block_size=4, max_requests=1, max_len=16)


def _state(d):
    return {k: v.detach().clone() for k, v in reference(d, 0).state_dict().items()}


def test_missing_conv_tensor_is_named(tmp_path):
    d = cfg_dict()
    state = _state(d)
    del state["layers.1.mlp_conv.kernel_projection.weight"]
    with pytest.raises(ValueError, match=r"missing: layers\.1\.mlp_conv\.kernel_projection"):
        _build(tmp_path, d, state)


def test_wrong_rank_conv_kernel_is_named(tmp_path):
    d = cfg_dict()
    state = _state(d)
    state["layers.0.attention_conv.base_kernel"] = state[
        "layers.0.attention_conv.base_kernel"][0].clone()
    with pytest.raises(ValueError, match=r"wrong shape: layers\.0\.attention_conv\.base_kernel"):
        _build(tmp_path, d, state)


def test_group_size_not_dividing_h_is_named(tmp_path):
    d = cfg_dict(gs=24)
    with pytest.raises(ValueError, match="conv_group_size"):
        save_zlab(tmp_path, d, {})
        DFlashConfig.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------
# The loop with a DFlash 2 drafter: greedy is lossless (== plain greedy); sampling is tested
# for losslessness in tests/test_speculator.py (chi-square against the target's distribution)
# --------------------------------------------------------------------------------------------
def _pair(tmp_path):
    from dflash_ops.models.target import Target, TargetConfig
    tcfg = TargetConfig(hidden_size=H, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=512)
    target = Target.random(tcfg, seed=0, dtype=torch.float32, num_blocks=64, block_size=4,
                           max_requests=2, max_len=96)
    d = cfg_dict()
    save_zlab(tmp_path, d, _state(d))
    cfg = DFlashConfig.from_pretrained(tmp_path)
    drafter = DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=target.embed,
                            lm_head=target.lm_head, dtype=torch.float32, num_blocks=64,
                            cache_block_size=4, max_requests=2, max_len=96)
    return target, drafter


def test_dflash2_greedy_loop_equals_plain_greedy(tmp_path):
    from dflash_ops.speculator import plain_greedy, speculative_generate
    target, drafter = _pair(tmp_path)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = plain_greedy(target, prompts, 12)
    got, stats = speculative_generate(target, drafter, prompts, 12, steps="direct")
    assert got == want


def test_demo_runs_a_dflash2_checkpoint(tmp_path):
    """``dflash-ops demo --target --draft`` on an HF target and a DFlash 2 z-lab drafter
    (random weights): the loop's output equals plain greedy decoding."""
    import subprocess
    import sys
    from dflash_ops.models import save_target
    from dflash_ops.models.drafter import random_drafter_state
    from dflash_ops.models.target import TargetConfig, random_state
    h, lt, vocab = 64, 4, 128
    tcfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=h,
                num_hidden_layers=lt, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, vocab_size=vocab, hidden_act="silu",
                max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                tie_word_embeddings=False)
    tc = TargetConfig(hidden_size=h, num_layers=lt, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=vocab, rope_theta=1e6,
                      max_position_embeddings=512)
    save_target(tmp_path / "target", tcfg, random_state(tc, 0))
    d = cfg_dict(block_size=4)
    d.update(vocab_size=vocab, num_target_layers=lt)
    d["dflash_config"]["mask_token_id"] = vocab - 1
    save_zlab(tmp_path / "drafter", d, random_drafter_state(DFlashConfig.from_dict(d), 1))
    out = subprocess.run([sys.executable, "-m", "dflash_ops", "demo", "--target",
                          str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"),
                          "--device", "cpu", "--max-new-tokens", "8", "--prompt-len", "6"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "output equals plain greedy decoding: yes" in out.stdout, out.stdout
