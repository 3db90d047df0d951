"""The ``dflash-ops`` command line: every bad option value is one ``error:`` line naming the
option, with exit code 2, before any model is built; ``--version``; ``--help`` of the demo."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.cli import build_parser, main


def _run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse exits; the demo's own checks return 2
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_usage_error(argv, option, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2, (rc, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dflash-ops {argv[0]}: error: "), err
    assert option in lines[0], err
    return lines[0]


BAD_VALUES = [
    (["--device", "tpu"], "--device", "'tpu'"),
    (["--device", "cuda:x"], "--device", "'cuda:x'"),
    (["--device", "cpu:1"], "--device", "'cpu:1'"),
    (["--block-size", "-3"], "--block-size", "'-3'"),
    (["--block-size", "0"], "--block-size", "'0'"),
    (["--block-size", "1"], "--block-size", "'1'"),
    (["--batch", "0"], "--batch", "'0'"),
    (["--threads", "0"], "--threads", "'0'"),
    (["--prompt-len", "-1"], "--prompt-len", "'-1'"),
    (["--max-new-tokens", "abc"], "--max-new-tokens", "'abc'"),
    (["--seed", str(2 ** 64)], "--seed", f"'{2 ** 64}'"),
    (["--seed", "1.5"], "--seed", "'1.5'"),
    (["--dtype", "int8"], "--dtype", "'int8'"),
    (["--steps", "fast"], "--steps", "'fast'"),
    (["--device", "cpu", "--steps", "graphs"], "--steps", "'graphs'"),
    (["--target", "/nonexistent/dir"], "--draft", "/nonexistent/dir"),
    (["--target", "/nonexistent/dir", "--draft", "/nonexistent/dir"], "--target",
     "/nonexistent/dir"),
    # the built-in pair's max_position_embeddings (4096) bounds prompt + new tokens + block
    (["--block-size", "5000"], "--block-size", "got 5000"),
    (["--prompt-len", "4000", "--max-new-tokens", "96"], "--prompt-len", "got 4096"),
]


@pytest.mark.parametrize("argv,option,given", BAD_VALUES, ids=[" ".join(a) for a, _, _ in
                                                               BAD_VALUES])
def test_demo_bad_value_is_one_line_naming_the_option(argv, option, given, capsys):
    line = _assert_usage_error(["demo", *argv], option, capsys)
    assert given in line
    assert "allowed" in line or "choose from" in line or "go together" in line, line


def test_cuda_device_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for cmd in ("demo", "check"):
        line = _assert_usage_error([cmd, "--device", "cuda"], "--device", capsys)
        assert "has no CUDA device; allowed here: cpu" in line, line


def test_check_bad_device_is_one_line(capsys):
    _assert_usage_error(["check", "--device", "tpu"], "--device", capsys)


def _qwen3_config(**over):
    d = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128,
             max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000.0,
             tie_word_embeddings=False, attention_bias=False)
    d.update(over)
    return d


def _write(dir_, config) -> str:
    dir_.mkdir()
    (dir_ / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(dir_)


def test_broken_checkpoints_are_one_line_naming_the_option(tmp_path, capsys):
    from dflash_ops.bench.drafter import QWEN3_8B_DFLASH

    good_target = _write(tmp_path / "target", _qwen3_config())  # config only: no weights
    good_draft = _write(tmp_path / "draft", QWEN3_8B_DFLASH)
    bad_json = _write(tmp_path / "bad_json", "{not json")
    no_config = str(tmp_path)
    cases = [  # (target, draft) -> the option named, a fragment of the cause
        ((bad_json, good_draft), "--target", "not valid JSON"),
        ((good_target, bad_json), "--draft", "not valid JSON"),
        ((no_config, good_draft), "--target", "without config.json"),
        ((good_target, no_config), "--draft", "without config.json"),
        ((_write(tmp_path / "llama2", _qwen3_config(model_type="gpt2")), good_draft), "--target",
         "model_type"),
        ((good_target, good_draft), "--target", "safetensors"),
    ]
    for (t, d), option, cause in cases:
        line = _assert_usage_error(["demo", "--device", "cpu", "--target", t, "--draft", d],
                                   option, capsys)
        assert cause in line, line


def _pair_copy(tmp_path, change_target=None, change_draft=None, change_weights=None) -> tuple:
    """A copy of the built-in pair with its configs (and the drafter's weights) changed."""
    import shutil
    from safetensors.torch import load_file, save_file
    from dflash_ops.speculator.demo import SHIPPED
    dirs = []
    for name, change in (("target", change_target), ("drafter", change_draft)):
        dst = tmp_path / name
        shutil.copytree(os.path.join(SHIPPED, name), dst)
        cfg = json.loads((dst / "config.json").read_text())
        if change:
            change(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
        dirs.append(str(dst))
    if change_weights:
        st = load_file(os.path.join(dirs[1], "model.safetensors"))
        change_weights(st)
        save_file(st, os.path.join(dirs[1], "model.safetensors"))
    return dirs


@pytest.mark.parametrize("what, option, cause", [
    ("rope", "--target", "rope_scaling.rope_type = 'linear'"),
    ("taps", "--draft", "which does not fit --target"),
    ("weights", "--draft", "missing: norm.weight"),
])
def test_checkpoints_that_load_wrong_are_one_line_naming_the_option(tmp_path, capsys, what,
                                                                     option, cause):
    """A refused RoPE scaling (a NotImplementedError traceback before), a drafter whose taps
    the target lacks (a traceback from the loop before) and a drafter missing tensors (its
    list of problems cut to its first line, naming none before)."""
    def taps(c):  # a drafter for an 8-layer target; the built-in target has 4
        c["num_target_layers"] = 8
        c["dflash_config"]["target_layer_ids"] = [1, 5]
    change = {"rope": dict(change_target=lambda c: c.update(
                  rope_scaling={"rope_type": "linear", "factor": 2.0})),
              "taps": dict(change_draft=taps),
              "weights": dict(change_weights=lambda st: st.pop("norm.weight"))}[what]
    t, d = _pair_copy(tmp_path, **change)
    line = _assert_usage_error(["demo", "--device", "cpu", "--target", t, "--draft", d,
                                "--max-new-tokens", "2", "--prompt-len", "4"], option, capsys)
    assert cause in line, line


def test_no_command_is_one_line(capsys):
    rc, out, err = _run([], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "demo" in err, err


def test_version(capsys):
    import dflash_ops
    rc, out, err = _run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"dflash-ops {dflash_ops.__version__}", (out, err)


def test_every_demo_option_has_help_with_its_default(capsys):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    demo = sub.choices["demo"]
    options = [a for a in demo._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) >= 10
    rc, out, _ = _run(["demo", "--help"], capsys)
    assert rc == 0
    for a in options:
        assert a.help and "default" in a.help, a.option_strings
        assert a.option_strings[0] in out


def test_demo_runs_small_on_cpu(capsys):
    threads = torch.get_num_threads()
    rc, out, err = _run(["demo", "--device", "cpu", "--batch", "1", "--prompt-len", "4",
                         "--max-new-tokens", "5", "--block-size", "3", "--no-stage-times"],
                        capsys)
    assert rc == 0, out + err
    assert "output equals plain greedy decoding: yes" in out
    assert "warm-up" in err and "time in" not in out
    assert "plain greedy through loop.plain_greedy" in out
    assert "cpu (1 thread)" in out and torch.get_num_threads() == threads  # restored


def test_demo_with_one_new_token_says_no_iteration_ran(capsys):
    """The prefill gives the one token: no drafting iteration runs, and the per-iteration rows
    say n/a (they printed acceptance 0.00 and one host sync an iteration)."""
    rc, out, err = _run(["demo", "--device", "cpu", "--batch", "1", "--prompt-len", "4",
                         "--max-new-tokens", "1", "--no-stage-times"], capsys)
    assert rc == 0, out + err
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()}
    assert rows["iterations"] == ["0"] and rows["acceptance length"] == ["1.00", "n/a"]
    assert rows["host syncs / iteration"] == ["n/a"] and "policy: iterations" not in rows
    assert "no iteration ran" in out and "output equals plain greedy decoding: yes" in out


def _tiny(device="cpu"):
    from dflash_ops.speculator import demo
    target, drafter = demo._tiny_pair(device, torch.float32, 4, 64, 2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (6,), generator=g).tolist() for _ in range(2)]
    return target, drafter, prompts


def test_a_difference_reports_index_tokens_and_the_top2_gap():
    from dflash_ops.speculator import demo
    from dflash_ops.speculator.loop import plain_greedy
    target, _, prompts = _tiny()
    want = plain_greedy(target, prompts, 8)
    got = [list(want[0]), list(want[1])]
    got[1][5] = (want[1][5] + 1) % 500
    lines = demo._differences(target, prompts, got, want)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("  request 1: first difference at new token 5: ")
    assert f"plain greedy {want[1][5]}, DFlash {got[1][5]}" in line
    # the recomputed top-1 is the token plain greedy took there (fp32)
    assert f"target top-2 there: {want[1][5]} (" in line and "gap " in line
    assert demo._differences(target, prompts, want, want) == []


@pytest.mark.gpu
def test_graphed_decode_equals_plain_greedy_on_gpu():
    from dflash_ops.speculator import demo
    from dflash_ops.speculator.loop import plain_greedy
    target, _, prompts = _tiny("cuda")
    want = plain_greedy(target, prompts, 9)
    got, seconds = demo._decode_graphed(target, prompts, 9)
    assert got == want and seconds > 0


def test_info_lists_every_op_with_its_default(capsys):
    from dflash_ops import dispatch
    rc, out, _ = _run(["info"], capsys)
    assert rc == 0
    for name, op in dispatch.ops().items():
        row = (rf"^{name} +(yes|-) +(yes|-) +(yes|-) +{op.default} +{op.eager or '-'} "
               rf"+\w+ / \w+$")
        assert re.search(row, out, re.M), name
    # the linear table's GPUs (the shipped one names the H200 and the H100)
    assert re.search(r"^linear table: holds on NVIDIA H200, NVIDIA H100 80GB HBM3", out, re.M)


def test_linear_table_line(monkeypatch):
    from dflash_ops import cli
    from dflash_ops.models import linear as L
    monkeypatch.setattr(L, "TABLE", {})
    assert cli.linear_table_line() == "linear table: none (every linear layer runs cuBLAS)"
    monkeypatch.setattr(L, "TABLE", {(64, 32): {16: (16, 32, 64, 8, 4, 3, False, False)}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.linear_table_line() == "linear table: holds on any GPU (no GPU here)"
    monkeypatch.setattr(L, "TABLE_GPUS", ("NVIDIA H200",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, want in (("NVIDIA H200", "yes"), ("NVIDIA A100-SXM4-80GB", "no (cuBLAS)")):
        monkeypatch.setattr(L, "_device_name", lambda i: name)
        assert cli.linear_table_line().startswith(f"linear table: holds on NVIDIA H200; here: "
                                                  f"{want}"), name


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,limit", [
    (["--block-size", "5000"], "allowed: 2 .. 4024 (the built-in pair's "
                               "max_position_embeddings 4096 less --prompt-len + "
                               "--max-new-tokens, 72)"),
    (["--block-size", "4100", "--prompt-len", "4090"], "allowed: 2 .. 4094"),
    (["--prompt-len", "4000", "--max-new-tokens", "96"], "allowed: at most 4088 (the built-in "
                                                         "pair's max_position_embeddings 4096 "
                                                         "less the block, 8)"),
])
def test_demo_positions_past_the_pairs_limit_are_one_line(argv, limit, capsys):
    """Before this check --block-size 5000 ran out of memory and --prompt-len claimed 1 ..
    49999 (the held-out text) as its range."""
    line = _assert_usage_error(["demo", "--device", "cpu", *argv], argv[0], capsys)
    assert limit in line, line


def test_demo_positions_limit_comes_from_the_checkpoints_configs(tmp_path, capsys):
    from dflash_ops.bench.drafter import QWEN3_8B_DFLASH

    target = _write(tmp_path / "target", _qwen3_config(max_position_embeddings=128))
    draft = _write(tmp_path / "draft", QWEN3_8B_DFLASH)  # config only: no weights needed
    line = _assert_usage_error(["demo", "--device", "cpu", "--target", target, "--draft", draft,
                                "--prompt-len", "100", "--max-new-tokens", "20"],
                               "--prompt-len", capsys)
    assert f"max_position_embeddings 128 of --target {target}" in line, line
    assert "allowed: at most 112" in line  # 128 less the drafter's block 16


def test_demo_exact_help_points_to_the_measured_cost(capsys):
    rc, out, _ = _run(["demo", "--help"], capsys)
    text = " ".join(out.split())
    assert "not yet measured" not in text
    assert "README.md gives its measured cost" in text
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"`--exact` runs exact mode.*?It costs: draft \+ verify iteration", readme,
                     re.S)


def _env(**over):
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_OPS_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(over)
    return env


def test_bad_backend_env_is_one_line_for_the_command(tmp_path):
    """DFLASH_OPS_BACKEND is read when the package is imported, before cli.main runs: the
    command (its console script, python -m dflash_ops) prints one line and exits 2."""
    script = tmp_path / "dflash-ops"  # what pip writes for [project.scripts]
    script.write_text("import sys\nfrom dflash_ops.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    for cmd in ([sys.executable, str(script), "--help"],
                [sys.executable, "-m", "dflash_ops", "info"]):
        r = subprocess.run(cmd, cwd=tmp_path, env=_env(DFLASH_OPS_BACKEND="foo"),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stdout == "", (cmd, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [
            "dflash-ops: error: DFLASH_OPS_BACKEND: got 'foo'; allowed: torch, triton, cuda "
            "(or unset: no backend forced)"], (cmd, r.stderr)


def test_bad_backend_env_raises_for_a_library_user(monkeypatch):
    from dflash_ops import dispatch

    monkeypatch.setenv("DFLASH_OPS_BACKEND", "Fast")
    monkeypatch.setattr(sys, "argv", ["my_script.py"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "my_script.py"], raising=False)
    with pytest.raises(ValueError, match=r"^DFLASH_OPS_BACKEND: got 'Fast'; allowed: torch, "
                                         r"triton, cuda \(or unset"):
        dispatch._init_from_env()
    assert dispatch._global_force.get(None) is None
    monkeypatch.setattr(sys, "argv", ["/venv/bin/dflash-ops", "info"])  # the command
    with pytest.raises(SystemExit) as e:
        dispatch._init_from_env()
    assert e.value.code == 2


def test_info_names_a_forced_backend_and_marks_missing_kernels(monkeypatch, capsys):
    """DFLASH_OPS_BACKEND=cuda without the extension: every call raises
    BackendUnavailableError, so the table must not read as if cuda ran."""
    from dflash_ops import dispatch

    monkeypatch.setenv("DFLASH_OPS_BACKEND", "cuda")
    monkeypatch.setitem(dispatch._global_force, None, "cuda")  # what the import did
    monkeypatch.setattr(dispatch, "_cuda_cpp_ops", set())  # no extension
    rc, out, _ = _run(["info"], capsys)
    assert rc == 0
    assert re.search(r"^backend forced by DFLASH_OPS_BACKEND=cuda: every op runs cuda; a call "
                     r"of an op without a cuda kernel \(marked 'missing'\) raises "
                     r"BackendUnavailableError$", out, re.M), out
    for name in dispatch.ops():
        assert re.search(rf"^{name} .* - +\w+ +\S+ +cuda \(missing\) / cuda \(missing\)$",
                         out, re.M), name
    monkeypatch.setenv("DFLASH_OPS_BACKEND", "torch")
    monkeypatch.setitem(dispatch._global_force, None, "torch")
    rc, out, _ = _run(["info"], capsys)
    assert "(missing)" not in out and "DFLASH_OPS_BACKEND=torch" in out
    assert re.search(r"^rms_norm .* torch / torch$", out, re.M)


def test_info_without_a_forced_backend_has_no_forced_line(monkeypatch, capsys):
    monkeypatch.delenv("DFLASH_OPS_BACKEND", raising=False)
    rc, out, _ = _run(["info"], capsys)
    assert rc == 0 and "forced" not in out and "(missing)" not in out


@pytest.fixture
def no_training(monkeypatch):
    """train-tiny's packages reported present and its corpus read made to fail: a check that
    should stop the command comes before any training."""
    from dflash_ops import train_tiny

    monkeypatch.setattr(train_tiny, "_import_failure", lambda: None, raising=False)

    def corpus():
        raise AssertionError("train-tiny started training")

    monkeypatch.setattr(train_tiny, "corpus", corpus)


def test_train_tiny_unwritable_out_is_one_line_before_training(tmp_path, no_training, capsys):
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "pair")  # under a regular file: fails as root too
    line = _assert_usage_error(["train-tiny", "--out", bad], "--out", capsys)
    assert f"got {bad!r}, which cannot be created or written (Not a directory); allowed: a " \
           f"writable directory" in line, line


def test_train_tiny_creates_out_before_training(tmp_path, no_training):
    out = tmp_path / "a" / "b"
    with pytest.raises(AssertionError, match="started training"):
        main(["train-tiny", "--out", str(out)])
    assert out.is_dir() and not os.listdir(out)  # created, the probe file gone


def test_train_tiny_without_its_packages_is_one_line_before_anything(tmp_path, monkeypatch,
                                                                      capsys):
    from dflash_ops import train_tiny

    monkeypatch.setitem(sys.modules, "dflash", None)  # import dflash.model: ImportError
    monkeypatch.setitem(sys.modules, "dflash.model", None)
    monkeypatch.setattr(train_tiny, "corpus", lambda: pytest.fail("read the corpus"))
    out = tmp_path / "pair"
    line = _assert_usage_error(["train-tiny", "--out", str(out)], "pip install --no-deps dflash",
                               capsys)
    assert "needs transformers and the dflash package (" in line, line
    assert "install them: pip install transformers && pip install --no-deps dflash" in line
    assert not out.exists()
