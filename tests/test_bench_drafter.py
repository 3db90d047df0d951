"""The drafter benchmark's CPU-testable parts (dflash_ops/bench/drafter.py): the floor's bytes and
FLOPs against a hand count on a tiny config, case parsing, the agreement check, the error on a
machine without a GPU, and the setup (our cache copied into the reference's DynamicCache, the
step's inputs) on a tiny drafter in fp32, where eager, DraftStep and the reference agree."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.bench import drafter as bd

ROOT = Path(__file__).resolve().parent.parent

TINY = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=101,
            max_position_embeddings=512, attention_bias=False, num_target_layers=6,
            block_size=4, layer_types=["full_attention"] * 2,
            dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 100})


def test_step_cost_hand_count():
    cfg = bd.drafter_config(TINY)  # H 64, L 2, Hq 4, Hkv 2, D 16, I 96, V 101, b 4, 2 taps x 64
    c = bd.step_cost(cfg, batch=3, context=40, new=4)
    # elements: fc 64 x 128; norms 2 x 64 (final, hidden_norm) + 2*(2*64 + 2*16); per layer
    # qkv (4+4)*16 x 64 = 8192, o 64 x 64 = 4096, gate/up/down 3 x 96 x 64 = 18432 -> 30720
    # (each weight once: the drafter's stacked copy of the k/v weights is not counted);
    # LM head 101 x 64; K/V read 3 x 40 x (2*2*2*16 = 128); embeddings 3 x 4 x 64;
    # tap hidden 3 x 4 x 128; K/V written 3 x 4 x 128
    want = {"fc": 8192, "norms": 128 + 320, "layers": 2 * 30720,
            "LM head": 6464, "K/V read": 15360, "embeddings": 768, "tap hidden": 1536,
            "K/V written": 1536}
    assert c["bytes"] == {k: 2 * v for k, v in want.items()}
    assert c["total_bytes"] == 2 * sum(want.values())
    assert bd.weight_bytes(c) == 2 * (8192 + 448 + 61440 + 6464)
    flops = {"context": 2 * 12 * (8192 + 8192), "layers": 2 * 12 * 2 * 30720,
             "attention": 4 * 3 * 4 * 2 * 4 * 16 * 44, "LM head": 2 * 3 * 3 * 6464}
    assert c["flops"] == pytest.approx(flops)
    assert c["total_flops"] == pytest.approx(sum(flops.values()))


def test_qwen3_8b_floor_is_the_expected_size():
    cfg = bd.drafter_config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.block_size, cfg.n_taps) == \
        (5, 4096, 151936, 16, 5)
    c = bd.step_cost(cfg, 1, 1024)
    # weights + LM head ~3.35 GB (each once): ~0.78 ms at ~4.3 TB/s
    assert 3.33e9 < bd.weight_bytes(c) < 3.37e9
    assert c["bytes"]["K/V read"] == 1024 * 5 * 2 * 8 * 128 * 2
    floor = bd.floor_us({"copy_GBps": 4300.0, "gemm_TFLOPs": 700.0}, c["total_bytes"],
                        c["total_flops"])
    assert 780 < floor < 820
    big = bd.step_cost(cfg, 64, 4096)  # FLOP-bound
    assert big["total_flops"] / 700e6 > big["total_bytes"] / 4300e3
    note = bd.floor_note(big, {"copy_GBps": 4300.0, "gemm_TFLOPs": 700.0})
    assert note.startswith("FLOP-bound")


def test_parse_cases():
    assert bd.parse_cases("1x1024, 64X4096,,1x131072") == [(1, 1024), (64, 4096), (1, 131072)]
    for bad, what in (("8", "not BxS"), ("ax4", "not BxS"), ("0x1024", "B >= 1"),
                      ("1x8", "S >= 16"), ("4096x8192", "GiB"), (" , ", "no cases")):
        with pytest.raises(ValueError, match=what) as e:
            bd.parse_cases(bad)
        assert bd.ENV_CASES in str(e.value)


def test_cases_env(monkeypatch):
    monkeypatch.delenv(bd.ENV_CASES, raising=False)
    assert bd.cases() == list(bd.CASES) and bd.cases(quick=True) == list(bd.QUICK_CASES)
    assert {(1, 1024), (64, 4096), (1, 131072)} <= set(bd.QUICK_CASES)  # the target cases
    assert {(b, s) for b in (1, 8, 32, 64) for s in (1024, 8192)} <= set(bd.CASES)
    monkeypatch.setenv(bd.ENV_CASES, "2x2048")
    assert bd.cases(quick=True) == [(2, 2048)]
    monkeypatch.setenv(bd.ENV_REF, "0")
    assert bd.reference_missing() == f"{bd.ENV_REF}=0"


def test_agreement_near_ties():
    want = torch.tensor([[[3.0, 1.0, 0.0], [2.0, 1.99, 0.0]]])  # row 1: a near tie
    tokens = want.argmax(-1)
    got = want + torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.02, 0.0]]])  # flips row 1 only
    ok, err, note = bd.agreement(got.argmax(-1), got, tokens, want, 0.02)
    assert ok and err == pytest.approx(0.02) and "1 of 2 differ, 0 outside" in note
    bad_tokens = torch.tensor([[1, 0]])  # row 0 has a clear winner: a wrong draft there fails
    ok, _, note = bd.agreement(bad_tokens, want, tokens, want, 0.02)
    assert not ok and "1 outside near ties" in note
    ok, _, _ = bd.agreement(tokens, want * 1.1, tokens, want, 0.02)  # logits off by 10%
    assert not ok
    ok, _, _ = bd.agreement(tokens, want * float("nan"), tokens, want, 0.02)
    assert not ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error path")
def test_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bd.run(quick=True)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_drafter.py"), "--quick",
                        "--cases", "1x1024"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "needs a CUDA GPU" in p.stderr


def test_wrapper_help():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_drafter.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--cases" in p.stdout and "drafter" in p.stdout


def test_registered_suite():
    from dflash_ops.bench import SUITES
    assert SUITES["drafter"][0] == "dflash_ops.bench.drafter"


def _tiny_setup(batch=3, context=40, new=4):
    cfg = bd.drafter_config(TINY)
    state, embed, head = bd.random_weights(cfg, "cpu", torch.float32)
    drafter = bd.build_drafter(cfg, state, embed, head, batch, context, "cpu", torch.float32)
    inp = bd.step_inputs(cfg, batch, context, "cpu", torch.float32, new=new)
    return cfg, state, embed, head, drafter, inp


def test_setup_and_draft_step_agree_on_cpu():
    batch, context, new = 3, 40, 4
    cfg, _, _, _, drafter, inp = _tiny_setup(batch, context, new)
    table = drafter.cache.block_table[:batch]
    assert sorted(table.flatten().tolist()) == list(range(table.numel()))  # shuffled, disjoint
    assert inp["ctx_pos"].tolist() == list(range(36, 40)) * batch
    assert (inp["block_ids"][:, 1:] == cfg.mask_token_id).all()
    with torch.no_grad():
        want_t, want_z = bd.eager_step(drafter, inp)
        step, bucket = bd.graph_step(drafter, inp, batch, capture=False)
        got_t, got_z = step.run(bucket)
    assert want_z.shape == (batch, cfg.block_size - 1, cfg.vocab_size)
    ok, err, note = bd.agreement(got_t, got_z, want_t, want_z, bd.GRAPH_TOL)
    assert ok and err < 1e-5, note


def test_reference_step_agrees_on_cpu():
    pytest.importorskip("dflash.model")
    pytest.importorskip("transformers")
    batch, context, new = 3, 40, 4
    cfg, state, embed, head, drafter, inp = _tiny_setup(batch, context, new)
    with torch.no_grad():
        want_t, want_z = bd.eager_step(drafter, inp)
        model = bd.reference_model(TINY, state, "cpu", torch.float32)
        step = bd.reference_step(model, drafter, inp, embed, head, batch, context, new=new)
        for _ in range(2):  # each call crops back: the same step again
            got_t, got_z = step()
            ok, err, note = bd.agreement(got_t, got_z, want_t, want_z, bd.REF_TOL)
            assert ok and err < 1e-4, note


def test_run_case_rows_on_cpu(monkeypatch):
    """One case through run_case on CPU with the timing faked (CUDA events need a GPU) and the
    graph captured nowhere: every column checked, rows, floor and summary written."""
    from dflash_ops.bench.harness import Results

    cfg = bd.drafter_config(TINY)
    weights = bd.random_weights(cfg, "cpu", torch.float32)
    calls = []

    def fake_time(fn, graph=False, **timing):
        calls.append(fn())
        return {"us": 100.0 * len(calls), "mode": "events"}

    real_graph_step = bd.graph_step
    monkeypatch.setattr(bd, "time_fn", fake_time)
    monkeypatch.setattr(bd, "graph_step", lambda *a: real_graph_step(*a, capture=False))
    try:
        model = bd.reference_model(TINY, weights[0], "cpu", torch.float32)
        why = None
    except ImportError as e:
        model, why = None, f"no reference: {e}"
    res = Results("drafter-test", floors={"copy_GBps": 4300.0, "gemm_TFLOPs": 700.0})
    with torch.no_grad():
        summary = bd.run_case(res, cfg, weights, model, why, 3, 40, {}, device="cpu")
    rows = {r["impl"]: r for r in res.rows if r["table"].startswith("drafter step")}
    assert list(rows) == [bd.REF_NAME, bd.EAGER_NAME, bd.GRAPH_NAME, "floor"]
    assert rows[bd.GRAPH_NAME]["us"] is not None, rows[bd.GRAPH_NAME]["note"]
    assert rows[bd.GRAPH_NAME]["err"] < 1e-5
    assert rows["floor"]["note"].startswith("bytes-bound")
    if model is not None:
        assert rows[bd.REF_NAME]["note"].startswith("agrees"), rows[bd.REF_NAME]["note"]
        assert rows[bd.EAGER_NAME]["ref / us"] == pytest.approx(0.5)
    assert summary["case"] == "B=3 S=40" and summary["ours graph"] is not None
    assert summary["bound"] == "bytes" and summary["graph x floor"] > 1
    text = res.format()
    assert "B=3 S=40" in text and "floor" in text


def test_run_case_draft_window_column_on_cpu(monkeypatch):
    """The draft-window column where the context is longer than the window (here 8 of 40): its
    graph step checked against its own eager step, and the window off again afterwards."""
    from dflash_ops.bench.harness import Results

    cfg = bd.drafter_config(TINY)
    weights = bd.random_weights(cfg, "cpu", torch.float32)
    real_graph_step = bd.graph_step
    monkeypatch.setattr(bd, "time_fn",
                        lambda fn, graph=False, **t: (fn(), {"us": 50.0, "mode": "events"})[1])
    monkeypatch.setattr(bd, "graph_step", lambda *a: real_graph_step(*a, capture=False))
    res = Results("drafter-test", floors={"copy_GBps": 4300.0, "gemm_TFLOPs": 700.0})
    with torch.no_grad():
        bd.run_case(res, cfg, weights, None, "no reference", 3, 40, {}, device="cpu",
                    draft_window=8)
    rows = {r["impl"]: r for r in res.rows if r["table"].startswith("drafter step")}
    win = rows["ours graph, draft window 8"]
    assert win["us"] == 50.0 and win["err"] < 1e-5, win["note"]
    assert "drafts equal to the full context's" in win["note"]
    # its bytes are its own step's (16 + 8 of the 40 context keys), not the full step's
    own = bd.step_cost(cfg, 3, 24, cfg.block_size)["total_bytes"]
    full = rows["ours eager"]["bytes"]
    assert win["bytes"] == own < full == bd.step_cost(cfg, 3, 40, cfg.block_size)["total_bytes"]
    assert win["x floor"] == 50.0 / bd.floor_us(res.floors, own, bd.step_cost(
        cfg, 3, 24, cfg.block_size)["total_flops"])
