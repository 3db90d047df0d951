"""The built-in trained tiny pair (``dflash-ops train-tiny``, shipped in dflash_ops/data/tiny_pair):
training writes checkpoints our loaders and the demo read; the shipped pair speculates (mean
acceptance > 2 on held-out stdlib text, output equal to plain greedy, CPU fp32); and our greedy
loop's per-iteration committed counts equal the ``dflash`` package's ``dflash_generate`` on the
same weights (its HF-format export), prompt by prompt."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from dflash_ops.speculator import demo
from dflash_ops.speculator.loop import plain_greedy, speculative_generate

SHIPPED = demo.SHIPPED


def shipped(dtype=torch.float32, batch=4, new_positions=256):
    return demo._checkpoint_pair(os.path.join(SHIPPED, "target"),
                                 os.path.join(SHIPPED, "drafter"), "cpu", dtype, None,
                                 new_positions, batch)


def test_shipped_pair_is_small_and_says_how_it_was_made():
    sizes = {}
    for part in ("target", "drafter"):
        cfg = json.load(open(os.path.join(SHIPPED, part, "config.json")))
        meta = cfg["dflash_ops_train_tiny"]
        assert meta["target_steps"] >= 1 and meta["draft_steps"] >= 1 and meta["corpus_sha256"]
        sizes[part] = os.path.getsize(os.path.join(SHIPPED, part, "model.safetensors"))
    assert sum(sizes.values()) < 16 << 20, sizes  # a few MB (bf16)


def test_shipped_pair_speculates_on_held_out_text():
    target, drafter = shipped()
    prompts = demo._text_prompts(4, 64, seed=0)
    want = plain_greedy(target, prompts, 64)
    got, stats = speculative_generate(target, drafter, prompts, 64)
    assert got == want
    assert stats.mean_acceptance > 2.0, stats


def test_train_tiny_writes_checkpoints_the_demo_loads(tmp_path):
    pytest.importorskip("dflash.model")
    pytest.importorskip("transformers")
    from dflash_ops.cli import main
    out = tmp_path / "pair"
    assert main(["train-tiny", "--out", str(out), "--target-steps", "2",
                 "--draft-steps", "2"]) == 0
    meta = json.load(open(out / "drafter" / "config.json"))["dflash_ops_train_tiny"]
    assert meta["target_steps"] == 2 and meta["draft_steps"] == 2
    target, drafter = demo._checkpoint_pair(str(out / "target"), str(out / "drafter"), "cpu",
                                            torch.float32, None, 64, 1)
    prompts = demo._text_prompts(1, 16, seed=1)
    assert speculative_generate(target, drafter, prompts, 8)[0] == \
        plain_greedy(target, prompts, 8)


def test_train_tiny_bad_value_is_one_line_naming_the_option(tmp_path, capsys):
    from dflash_ops.cli import main
    with pytest.raises(SystemExit) as e:
        main(["train-tiny", "--out", str(tmp_path), "--target-steps", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "--target-steps" in err[0] and "got '0'; allowed: an integer >= 1" in err[0], err
    assert not os.listdir(tmp_path)  # nothing written


def test_committed_counts_equal_dflash_generate(monkeypatch):
    """Batch 1, prompt by prompt (dflash_generate's own protocol): our committed counts per
    iteration equal its acceptance_lengths, and the outputs are equal, CPU fp32."""
    dm = pytest.importorskip("dflash.model")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its timer syncs CUDA
    tgt = transformers.Qwen3ForCausalLM.from_pretrained(
        os.path.join(SHIPPED, "target"), torch_dtype=torch.float32).eval()
    cfg = transformers.Qwen3Config.from_pretrained(os.path.join(SHIPPED, "drafter"))
    ref = dm.DFlashDraftModel(cfg).eval()
    ref.load_state_dict({k: v.float() for k, v in load_file(
        os.path.join(SHIPPED, "drafter", "model.safetensors")).items()})
    target, drafter = shipped(batch=1)
    new = 64
    for i, prompt in enumerate(demo._text_prompts(5, 48, seed=2)):
        stats = dm.dflash_generate(ref, tgt, torch.tensor([prompt]), new, None,
                                   return_stats=True)
        theirs = stats.output_ids[0, len(prompt):len(prompt) + new].tolist()
        got, st = speculative_generate(target, drafter, [prompt], new, policy=False)
        assert got[0] == theirs, f"prompt {i}: outputs differ"
        mine, ref_counts = st.acceptance, list(stats.acceptance_lengths)
        # Every iteration but the last is the same computation on both sides. In the last one
        # the reference shortens its block to the tokens left (its drafter then sees fewer mask
        # rows, so its drafts may differ); ours drafts the whole block and stops at the limit.
        assert mine[:-1] == ref_counts[:len(mine) - 1], \
            f"prompt {i}: committed per iteration {mine} vs {ref_counts}"
        assert sum(mine) == new - 1 and sum(ref_counts) >= new - 1


def test_corpus_reads_modules_that_became_packages(tmp_path, monkeypatch):
    """Python 3.12 made zipfile a package (zipfile/__init__.py): the corpus takes either form and
    names what is missing (the H200's 3.12 stopped the demo on 2026-12-01 before this)."""
    import sysconfig

    from dflash_ops import train_tiny as tt
    for i, m in enumerate(tt.MODULES):
        if m == "zipfile":
            (tmp_path / m).mkdir()
            (tmp_path / m / "__init__.py").write_bytes(b"z" * 3)
        else:
            (tmp_path / f"{m}.py").write_bytes(bytes([97 + i % 26]))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    ids, sha, root = tt.corpus()
    assert root == str(tmp_path) and ids.numel() == len(tt.MODULES) - 1 + 3
    assert ids[-3:].tolist() == [ord("z")] * 3  # zipfile last, from its package
    (tmp_path / "abc.py").unlink()
    with pytest.raises(FileNotFoundError, match="lacks abc.py"):
        tt.corpus()
