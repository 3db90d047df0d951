"""The target model (``dflash_ops.models.target``) against transformers' Qwen3ForCausalLM and
LlamaForCausalLM given the same random weights, on CPU in fp32 with the torch backend.

Two ragged requests in non-consecutive cache slots (block size 4, so they span several blocks):
a prefill, then decode / verify chunks of 1 and 4 tokens in one forward; logits at every new
position equal HF's full-sequence logits, and taps equal HF ``hidden_states[i + 1]``. Also: tied
embeddings and attention biases, rejected verify tokens left in the cache, loading HF checkpoints
(``save_pretrained``, single and sharded safetensors), and config / weight errors that name the
field or the tensors.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dflash_ops.models.target import (  # noqa: E402
    Target, TargetConfig, check_target_state, random_state,
)

VOCAB, H, LAYERS = 101, 64, 3
ATOL = 1e-4
CACHE = dict(num_blocks=40, block_size=4, max_requests=4, max_len=64)


def _hf_dict(model_type="qwen3", tie=False, bias=False, **over):
    d = dict(model_type=model_type, hidden_size=H, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
             vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=1000.0, tie_word_embeddings=tie, attention_bias=bias)
    d.update(over)
    return d


def _hf_model(d, state):
    cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[d["model_type"]]
    conf = cls[0](**{k: v for k, v in d.items() if k != "model_type"})
    conf._attn_implementation = "eager"
    model = cls[1](conf).eval()
    res = model.load_state_dict(state, strict=False)
    assert not res.unexpected_keys, res
    assert set(res.missing_keys) <= ({"lm_head.weight"} if d["tie_word_embeddings"] else set()), res
    if d["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _hf_run(model, ids):
    """(logits [L, V], hidden_states tuple of [L, H]) of one full sequence."""
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def _setup(d, seed=0):
    cfg = TargetConfig.from_hf(d)
    state = random_state(cfg, seed)
    return cfg, state, _hf_model(d, state), Target(cfg, state, dtype=torch.float32, **CACHE)


CASES = [("qwen3", False, False), ("qwen3", True, True), ("llama", False, False),
         ("llama", True, True)]


@pytest.mark.parametrize("model_type,tie,bias", CASES)
def test_prefill_then_decode_and_verify_match_hf(model_type, tie, bias):
    d = _hf_dict(model_type, tie, bias)
    cfg, _, hf, tgt = _setup(d, seed=3)
    assert cfg.qk_norm == (model_type == "qwen3") and cfg.tie_word_embeddings == tie
    if tie:
        assert tgt.lm_head is tgt.embed
    slots, prompt_lens, chunks = [2, 0], [7, 5], [[1, 4], [4, 1]]
    total = [p + sum(c[i] for c in chunks) for i, p in enumerate(prompt_lens)]
    seqs = [torch.randint(0, VOCAB, (n,)) for n in total]
    ref = [_hf_run(hf, s) for s in seqs]
    for r in slots:
        tgt.add_request(r)

    taps_ids = [2, 0, 1]   # order on purpose; 2 is the last layer (see the tap test below)
    starts = [0, 0]
    for step, q_lens in enumerate([prompt_lens] + chunks):
        ids = torch.cat([s[st:st + q] for s, st, q in zip(seqs, starts, q_lens)])
        logits, taps = tgt.forward(ids, slots, starts, q_lens, taps_ids if step < 2 else None)
        assert logits.dtype == torch.float32 and logits.shape == (sum(q_lens), VOCAB)
        assert (taps is None) == (step >= 2)
        row = 0
        for i, (st, q) in enumerate(zip(starts, q_lens)):
            ref_logits, ref_hidden = ref[i]
            torch.testing.assert_close(logits[row:row + q], ref_logits[st:st + q], atol=ATOL,
                                       rtol=1e-4, msg=lambda m: f"step {step} request {i}: {m}")
            if taps is not None:
                assert taps.shape == (sum(q_lens), len(taps_ids) * H)
                for j, layer in enumerate(taps_ids):
                    if layer == cfg.num_layers - 1:
                        continue   # HF's last hidden state is after the final norm
                    torch.testing.assert_close(taps[row:row + q, j * H:(j + 1) * H],
                                               ref_hidden[layer + 1][st:st + q], atol=ATOL,
                                               rtol=1e-4)
            row += q
        starts = [s + q for s, q in zip(starts, q_lens)]


def test_last_layer_tap_is_before_the_final_norm():
    """Tap id N-1 is the decoder layer's output (pre-norm); HF's hidden_states[N] is the normed
    one, so norm(tap) equals it."""
    d = _hf_dict()
    cfg, _, hf, tgt = _setup(d, seed=5)
    tgt.add_request(1)
    ids = torch.randint(0, VOCAB, (6,))
    _, taps = tgt.forward(ids, [1], [0], [6], [cfg.num_layers - 1])
    _, ref_hidden = _hf_run(hf, ids)
    normed = torch.ops.dflash.rms_norm(taps, tgt.norm, cfg.rms_norm_eps)
    torch.testing.assert_close(normed, ref_hidden[cfg.num_layers], atol=ATOL, rtol=1e-4)
    assert not torch.allclose(taps, ref_hidden[cfg.num_layers], atol=1e-2)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_rejected_verify_tokens_are_never_seen(model_type):
    """Verify 4 tokens, keep 2: the next forward at position 8 (overwriting positions 8.. of the
    block) gives the logits and taps of a fresh run that never saw the rejected tokens."""
    d = _hf_dict(model_type)
    cfg = TargetConfig.from_hf(d)
    a = Target.random(cfg, seed=7, dtype=torch.float32, **CACHE)
    b = Target.random(cfg, seed=7, dtype=torch.float32, **CACHE)
    prompt = torch.randint(0, VOCAB, (6,))
    block = torch.randint(0, VOCAB, (4,))
    nxt = torch.randint(0, VOCAB, (3,))
    a.add_request(3)
    a.forward(prompt, [3], [0], [6])
    a.forward(block, [3], [6], [4])          # verify [d1..d4], keep d1, d2
    got, got_taps = a.forward(nxt, [3], [8], [3], [0, 1])

    b.add_request(1)
    b.forward(torch.cat([prompt, block[:2]]), [1], [0], [8])
    want, want_taps = b.forward(nxt, [1], [8], [3], [0, 1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_taps, want_taps, atol=1e-5, rtol=1e-5)

    # and both equal HF on the committed sequence
    hf = _hf_model(d, random_state(cfg, 7))
    ref, _ = _hf_run(hf, torch.cat([prompt, block[:2], nxt]))
    torch.testing.assert_close(got, ref[8:], atol=ATOL, rtol=1e-4)


def test_freed_slot_is_reusable():
    cfg = TargetConfig.from_hf(_hf_dict())
    tgt = Target.random(cfg, seed=1, dtype=torch.float32, **CACHE)
    ids = torch.randint(0, VOCAB, (5,))
    tgt.add_request(0)
    first, _ = tgt.forward(ids, [0], [0], [5])
    tgt.free_request(0)
    tgt.add_request(0)
    again, _ = tgt.forward(ids, [0], [0], [5])
    torch.testing.assert_close(first, again)


def test_logit_rows_selects_rows():
    """logit_rows computes only the chosen rows' logits (a prefill's last rows): the same values
    as those rows of the full logits, taps unchanged, [N, V]."""
    cfg = TargetConfig.from_hf(_hf_dict())
    tgt = Target.random(cfg, seed=3, dtype=torch.float32, **CACHE)
    ids = torch.randint(0, VOCAB, (9,))
    rows = torch.tensor([3, 8])  # the last row of requests of 4 and 5 tokens
    for r in (0, 1):
        tgt.add_request(r)
    full, full_taps = tgt.forward(ids, [0, 1], [0, 0], [4, 5], [0])
    for r in (0, 1):
        tgt.free_request(r)
        tgt.add_request(r)
    got, taps = tgt.forward(ids, [0, 1], [0, 0], [4, 5], [0], logit_rows=rows)
    assert got.shape == (2, full.shape[1])
    torch.testing.assert_close(got, full[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(taps, full_taps)


@pytest.mark.parametrize("tie", [False, True])
def test_from_pretrained_of_hf_save_pretrained(tmp_path, tie):
    d = _hf_dict("qwen3", tie)
    cfg, state, hf, tgt = _setup(d, seed=11)
    hf.save_pretrained(tmp_path)
    loaded = Target.from_pretrained(tmp_path, dtype=torch.float32, **CACHE)
    assert loaded.cfg == TargetConfig(**{**cfg.__dict__, "source": str(tmp_path / "config.json")})
    ids = torch.randint(0, VOCAB, (7,))
    for t in (tgt, loaded):
        t.add_request(0)
    got, _ = loaded.forward(ids, [0], [0], [7])
    want, _ = tgt.forward(ids, [0], [0], [7])
    torch.testing.assert_close(got, want)


def test_from_pretrained_sharded(tmp_path):
    from safetensors.torch import save_file

    d = _hf_dict("llama")
    cfg = TargetConfig.from_hf(d)
    state = random_state(cfg, 2)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, ns in shards.items():
        save_file({n: state[n] for n in ns}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    (tmp_path / "config.json").write_text(json.dumps(d))
    loaded = Target.from_pretrained(tmp_path, dtype=torch.float32, **CACHE)
    direct = Target(cfg, state, dtype=torch.float32, **CACHE)
    ids = torch.randint(0, VOCAB, (5,))
    for t in (loaded, direct):
        t.add_request(1)
    torch.testing.assert_close(loaded.forward(ids, [1], [0], [5])[0],
                               direct.forward(ids, [1], [0], [5])[0])


# ------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize("change,exc,words", [
    (dict(model_type="mistral"), ValueError, ["model_type", "mistral"]),
    (dict(model_type=None), ValueError, ["model_type"]),
    (dict(hidden_size=None), ValueError, ["hidden_size", "missing"]),
    (dict(num_hidden_layers="3"), ValueError, ["num_hidden_layers"]),
    (dict(num_key_value_heads=3), ValueError, ["num_key_value_heads"]),
    (dict(head_dim=24), ValueError, ["head_dim", "24"]),
    (dict(rope_theta=-1.0), ValueError, ["rope_theta"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), NotImplementedError,
     ["rope_scaling", "llama3"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0}),
     NotImplementedError, ["rope_parameters", "yarn"]),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0}), ValueError,
     ["rope_theta", "disagree"]),
    (dict(partial_rotary_factor=0.5), NotImplementedError, ["partial_rotary_factor"]),
    (dict(hidden_act="gelu"), NotImplementedError, ["hidden_act", "gelu"]),
    (dict(mlp_bias=True), NotImplementedError, ["mlp_bias"]),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), NotImplementedError,
     ["use_sliding_window", "[1, 2]"]),
])
def test_config_errors_name_the_field(tmp_path, change, exc, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf_dict(**change)))
    with pytest.raises(exc) as e:
        TargetConfig.from_hf(tmp_path)
    msg = str(e.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg


def test_config_reads_hf_defaults_and_rope_parameters():
    d = _hf_dict("llama")
    for k in ("head_dim", "num_key_value_heads", "rope_theta", "max_position_embeddings"):
        d.pop(k)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    cfg = TargetConfig.from_hf(d)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.max_position_embeddings) == \
        (H // 4, 4, 5e5, 2048)
    q = _hf_dict("qwen3")
    for k in ("head_dim", "rope_theta"):
        q.pop(k)
    cfg = TargetConfig.from_hf(q)   # HF Qwen3Config defaults: head_dim 128, theta 1e4
    assert (cfg.head_dim, cfg.rope_theta) == (128, 10000.0)
    with pytest.raises(FileNotFoundError, match="no such config"):
        TargetConfig.from_hf("/nonexistent/dir")


# ------------------------------------------------------------------------------ weight errors
def test_weight_errors_list_every_bad_tensor():
    cfg = TargetConfig.from_hf(_hf_dict())
    state = random_state(cfg, 0)
    del state["model.layers.1.self_attn.k_norm.weight"]
    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(5, H)
    state["model.layers.9.extra.weight"] = torch.zeros(1)
    state["model.rotary_emb.inv_freq"] = torch.zeros(8)   # old HF buffers are ignored
    with pytest.raises(ValueError) as e:
        Target(cfg, state, dtype=torch.float32, **CACHE)
    msg = str(e.value)
    for w in ("<dict>", "missing", "model.layers.1.self_attn.k_norm.weight", "unexpected",
              "model.layers.9.extra.weight", "model.layers.0.mlp.gate_proj.weight", "[5, 64]",
              "[96, 64]"):
        assert w in msg, msg
    assert "inv_freq" not in msg


def test_weight_errors_llama_has_no_qk_norm_and_untied_needs_lm_head():
    llama = TargetConfig.from_hf(_hf_dict("llama"))
    qwen_state = random_state(TargetConfig.from_hf(_hf_dict("qwen3")), 0)
    with pytest.raises(ValueError, match="unexpected.*q_norm"):
        check_target_state(qwen_state, llama)
    state = random_state(llama, 0)
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        check_target_state(state, llama)


def test_tied_checkpoint_may_store_lm_head_but_it_must_match():
    cfg = TargetConfig.from_hf(_hf_dict(tie=True))
    state = random_state(cfg, 0)
    assert "lm_head.weight" not in state
    check_target_state({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
                       cfg)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        check_target_state({**state, "lm_head.weight": torch.zeros(VOCAB, H)}, cfg)


def test_forward_argument_errors():
    cfg = TargetConfig.from_hf(_hf_dict())
    tgt = Target.random(cfg, seed=0, dtype=torch.float32, **CACHE)
    tgt.add_request(0)
    ids = torch.randint(0, VOCAB, (4,))
    with pytest.raises(ValueError, match="sum to 3"):
        tgt.forward(ids, [0], [0], [3])
    with pytest.raises(ValueError, match="one entry per request"):
        tgt.forward(ids, [0, 1], [0], [4])
    with pytest.raises(ValueError, match=r"tap_layers \[3\]"):
        tgt.forward(ids, [0], [0], [4], [0, 3])
    _, taps = tgt.forward(ids, [0], [0], [4], [])
    assert taps.shape == (4, 0)
