"""DFlashConfig parsing (z-lab/HF and speculators) and drafter weight checks. CPU only, fast.

Layer ids, the default layer-id rule and the per-layer causal/window rule are checked against the
``dflash`` reference package where it is installed (pytest.importorskip)."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from dflash_ops.models import (
    DFlashConfig, check_drafter_state, default_target_layer_ids, expected_shapes, load_state,
    save_speculators, save_zlab, stack_kv, validate_fc, zlab_to_speculators,
)

SRC = "/ckpt/draft/config.json"


def tiny_zlab(**top) -> dict:
    """A tiny z-lab/HF DFlash config dict; keyword args override top-level keys
    (``dflash_config=`` replaces it, ``dc=`` updates it)."""
    d = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "attention_bias": False, "layer_types": ["full_attention"] * 2, "sliding_window": None,
        "use_sliding_window": False, "block_size": 4, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 60, "target_layer_ids": [1, 3]},
    }
    dc = top.pop("dc", None)
    d.update(top)
    if dc:
        d["dflash_config"] = {**d["dflash_config"], **dc}
    return d


def random_state(cfg: DFlashConfig, optional=()) -> dict:
    req, opt = expected_shapes(cfg)
    out = {n: torch.randn(s[0]) for n, s in req.items()}
    for n in optional:
        out[n] = torch.randn(opt[n][0])
    return out


def fields(cfg: DFlashConfig, drop=("source",)) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in drop}


# ------------------------------------------------------------------------------ round trips
def test_zlab_round_trip(tmp_path):
    d = tiny_zlab()
    cfg = DFlashConfig.from_dict(d, source=SRC)
    state = random_state(cfg, optional=("lm_head.weight", "embed_tokens.weight"))
    save_zlab(tmp_path, d, state)
    back = DFlashConfig.from_pretrained(tmp_path)
    assert back.source == os.path.join(str(tmp_path), "config.json")
    assert fields(back) == fields(cfg)
    assert DFlashConfig.from_pretrained(tmp_path / "config.json") == back
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (32, 2, 4, 2, 8)
    assert cfg.target_layer_ids == [1, 3] and cfg.mask_token_id == 60 and cfg.block_size == 4
    assert cfg.kv_width == 2 * 2 * 2 * 8 and cfg.n_taps == 2 and cfg.target_hidden_size == 32
    assert cfg.rotary_dim == 8 and cfg.rope_is_neox and cfg.model_type == "dflash"
    loaded = check_drafter_state(load_state(tmp_path), back, str(tmp_path))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_speculators_round_trip_matches_zlab(tmp_path):
    d = tiny_zlab(dc={"draft_vocab_size": None}, target_hidden_size=40)
    zcfg = DFlashConfig.from_dict(d, source=SRC)
    save_speculators(tmp_path, d, random_state(zcfg))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash"
    assert raw["aux_hidden_state_layer_ids"] == [2, 4]          # capture ids = z-lab ids + 1
    assert "dflash_config" not in raw["transformer_layer_config"]
    scfg = DFlashConfig.from_pretrained(tmp_path)
    assert scfg.target_layer_ids == zcfg.target_layer_ids == [1, 3]
    assert fields(scfg) == fields(zcfg)
    check_drafter_state(load_state(tmp_path), scfg)
    assert scfg.fc_in_features == 2 * 40


def test_speculators_layer_ids_shift_by_one():
    spec = zlab_to_speculators(tiny_zlab())
    spec["aux_hidden_state_layer_ids"] = [1, 9, 17, 25, 33]
    spec["transformer_layer_config"]["num_hidden_layers"] = 5
    spec["transformer_layer_config"]["layer_types"] = ["full_attention"] * 5
    spec["num_target_layers"] = 36
    cfg = DFlashConfig.from_dict(spec, source=SRC)
    assert cfg.target_layer_ids == [0, 8, 16, 24, 32]
    # the same ids written z-lab style are taken as they are
    z = tiny_zlab(num_hidden_layers=5, layer_types=["full_attention"] * 5, num_target_layers=36,
                  dc={"target_layer_ids": [0, 8, 16, 24, 32]})
    assert DFlashConfig.from_dict(z).target_layer_ids == cfg.target_layer_ids
    spec["aux_hidden_state_layer_ids"] = [0, 5]
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids") as e:
        DFlashConfig.from_dict(spec, source=SRC)
    assert SRC in str(e.value)


def test_speculators_defaults_and_fields():
    spec = zlab_to_speculators(tiny_zlab())
    for k in ("block_size", "sliding_window_non_causal"):
        spec.pop(k)
    spec["draft_vocab_size"] = 32
    cfg = DFlashConfig.from_dict(spec)
    assert cfg.block_size == 8                     # speculators' default
    assert cfg.draft_vocab_size == 32 and cfg.out_vocab_size == 32
    assert not cfg.sliding_non_causal              # speculators dflash default
    spec2 = dict(spec, speculators_model_type="dflash2")
    cfg2 = DFlashConfig.from_dict(spec2)
    assert cfg2.model_type == "dflash2" and cfg2.sliding_non_causal   # dflash2 default: True
    assert (cfg2.conv_kernel_size, cfg2.conv_group_size, cfg2.selector_rank,
            cfg2.selector_top_k) == (2, 16, 256, 16)
    for name, value in (("sample_from_anchor", True), ("projector_type", "domino"),
                        ("draft_ffn_type", "moe")):
        with pytest.raises(NotImplementedError, match=name):
            DFlashConfig.from_dict(dict(spec, **{name: value}), source=SRC)


# ------------------------------------------------------------------------------ layer ids
@pytest.mark.parametrize("n,l", [(36, 5), (36, 1), (64, 5), (52, 5), (24, 5), (28, 3), (40, 2),
                                 (80, 8), (9, 4)])
def test_default_layer_ids_match_reference(n, l):
    ref = pytest.importorskip("dflash.model")
    want = ref.build_target_layer_ids(n, l)
    assert default_target_layer_ids(n, l) == want
    d = tiny_zlab(num_hidden_layers=l, layer_types=["full_attention"] * l, num_target_layers=n,
                  dflash_config={"mask_token_id": 1})
    assert DFlashConfig.from_dict(d).target_layer_ids == want
    spec = zlab_to_speculators(d)
    spec.pop("aux_hidden_state_layer_ids")
    assert DFlashConfig.from_dict(spec).target_layer_ids == want


# ------------------------------------------------------------------------------ causal / window
MIXES = [["full_attention"] * 3, ["sliding_attention"] * 3,
         ["full_attention", "sliding_attention", "full_attention"],
         ["sliding_attention", "full_attention", "sliding_attention"]]


@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "".join(t[0] for t in m))
def test_causal_and_window_match_reference(mix, is_causal):
    ref = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    kw = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, intermediate_size=48, vocab_size=64, layer_types=mix, sliding_window=16,
              use_sliding_window=True)
    extra = {} if is_causal is None else {"is_causal": is_causal}
    hf = Qwen3Config(**kw, **extra)
    d = tiny_zlab(**kw, **extra)
    cfg = DFlashConfig.from_dict(d, source=SRC)
    for i in range(3):
        attn = ref.Qwen3DFlashAttention(hf, i)
        assert cfg.layer_causal(i) == attn.is_causal, (i, mix, is_causal)
        want_window = -1 if attn.sliding_window is None else attn.sliding_window
        assert cfg.layer_window(i) == want_window, (i, mix, is_causal)


def test_causal_extensions():
    mix = ["full_attention", "sliding_attention"]
    base = dict(layer_types=mix, sliding_window=8, use_sliding_window=True)
    cfg = DFlashConfig.from_dict(tiny_zlab(**base))
    assert [cfg.layer_causal(i) for i in range(2)] == [False, True]
    assert [cfg.layer_window(i) for i in range(2)] == [-1, 8]
    # DFlash 2: sliding layers bidirectional within the window; full layers unaffected
    cfg = DFlashConfig.from_dict(tiny_zlab(**base, sliding_window_non_causal=True))
    assert [cfg.layer_causal(i) for i in range(2)] == [False, False]
    cfg = DFlashConfig.from_dict(tiny_zlab(**base, dc={"sliding_window_non_causal": True}))
    assert [cfg.layer_causal(i) for i in range(2)] == [False, False]
    # vLLM's dflash_config.causal: a global override like the reference's is_causal
    cfg = DFlashConfig.from_dict(tiny_zlab(**base, dc={"causal": True}))
    assert [cfg.layer_causal(i) for i in range(2)] == [True, True]
    cfg = DFlashConfig.from_dict(tiny_zlab(**base, dc={"causal": False}))
    assert cfg.causal_override is False and not cfg.layer_causal(1)
    with pytest.raises(ValueError, match="is_causal") as e:
        DFlashConfig.from_dict(tiny_zlab(**base, is_causal=True, dc={"causal": False}), SRC)
    assert "dflash_config.causal" in str(e.value) and SRC in str(e.value)
    # speculators: sliding_window_non_causal, and an is_causal override
    spec = zlab_to_speculators(tiny_zlab(**base))
    assert DFlashConfig.from_dict(spec).layer_causal(1)
    spec["sliding_window_non_causal"] = True
    assert not DFlashConfig.from_dict(spec).layer_causal(1)
    spec["is_causal"] = True
    assert DFlashConfig.from_dict(spec).layer_causal(0)


def test_layer_types_derived_like_hf():
    d = tiny_zlab(num_hidden_layers=3, sliding_window=16, use_sliding_window=True,
                  max_window_layers=1)
    d.pop("layer_types")
    assert DFlashConfig.from_dict(d).layer_types == ["full_attention"] + ["sliding_attention"] * 2
    d["use_sliding_window"] = False
    assert DFlashConfig.from_dict(d).layer_types == ["full_attention"] * 3


def test_absent_sliding_flags_read_as_hf_qwen3config_does():
    """Qwen3Config's defaults: use_sliding_window False (an absent flag with a window and
    sliding layers is the same ambiguity as an explicit false: refused), sliding_window 4096
    (use_sliding_window true without a window: layers from max_window_layers on slide over
    4096, as HF derives them; before, every layer was full)."""
    from transformers import Qwen3Config
    d = tiny_zlab(layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    d.pop("use_sliding_window")
    with pytest.raises(ValueError, match=r"use_sliding_window \(absent: qwen3's default, "
                                         r"false\) is false but sliding_window=16"):
        DFlashConfig.from_dict(d, SRC)
    d = tiny_zlab(use_sliding_window=True, max_window_layers=1)
    for k in ("layer_types", "sliding_window"):
        d.pop(k)
    cfg = DFlashConfig.from_dict(d, SRC)
    hf = Qwen3Config(**{k: v for k, v in d.items() if k != "dflash_config"})
    assert cfg.layer_types == list(hf.layer_types) == ["full_attention", "sliding_attention"]
    assert [cfg.layer_window(i) for i in range(2)] == [-1, hf.sliding_window] == [-1, 4096]
    # another model type has no such default: an absent flag is not read as false
    d = tiny_zlab(model_type="mytype", layer_types=["full_attention", "sliding_attention"],
                  sliding_window=16)
    d.pop("use_sliding_window")
    assert DFlashConfig.from_dict(d, SRC).layer_window(1) == 16


def test_rope_fields():
    cfg = DFlashConfig.from_dict(tiny_zlab(rope_theta=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7}))
    assert cfg.rope_theta == 1e7 and cfg.rope_is_neox and cfg.rotary_dim == 8
    with pytest.warns(UserWarning, match="partial_rotary_factor"):
        cfg = DFlashConfig.from_dict(tiny_zlab(partial_rotary_factor=0.5))
    assert cfg.rotary_dim == 4
    assert not DFlashConfig.from_dict(tiny_zlab(rope_is_neox_style=False)).rope_is_neox
    assert not DFlashConfig.from_dict(tiny_zlab(dc={"is_neox_style": False})).rope_is_neox
    assert not DFlashConfig.from_dict(tiny_zlab(rope_interleaved=True)).rope_is_neox
    with pytest.raises(ValueError, match="is_neox_style") as e:
        DFlashConfig.from_dict(tiny_zlab(is_neox_style=True, rope_interleaved=True), SRC)
    assert SRC in str(e.value)
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(NotImplementedError, match=key) as e:
            DFlashConfig.from_dict(tiny_zlab(**{key: {"rope_type": "yarn", "factor": 4.0}}), SRC)
        assert SRC in str(e.value)
    with pytest.raises(ValueError, match="rope_theta"):
        DFlashConfig.from_dict(tiny_zlab(rope_parameters={"rope_theta": 5.0}), SRC)


def test_dflash2_zlab_fields():
    d = tiny_zlab(architectures=["DFlash2DraftModel"], dc={
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4,
        "input_embedding_scale": 2.0, "output_multiplier": 0.5, "final_logit_softcapping": 30.0,
        "attention_sink_bias": True})
    cfg = DFlashConfig.from_dict(d)
    assert cfg.model_type == "dflash2" and cfg.conv_group_size == 8 and cfg.selector_top_k == 4
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == \
        (2.0, 0.5, 30.0)
    assert cfg.attention_sinks
    assert DFlashConfig.from_dict(tiny_zlab(final_logit_softcapping=0.0)).final_logit_softcapping \
        is None
    spec = DFlashConfig.from_dict(zlab_to_speculators(d))
    assert fields(spec, drop=("source", "sliding_non_causal")) == \
        fields(cfg, drop=("source", "sliding_non_causal"))
    d2 = tiny_zlab(architectures=["DFlash2DraftModel"])
    with pytest.raises(ValueError, match="conv_kernel_size") as e:
        DFlashConfig.from_dict(d2, SRC)
    assert SRC in str(e.value)
    from dflash_ops.models.config import SELECTOR_TOP_K_MAX
    from dflash_ops.ops.select import TOPK_MAX
    assert SELECTOR_TOP_K_MAX == TOPK_MAX
    for top in (0, TOPK_MAX + 1):  # the selector's kernels take 1..TOPK_MAX candidates
        bad = tiny_zlab(architectures=["DFlash2DraftModel"], dc=dict(d["dflash_config"],
                                                                     selector_top_k=top))
        with pytest.raises(ValueError, match="selector_top_k") as e:
            DFlashConfig.from_dict(bad, SRC)
        assert SRC in str(e.value)


# ------------------------------------------------------------------------------ errors
def _dc_without(key):
    d = tiny_zlab()
    d["dflash_config"].pop(key)
    return d


ERRORS = [
    ("mask_token_id", lambda: _dc_without("mask_token_id")),
    ("mask_token_id", lambda: tiny_zlab(dc={"mask_token_id": 64})),
    ("target_layer_ids", lambda: {**_dc_without("target_layer_ids"), "num_target_layers": None}),
    ("target_layer_ids", lambda: tiny_zlab(num_target_layers=3)),
    ("target_layer_ids", lambda: tiny_zlab(dc={"target_layer_ids": []})),
    ("head_dim", lambda: {**tiny_zlab(hidden_size=30, model_type="llama"), "head_dim": None}),
    ("head_dim", lambda: {**tiny_zlab(), "head_dim": None}),      # qwen3: 32/4 = 8 vs HF's 128
    ("num_key_value_heads", lambda: tiny_zlab(num_key_value_heads=3)),
    ("layer_types", lambda: tiny_zlab(layer_types=["full_attention"] * 3)),
    ("layer_types", lambda: tiny_zlab(layer_types=["full_attention", "chunked_attention"])),
    ("sliding_window", lambda: tiny_zlab(layer_types=["sliding_attention", "full_attention"])),
    ("sliding_window", lambda: tiny_zlab(sliding_window=0, use_sliding_window=True)),
    ("use_sliding_window", lambda: tiny_zlab(layer_types=["sliding_attention"] * 2,
                                             sliding_window=8, use_sliding_window=False)),
    ("rotary_dim", lambda: tiny_zlab(partial_rotary_factor=0.375)),   # 8 * 0.375 = 3: odd
    ("partial_rotary_factor", lambda: tiny_zlab(partial_rotary_factor=2.0)),
    ("hidden_size", lambda: tiny_zlab(hidden_size=0)),
    ("hidden_size", lambda: {**tiny_zlab(), "hidden_size": None}),
    ("num_hidden_layers", lambda: tiny_zlab(num_hidden_layers="2")),
    ("intermediate_size", lambda: tiny_zlab(intermediate_size=-4)),
    ("block_size", lambda: tiny_zlab(block_size=0)),
    ("num_attention_heads", lambda: tiny_zlab(num_attention_heads=0)),
    ("draft_vocab_size", lambda: tiny_zlab(dc={"draft_vocab_size": 100})),
    ("speculators_model_type", lambda: {**zlab_to_speculators(tiny_zlab()),
                                        "speculators_model_type": "eagle3"}),
    ("aux_hidden_state_layer_ids", lambda: {
        k: v for k, v in zlab_to_speculators(tiny_zlab()).items()
        if k not in ("aux_hidden_state_layer_ids", "num_target_layers")}),
    ("mask_token_id", lambda: {**zlab_to_speculators(tiny_zlab()), "mask_token_id": None}),
    ("transformer_layer_config", lambda: {"speculators_model_type": "dflash", "mask_token_id": 1}),
    ("transformer_layer_config.num_key_value_heads", lambda: _spec_layer(num_key_value_heads=3)),
    ("transformer_layer_config.layer_types", lambda: _spec_layer(layer_types=["full_attention"])),
]


def _spec_layer(**layer):
    s = zlab_to_speculators(tiny_zlab())
    s["transformer_layer_config"].update(layer)
    return s


@pytest.mark.parametrize("field,make", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_config_errors_name_field_and_source(field, make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as e:
            DFlashConfig.from_dict(make(), source=SRC)
    assert field in str(e.value) and SRC in str(e.value), str(e.value)


def test_errors_from_file_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_dc_without("mask_token_id")))
    with pytest.raises(ValueError, match="mask_token_id") as e:
        DFlashConfig.from_pretrained(tmp_path)
    assert str(path) in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="JSON") as e:
        DFlashConfig.from_pretrained(path)
    assert str(path) in str(e.value)


def test_direct_construction_is_validated():
    base = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=64, mask_token_id=1, target_layer_ids=[0],
                source="direct")
    cfg = DFlashConfig(**base)
    assert cfg.rotary_dim == 8 and cfg.layer_types == ["full_attention"] * 2
    for change, field in (({"rotary_dim": 16}, "rotary_dim"), ({"rotary_dim": 5}, "rotary_dim"),
                          ({"model_type": "eagle"}, "model_type"),
                          ({"sliding_window": -1}, "sliding_window"),
                          ({"rope_theta": 0}, "rope_theta"),
                          ({"target_layer_ids": [-1]}, "target_layer_ids")):
        with pytest.raises(ValueError, match=field) as e:
            DFlashConfig(**{**base, **change})
        assert "direct" in str(e.value)
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        DFlashConfig(**base, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3


def test_validate_fc():
    cfg = DFlashConfig.from_dict(tiny_zlab(), source=SRC)
    validate_fc(cfg, (32, 64))
    with pytest.raises(ValueError, match="fc width vs taps x target hidden") as e:
        validate_fc(cfg, (32, 96), "/ckpt/model.safetensors")
    msg = str(e.value)
    assert "/ckpt/model.safetensors" in msg and "target_layer_ids" in msg and "3 taps" in msg
    with pytest.raises(ValueError, match="fc width") as e:
        validate_fc(cfg, (16, 64))
    assert SRC in str(e.value)


# ------------------------------------------------------------------------------ real shapes
def qwen3_8b_dflash_b16() -> dict:
    """Qwen3-8B-DFlash-b16's config.json, as shipped (z-lab format; kept once, beside the
    drafter benchmark that uses it)."""
    import copy

    from dflash_ops.bench.drafter import QWEN3_8B_DFLASH

    return copy.deepcopy(QWEN3_8B_DFLASH)


def qwen38_27b_dflash2(non_causal_key="is_causal") -> dict:
    """Qwen3.8-27B-DFlash2 as published (sliding 2048, non-causal; bench.dflash2_step holds
    it); the exact key that makes it non-causal is not known here, so both spellings are
    tested."""
    import copy

    from dflash_ops.bench.dflash2_step import QWEN38_27B_DFLASH2

    d = copy.deepcopy(QWEN38_27B_DFLASH2)
    if non_causal_key != "is_causal":
        del d["is_causal"]
        d[non_causal_key] = True
    return d


def test_real_qwen3_8b_dflash_b16():
    cfg = DFlashConfig.from_dict(qwen3_8b_dflash_b16(), source="Qwen3-8B-DFlash-b16")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.block_size, cfg.mask_token_id) == \
        (4096, 5, 32, 8, 128, 12288, 151936, 16, 151669)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] == default_target_layer_ids(36, 5)
    assert cfg.rope_theta == 1e6 and cfg.rotary_dim == 128 and cfg.rope_is_neox
    assert cfg.kv_width == 5 * 2 * 8 * 128 and cfg.fc_in_features == 5 * 4096
    assert cfg.model_type == "dflash" and not cfg.attention_sinks
    assert all(not cfg.layer_causal(i) and cfg.layer_window(i) == -1 for i in range(5))
    validate_fc(cfg, (4096, 20480))
    req, _ = expected_shapes(cfg)
    assert len(req) == 5 * 11 + 3
    assert req["layers.4.self_attn.k_proj.weight"] == [(1024, 4096)]
    # the same drafter in speculators format
    spec = DFlashConfig.from_dict(zlab_to_speculators(qwen3_8b_dflash_b16()))
    assert spec.target_layer_ids == [1, 9, 17, 25, 33]
    assert zlab_to_speculators(qwen3_8b_dflash_b16())["aux_hidden_state_layer_ids"] == \
        [2, 10, 18, 26, 34]


@pytest.mark.parametrize("key", ["is_causal", "sliding_window_non_causal"])
def test_real_qwen38_27b_dflash2(key):
    cfg = DFlashConfig.from_dict(qwen38_27b_dflash2(key), source="Qwen3.8-27B-DFlash2")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.block_size, cfg.mask_token_id) == \
        (5120, 5, 32, 8, 128, 17408, 248320, 8, 248070)
    assert cfg.target_layer_ids == [5, 19, 33, 47, 61] and cfg.num_target_layers == 64
    assert cfg.rope_theta == 1e7 and cfg.model_type == "dflash2"
    assert cfg.kv_width == 10240 and cfg.fc_in_features == 5 * 5120
    assert all(cfg.layer_window(i) == 2048 and not cfg.layer_causal(i) for i in range(5))
    req, _ = expected_shapes(cfg)  # a DFlash 2 checkpoint must ship its conv and selector
    assert req["layers.0.attention_conv.kernel_projection.weight"] == [(2 * 2 * 320, 5120)]
    assert req["candidate_selector.hidden_projection.weight"] == [(256, 5120)]
    assert req["candidate_selector.predecessor_codebook.weight"] == [(248320, 256)]
    # speculators form: non-causal sliding layers either way
    spec = DFlashConfig.from_dict(zlab_to_speculators(qwen38_27b_dflash2(key)))
    assert spec.target_layer_ids == cfg.target_layer_ids
    assert all(spec.layer_window(i) == 2048 and not spec.layer_causal(i) for i in range(5))
    # without the flag the sliding layers would be causal (the reference's default)
    d = qwen38_27b_dflash2(key)
    d.pop(key)
    assert all(DFlashConfig.from_dict(d).layer_causal(i) for i in range(5))


# ------------------------------------------------------------------------------ weights
def test_weights_all_problems_in_one_error():
    cfg = DFlashConfig.from_dict(tiny_zlab(), source=SRC)
    state = random_state(cfg)
    state.pop("layers.0.self_attn.k_norm.weight")
    state.pop("hidden_norm.weight")
    state["foo.bar"] = torch.zeros(3)
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(48, 31)
    state["fc.weight"] = torch.zeros(32, 96)
    with pytest.raises(ValueError) as e:
        check_drafter_state(state, cfg, "/ckpt/model.safetensors")
    msg = str(e.value)
    for part in ("/ckpt/model.safetensors", SRC, "5 problem(s)",
                 "missing: layers.0.self_attn.k_norm.weight (expected [8])",
                 "missing: hidden_norm.weight", "unexpected: foo.bar [3]",
                 "wrong shape: layers.1.mlp.up_proj.weight: expected [48, 32], got [48, 31]",
                 "fc width vs taps x target hidden", "3 taps"):
        assert part in msg, (part, msg)


def test_weights_prefix_optional_and_variants():
    cfg = DFlashConfig.from_dict(tiny_zlab(dc={"draft_vocab_size": 16}))
    state = random_state(cfg, optional=("lm_head.weight", "embed_tokens.weight"))
    assert state["lm_head.weight"].shape == (16, 32)
    state["d2t"] = torch.arange(16)
    state["mask_embedding"] = torch.randn(1, 32)
    hf = {("model." + k if not k.startswith("lm_head") else k): v for k, v in state.items()}
    hf["model.rotary_emb.inv_freq"] = torch.randn(4)           # old HF buffers are dropped
    norm = check_drafter_state(hf, cfg)
    assert norm.keys() == state.keys()
    bad = dict(state, d2t=torch.zeros(16))
    with pytest.raises(ValueError, match="d2t"):
        check_drafter_state(bad, cfg)
    dup = dict(state, **{"model.norm.weight": torch.randn(32)})
    with pytest.raises(ValueError, match="duplicate"):
        check_drafter_state(dup, cfg)
    # biases required with attention_bias; dflash2 extras only for dflash2; sinks when enabled
    bcfg = DFlashConfig.from_dict(tiny_zlab(attention_bias=True))
    with pytest.raises(ValueError, match="missing: layers.0.self_attn.o_proj.bias"):
        check_drafter_state(random_state(cfg), bcfg)
    extra = dict(random_state(cfg), **{"layers.0.attention_conv.base_kernel": torch.zeros(2, 2, 32)})
    with pytest.raises(ValueError, match="unexpected: layers.0.attention_conv.base_kernel"):
        check_drafter_state(extra, cfg)
    scfg = DFlashConfig.from_dict(tiny_zlab(dc={"attention_sink_bias": True}))
    with pytest.raises(ValueError, match="missing: layers.1.self_attn.sinks .expected .4.."):
        check_drafter_state(random_state(cfg), scfg)
    check_drafter_state(random_state(scfg), scfg)


def test_weights_dflash2_extras():
    cfg = DFlashConfig.from_dict(tiny_zlab(architectures=["DFlash2DraftModel"], dc={
        "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 4}))
    state = random_state(cfg)
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            state[f"layers.{i}.{conv}.base_kernel"] = torch.randn(2, 3, 32)
            state[f"layers.{i}.{conv}.kernel_projection.weight"] = torch.randn(2 * 3 * 4, 32)
    state.pop("candidate_selector.predecessor_codebook.weight")
    state["candidate_selector.predecessor_codebook"] = torch.randn(64, 6)   # as the checkpoint
    state["candidate_selector.successor_codebook.weight"] = torch.randn(64, 6)
    state["candidate_selector.hidden_projection.weight"] = torch.randn(6, 32)
    norm = check_drafter_state(state, cfg)
    assert "candidate_selector.predecessor_codebook.weight" in norm
    state["layers.1.mlp_conv.base_kernel"] = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match=r"mlp_conv.base_kernel: expected \[2, 3, 32\]"):
        check_drafter_state(state, cfg)


def test_sharded_index_loading(tmp_path):
    d = tiny_zlab()
    cfg = DFlashConfig.from_dict(d)
    state = random_state(cfg)
    save_zlab(tmp_path, d, state, shards=3)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) == 3
    loaded = load_state(tmp_path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    check_drafter_state(loaded, DFlashConfig.from_pretrained(tmp_path))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["norm.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00009-of-00009"):
        load_state(tmp_path)
    one = tmp_path / "single.safetensors"
    from safetensors.torch import save_file
    save_file({"a": torch.ones(2)}, str(one))
    assert torch.equal(load_state(one)["a"], torch.ones(2))
    with pytest.raises(FileNotFoundError):
        load_state(tmp_path / "nope")


@pytest.mark.parametrize("bias", [False, True])
def test_stack_kv_order(bias):
    d = tiny_zlab(attention_bias=bias, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    cfg = DFlashConfig.from_dict(d)
    state = random_state(cfg)
    w_kv, b_kv, k_weight = stack_kv(state, cfg)
    L, hkv, D, H = 3, 2, 8, 32
    assert w_kv.shape == (cfg.kv_width, H) and k_weight.shape == (L, D)
    blocks = w_kv.view(L, 2, hkv * D, H)
    for i in range(L):
        a = f"layers.{i}.self_attn."
        assert torch.equal(blocks[i, 0], state[a + "k_proj.weight"])
        assert torch.equal(blocks[i, 1], state[a + "v_proj.weight"])
        assert torch.equal(k_weight[i], state[a + "k_norm.weight"])
    if bias:
        bb = b_kv.view(L, 2, hkv * D)
        for i in range(L):
            assert torch.equal(bb[i, 0], state[f"layers.{i}.self_attn.k_proj.bias"])
            assert torch.equal(bb[i, 1], state[f"layers.{i}.self_attn.v_proj.bias"])
    else:
        assert b_kv is None
    # one GEMM == the per-layer projections, viewed [T, L, 2, Hkv, D]
    x = torch.randn(5, H, dtype=torch.float64)
    kv = F.linear(x, w_kv.double(), None if b_kv is None else b_kv.double()).view(5, L, 2, hkv, D)
    for i in range(L):
        a = f"layers.{i}.self_attn."
        for j, p in enumerate(("k_proj", "v_proj")):
            want = F.linear(x, state[a + p + ".weight"].double(),
                            state[a + p + ".bias"].double() if bias else None)
            torch.testing.assert_close(kv[:, i, j].reshape(5, -1), want)
    # dtype conversion, and HF-prefixed names
    w16, _, kw16 = stack_kv({"model." + k: v for k, v in state.items()}, cfg, torch.bfloat16)
    assert w16.dtype == kw16.dtype == torch.bfloat16
    assert torch.equal(w16, w_kv.to(torch.bfloat16))


def test_config_is_not_mutated_by_parsing():
    d = tiny_zlab(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    before = copy.deepcopy(d)
    DFlashConfig.from_dict(d)
    zlab_to_speculators(d)
    assert d == before
