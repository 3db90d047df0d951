"""Malformed checkpoints are refused at load with a one-line ValueError naming the file or the
tensor: shard paths escaping the directory, malformed index entries, non-floating weights,
corrupt safetensors, non-UTF-8 / misplaced config paths, a d2t map leading out of the target
vocabulary; and a huge max_position_embeddings allocates a capped RoPE table. CPU only."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dflash_ops.models import DFlashConfig, check_drafter_state, load_state, save_zlab
from dflash_ops.models.drafter import DFlashDrafter, random_drafter_state
from dflash_ops.models.hf_config import ROPE_TABLE_MIN_CAP
from dflash_ops.models.target import Target, TargetConfig, random_state
from dflash_ops.models.weights import save_speculators

from .test_models_config import tiny_zlab

INDEX = "model.safetensors.index.json"


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _sharded(tmp_path, **over):
    d = tiny_zlab(**over)
    cfg = DFlashConfig.from_dict(d)
    save_zlab(tmp_path, d, random_drafter_state(cfg), shards=2)
    return d, cfg


def _set_index(tmp_path, fn):
    p = tmp_path / INDEX
    index = json.loads(p.read_text())
    fn(index)
    p.write_text(json.dumps(index))


# ------------------------------------------------------------------------------ 1. shard paths
@pytest.mark.parametrize("where", ["parent", "absolute", "dotdot_inside", "dir_symlink"])
def test_shard_outside_checkpoint_dir_refused(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    _sharded(ckpt)
    save_file({"norm.weight": torch.ones(32)}, str(tmp_path / "outside.safetensors"))
    shard = {"parent": "../outside.safetensors", "absolute": str(tmp_path / "outside.safetensors"),
             "dotdot_inside": "sub/../../outside.safetensors",
             "dir_symlink": "link/outside.safetensors"}[where]
    if where == "dir_symlink":
        os.symlink(tmp_path, ckpt / "link")
    _set_index(ckpt, lambda ix: ix["weight_map"].__setitem__("norm.weight", shard))
    with pytest.raises(ValueError, match="inside the checkpoint directory") as e:
        load_state(ckpt)
    msg = _one_line(e)
    assert INDEX in msg and "norm.weight" in msg and repr(shard) in msg


def test_shard_etc_hostname_never_opened(tmp_path):
    _sharded(tmp_path)
    _set_index(tmp_path, lambda ix: ix["weight_map"].__setitem__("norm.weight", "/etc/hostname"))
    with pytest.raises(ValueError, match=r"'/etc/hostname': expected a file inside"):
        load_state(tmp_path)


def test_shard_file_symlink_like_hf_cache_still_loads(tmp_path):
    """HF hub snapshots link each file to ../../blobs/<hash>: a symlinked file is followed."""
    snap, blobs = tmp_path / "snapshots" / "rev", tmp_path / "blobs"
    _, cfg = _sharded(snap)
    blobs.mkdir()
    for f in snap.glob("*.safetensors"):
        os.replace(f, blobs / f.name)
        os.symlink(os.path.join("..", "..", "blobs", f.name), f)
    check_drafter_state(load_state(snap), cfg)


# ------------------------------------------------------------------------------ 2. index types
@pytest.mark.parametrize("weight_map,want", [
    (["norm.weight"], "weight_map: expected a JSON object .* got list"),
    ("model.safetensors", "weight_map: expected a JSON object .* got str"),
    ({"norm.weight": 3}, r"weight_map\['norm.weight'\]: expected a shard file name .* got int 3"),
    ({"norm.weight": None}, r"expected a shard file name \(string\), got NoneType"),
])
def test_index_weight_map_types(tmp_path, weight_map, want):
    _sharded(tmp_path)
    _set_index(tmp_path, lambda ix: ix.__setitem__("weight_map", weight_map))
    with pytest.raises(ValueError, match=want) as e:
        load_state(tmp_path)
    assert INDEX in _one_line(e)


# ------------------------------------------------------------------------------ 3. dtypes
@pytest.mark.parametrize("name,bad", [
    ("fc.weight", lambda t: t.to(torch.int32)),
    ("norm.weight", lambda t: t > 0),
    ("mask_embedding", lambda t: t.long()),
])
def test_non_floating_weight_refused(tmp_path, name, bad):
    d = tiny_zlab()
    cfg = DFlashConfig.from_dict(d)
    state = random_drafter_state(cfg)
    state["mask_embedding"] = torch.randn(cfg.hidden_size)
    state[name] = bad(state[name])
    save_zlab(tmp_path, d, state)
    with pytest.raises(ValueError, match=f"{name} is {bad(torch.ones(1)).dtype}") as e:
        load_state(tmp_path)
    assert os.path.join(str(tmp_path), "model.safetensors") in _one_line(e)
    with pytest.raises(ValueError, match=f"{name} is "):   # in-memory dicts too
        check_drafter_state(state, cfg, "/ckpt/config.json")


def test_non_floating_target_weight_refused():
    cfg = TargetConfig.from_hf(dict(model_type="qwen3", hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    intermediate_size=48, vocab_size=50))
    state = random_state(cfg)
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    with pytest.raises(ValueError, match="model.norm.weight is torch.int32"):
        Target(cfg, state, dtype=torch.float32, num_blocks=4, block_size=4, max_len=16)


def test_integer_maps_still_accepted(tmp_path):
    d = tiny_zlab(draft_vocab_size=16)
    cfg = DFlashConfig.from_dict(d)
    state = random_drafter_state(cfg)
    state["d2t"] = torch.arange(16, dtype=torch.int64) * 2
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    save_zlab(tmp_path, d, state)
    check_drafter_state(load_state(tmp_path), cfg)


# ------------------------------------------------------------------------------ 4. corrupt files
def _corrupt(kind: str, good: bytes) -> bytes:
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    if kind == "truncated":
        return good[:len(good) // 2]
    if kind == "empty":
        return b""
    if kind == "header_len":
        return (1 << 60).to_bytes(8, "little") + good[8:]
    name = next(k for k in header if k != "__metadata__")
    if kind == "dtype":
        header[name]["dtype"] = "F99"
    else:  # offsets past the end of the data
        header[name]["data_offsets"] = [0, 1 << 30]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + good[8 + n:]


@pytest.mark.parametrize("kind", ["truncated", "empty", "header_len", "dtype", "offsets"])
@pytest.mark.parametrize("sharded", [False, True])
def test_corrupt_safetensors_names_the_file(tmp_path, kind, sharded):
    d = tiny_zlab()
    save_zlab(tmp_path, d, random_drafter_state(DFlashConfig.from_dict(d)),
              shards=2 if sharded else 1)
    file = sorted(tmp_path.glob("*.safetensors"))[0]
    file.write_bytes(_corrupt(kind, file.read_bytes()))
    for path in (tmp_path, file):
        with pytest.raises(ValueError, match="not a valid safetensors file") as e:
            load_state(path)
        assert str(file) in _one_line(e)


# ------------------------------------------------------------------------------ 5. config paths
def test_config_not_utf8_or_path_to_weights(tmp_path):
    d = tiny_zlab()
    save_zlab(tmp_path, d, random_drafter_state(DFlashConfig.from_dict(d)))
    weights = tmp_path / "model.safetensors"
    for load in (DFlashConfig.from_pretrained, TargetConfig.from_hf):
        with pytest.raises(ValueError, match="expected a checkpoint directory holding "
                                             "config.json") as e:
            load(weights)
        assert str(weights) in _one_line(e)
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"model_type": "\xff\xfe"}')
    for path in (tmp_path, cfg):
        with pytest.raises(ValueError, match="config.json must be UTF-8 JSON") as e:
            DFlashConfig.from_pretrained(path)
        assert str(cfg) in _one_line(e)


# ------------------------------------------------------------------------------ 6. d2t range
@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
@pytest.mark.parametrize("i,off", [(15, 100), (0, -1), (3, 10 ** 6)])
def test_d2t_outside_target_vocab_refused_at_load(tmp_path, fmt, i, off):
    d = tiny_zlab(draft_vocab_size=16)
    cfg = DFlashConfig.from_dict(d)
    state = random_drafter_state(cfg)
    state["d2t"] = torch.zeros(16, dtype=torch.int64)
    state["d2t"][i] = off
    (save_zlab if fmt == "zlab" else save_speculators)(tmp_path, d, state)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    embed, head = torch.randn(cfg.vocab_size, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match=rf"d2t: .*vocab_size=64.*d2t\[{i}\] = {off} ") as e:
        DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=embed, lm_head=head,
                      dtype=torch.float32, num_blocks=4, cache_block_size=4, max_len=16)
    assert str(cfg.source) in _one_line(e)


# ------------------------------------------------------------------------------ 7. RoPE table
@pytest.mark.parametrize("mpe", [10 ** 6, 10 ** 9, 1e9])
def test_huge_max_position_embeddings_caps_rope_table(tmp_path, mpe):
    d = tiny_zlab(max_position_embeddings=mpe)
    cfg = DFlashConfig.from_dict(d)
    save_zlab(tmp_path, d, random_drafter_state(cfg))
    cfg = DFlashConfig.from_pretrained(tmp_path)
    drafter = DFlashDrafter(cfg, load_state(tmp_path), embed_tokens=torch.randn(64, 32),
                            lm_head=torch.randn(64, 32), dtype=torch.float32, num_blocks=4,
                            cache_block_size=4, max_len=16)
    want = min(int(mpe), ROPE_TABLE_MIN_CAP)  # the cache's 16 positions are fewer
    assert drafter.cos_sin.shape == (want, cfg.rotary_dim)
    tcfg = TargetConfig.from_hf(dict(model_type="llama", hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     intermediate_size=48, vocab_size=50,
                                     max_position_embeddings=mpe))
    tgt = Target(tcfg, random_state(tcfg), dtype=torch.float32, num_blocks=4, block_size=4,
                 max_len=16)
    assert tgt.cos_sin.shape == (want, 16)
    big = Target(tcfg, random_state(tcfg), dtype=torch.float32, num_blocks=4, block_size=4,
                 max_len=ROPE_TABLE_MIN_CAP + 8)   # a cache larger than the cap: its size
    assert big.cos_sin.shape == (ROPE_TABLE_MIN_CAP + 8, 16)


def test_rope_table_covers_the_caches_whole_blocks():
    """A request may use every position of its blocks (max_len rounded up to block_size): the
    table has a row for each, even where max_position_embeddings is smaller."""
    tcfg = TargetConfig.from_hf(dict(model_type="llama", hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     intermediate_size=48, vocab_size=50,
                                     max_position_embeddings=10))
    tgt = Target(tcfg, random_state(tcfg), dtype=torch.float32, num_blocks=8, block_size=4,
                 max_len=18)
    assert tgt.cos_sin.shape == (20, 16)


def test_rope_table_unchanged_for_ordinary_configs():
    from dflash_ops.models.hf_config import rope_table_len
    for mpe, max_len in ((128, 64), (40960, 16), (262144, 4096), (64, 4096)):
        assert rope_table_len(mpe, max_len) == max(mpe, max_len)


# ------------------------------------------------------------------ re-saving, shards, converter
def test_resaving_into_a_directory_replaces_the_old_checkpoint(tmp_path):
    """A 2-shard save then a 1-file save: the old index and shards went on being loaded (the
    loader prefers an index)."""
    d, cfg = _sharded(tmp_path)
    new = {k: torch.full_like(v, 1.0) for k, v in random_drafter_state(cfg).items()}
    save_zlab(tmp_path, d, new, shards=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    got = load_state(tmp_path)
    assert got.keys() == new.keys() and all(torch.equal(got[k], new[k]) for k in new)
    save_zlab(tmp_path, d, new, shards=3)  # and back: no model.safetensors beside the shards
    assert not (tmp_path / "model.safetensors").exists() and (tmp_path / INDEX).exists()


def test_a_shard_tensor_the_index_does_not_list_is_refused(tmp_path):
    """It was dropped (so an unexpected or wrong-shaped tensor passed the checks unseen)."""
    _sharded(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    name, shard = next(iter(sorted(index["weight_map"].items())))
    _set_index(tmp_path, lambda ix: ix["weight_map"].pop(name))
    with pytest.raises(ValueError) as e:
        load_state(tmp_path)
    msg = _one_line(e)
    assert INDEX in msg and shard in msg and name in msg and "does not list" in msg, msg


@pytest.mark.parametrize("where", ["top", "dflash_config"])
def test_speculators_conversion_keeps_causal_and_the_rope_style(where):
    """A top-level `causal` and dflash_config's RoPE-style flags were dropped by the
    conversion (all-causal became non-causal; GPT-J became NeoX)."""
    from dflash_ops.models.weights import zlab_to_speculators
    mix = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8,
               use_sliding_window=True)
    d = tiny_zlab(**mix, causal=True) if where == "top" else tiny_zlab(**mix, dc={"causal": True})
    z, s = DFlashConfig.from_dict(d), DFlashConfig.from_dict(zlab_to_speculators(d))
    assert [z.layer_causal(i) for i in range(2)] == [s.layer_causal(i) for i in range(2)] \
        == [True, True]
    for flags in ({"rope_interleaved": True}, {"rope_is_neox_style": False}):
        d = tiny_zlab(dc=flags)
        z, s = DFlashConfig.from_dict(d), DFlashConfig.from_dict(zlab_to_speculators(d))
        assert z.rope_is_neox is False and s.rope_is_neox is False, flags
