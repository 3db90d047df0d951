"""The end-to-end benchmark's pure parts on the CPU (``bench.e2e_report``: floor byte / FLOP counts
against hand counts and against the models' own tensors, the implied speedup, memory estimate,
the report tables; ``bench.e2e``: case parsing), its "needs a CUDA GPU" errors, the host loop on
the CPU, and one GPU smoke run on tiny models."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.bench import e2e
from dflash_ops.bench import e2e_report as rep
from dflash_ops.bench.harness import Results

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")


def tiny_target_cfg(**kw):
    from dflash_ops.models.target import TargetConfig

    # H 64, L 2, Hq 4, Hkv 2, D 16, I 128, V 300: q = 64, kv = 32 features
    return TargetConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=300, max_position_embeddings=4096,
                        **kw)


def tiny_drafter_cfg():
    from dflash_ops.models.config import DFlashConfig

    # H 64, L 1, Hq 4, Hkv 2, D 16, I 128, V 300, taps 2 x Ht 64
    return DFlashConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=300, mask_token_id=299,
                        target_layer_ids=[0, 1], num_target_layers=2, block_size=16,
                        max_position_embeddings=4096)


# ----------------------------------------------------------------------------- floors

def test_target_bytes_hand_count():
    # one layer: qkv (64 + 2*32) x 64 = 8192, o 64 x 64 = 4096, gate/up/down 3 x 128 x 64 =
    # 24576 -> 36864 matrix elements; norms 2 x 64 + q/k norm 2 x 16 = 160; 2 layers + final
    # norm 64 -> 74112 elements = 148224 bytes
    c = rep.target_step_cost(tiny_target_cfg(), batch=3, context=40, new=16, n_taps=2)
    assert c["weights"] == 148224
    assert c["lm_head"] == 2 * 300 * 64 == 38400
    # K/V a token: 2 layers x (K, V) x 2 heads x 16 = 128 elements
    assert c["kv_read"] == 2 * 3 * 40 * 128 == 30720
    assert c["kv_write"] == 2 * 3 * 16 * 128 == 12288
    assert c["other"] == 2 * 3 * 16 * 64 * (1 + 2) == 18432  # embedding rows in, 2 taps out
    assert c["bytes"] == 148224 + 38400 + 30720 + 12288 + 18432
    # FLOPs: 2 * 48 tokens * (2 x 36864 + 300 x 64); attention 4 * 3 * 2 layers * 4 heads * 16
    # * (16 x 40 + 16 x 17 / 2 = 776 keys over the block)
    assert c["flops"] == 2 * 48 * (2 * 36864 + 19200) + 4 * 3 * 2 * 4 * 16 * 776


def test_decode_bytes_hand_count():
    c = rep.target_step_cost(tiny_target_cfg(), batch=2, context=100, new=1)
    assert (c["weights"], c["lm_head"]) == (148224, 38400)
    assert c["kv_read"] == 2 * 2 * 100 * 128
    assert c["kv_write"] == 2 * 2 * 1 * 128
    assert c["other"] == 2 * 2 * 64
    assert c["flops"] == 2 * 2 * (2 * 36864 + 19200) + 4 * 2 * 2 * 4 * 16 * 101


def test_target_weight_bytes_match_the_model():
    """The counted weights are the Target's own tensors (the embedding table is not read)."""
    from dflash_ops.models.target import Target

    for kw in ({}, {"attention_bias": True}, {"qk_norm": False}):
        cfg = tiny_target_cfg(**kw)
        t = Target.random(cfg, seed=0, dtype=torch.bfloat16, num_blocks=2, max_requests=1,
                          max_len=32)
        elements = t.norm.numel() + sum(w.numel() for lw in t.layers for w in vars(lw).values()
                                        if isinstance(w, torch.Tensor))
        c = rep.target_step_cost(cfg, 1, 0, 1)
        assert c["weights"] == 2 * elements, kw
        assert c["lm_head"] == 2 * t.lm_head.numel()


def test_drafter_bytes_hand_count():
    # fc 64 x (2 x 64) = 8192; norms 2 x 64 (final, hidden_norm); one layer 36864 + 160 ->
    # 45344 elements = 90688 bytes (each weight once: the stacked k/v copy is not counted)
    c = rep.drafter_step_cost(tiny_drafter_cfg(), batch=3, context=40)
    assert c["weights"] == 90688
    assert c["lm_head"] == 2 * 300 * 64
    assert c["kv_read"] == 2 * 3 * 40 * 64     # 64 K/V elements a token (1 layer)
    assert c["kv_write"] == 2 * 3 * 16 * 64    # a whole block committed a request
    assert c["other"] == 2 * (3 * 16 * 64 + 3 * 16 * 2 * 64)  # block embeddings, taps in
    assert c["flops"] == (2 * 48 * (8192 + 4096) + 2 * 48 * 36864
                          + 4 * 3 * 16 * 1 * 4 * 16 * (40 + 16) + 2 * 3 * 15 * 300 * 64)
    # fewer committed rows: only the context part shrinks
    c8 = rep.drafter_step_cost(tiny_drafter_cfg(), batch=3, context=40, new=8)
    assert c8["kv_write"] == 2 * 3 * 8 * 64
    assert c["flops"] - c8["flops"] == 2 * 3 * 8 * (8192 + 4096)


def test_drafter_weight_bytes_match_the_model():
    """Counted: every tensor the drafter reads but the stacked K-norm weight [L, D] and the
    stacked copy of the k/v weights (w_kv: the layers' k/v rows again, hidden_norm folded in;
    counted as hidden_norm's H) (and the target's embedding / LM head, counted apart)."""
    from dflash_ops.models.drafter import DFlashDrafter, random_drafter_state

    cfg = tiny_drafter_cfg()
    emb = torch.randn(300, 64)
    d = DFlashDrafter(cfg, random_drafter_state(cfg), embed_tokens=emb, lm_head=emb,
                      num_blocks=2, max_requests=1, max_len=32)
    elements = (d.fc.numel() + d.norm.numel() + cfg.hidden_size
                + sum(w.numel() for lw in d.layers for w in vars(lw).values()
                      if isinstance(w, torch.Tensor)))
    assert rep.drafter_step_cost(cfg, 1, 0)["weights"] == 2 * elements


def test_qwen3_8b_floors():
    """Orientation numbers of the docstring: 15.3 GB verify / 3.36 GB draft at B 1, S 1024."""
    t, d = e2e.qwen3_8b_target_config(), e2e.qwen3_8b_dflash_config()
    v = rep.target_step_cost(t, 1, 1024, 16, n_taps=5)
    assert 15.2e9 < v["bytes"] < 15.4e9
    assert v["lm_head"] == 2 * 151936 * 4096
    assert 3.33e9 < rep.drafter_step_cost(d, 1, 1024)["bytes"] < 3.4e9
    assert d.target_layer_ids == [1, 9, 17, 25, 33]
    fl = rep.step_floors({"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0},
                         rep.step_costs(t, d, 1, 1024))
    assert fl["verify"] == pytest.approx(v["bytes"] / 4e12 * 1e6)  # bytes-bound at B 1
    assert fl["draft+verify"] == fl["draft"] + fl["verify"]
    big = rep.step_floors({"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0},
                          rep.step_costs(t, d, 64, 1024))
    flops = rep.target_step_cost(t, 64, 1024, 16, n_taps=5)["flops"]
    assert big["verify"] == pytest.approx(flops / 700e12 * 1e6)   # FLOP-bound at B 64


def test_serial_floor_adds_the_kv_stream_to_the_gemms():
    """The serial floor: max(K/V bytes, attention FLOPs) + max(other bytes, other FLOPs), each
    over its rate. A hand case, then Qwen3-8B: equal to the floor for the decode at B 1 x 1k
    (bytes dominate both parts), ~1.35x it for the verify at B 32 x 8k."""
    floors = {"copy_GBps": 1000.0, "gemm_TFLOPs": 100.0}  # 1 GB/ms, 0.1 TFLOP/ms
    c = {"kv_read": 3e9, "kv_write": 1e9, "attn_flops": 0.2e12, "bytes": 6e9, "flops": 0.7e12}
    # attention: max(4 ms, 2 ms); the rest: max(2 ms, 5 ms); floor: max(6, 7) = 7 ms
    assert rep.serial_floor_us(floors, c) == pytest.approx(9000.0)
    t, d = e2e.qwen3_8b_target_config(), e2e.qwen3_8b_dflash_config()
    fl = {"copy_GBps": 3040.0, "gemm_TFLOPs": 687.0}  # an H100's, session 34
    costs = rep.step_costs(t, d, 1, 1024)
    ser, flo = rep.step_serial_floors(fl, costs), rep.step_floors(fl, costs)
    assert ser["decode"] == pytest.approx(flo["decode"], rel=1e-3)
    assert ser["draft+verify"] == ser["draft"] + ser["verify"]
    v = rep.target_step_cost(t, 32, 8192, 16, n_taps=5)
    assert v["attn_flops"] == 4 * 32 * 36 * 32 * 128 * (16 * 8192 + 16 * 17 // 2)
    kv = v["kv_read"] + v["kv_write"]
    want = kv / 3.04e12 * 1e6 + (v["flops"] - v["attn_flops"]) / 687e12 * 1e6  # GEMMs FLOP-bound
    assert rep.serial_floor_us(fl, v) == pytest.approx(want)
    ratio = rep.serial_floor_us(fl, v) / max(v["bytes"] / 3.04e12, v["flops"] / 687e12) / 1e6
    assert 1.3 < ratio < 1.4
    row = rep.summary_row(32, 29500.0, 18800.0, rep.step_floors(fl, rep.step_costs(t, d, 32, 8192)),
                          rep.step_serial_floors(fl, rep.step_costs(t, d, 32, 8192)))
    assert row["iter/serial"] < row["iter/floor"]


def test_case_memory():
    t, d = e2e.qwen3_8b_target_config(), e2e.qwen3_8b_dflash_config()
    m = rep.case_memory_bytes(t, d, 64, 8192)
    # 64 requests x (8192 + 32) positions + one scratch block; 147456 / 20480 bytes a token
    tokens = 64 * 8224 + 16
    assert m["target_kv"] == tokens * 36 * 2 * 8 * 128 * 2
    assert m["drafter_kv"] == tokens * 5 * 2 * 8 * 128 * 2
    assert m["target_weights"] == 2 * 8_190_735_360  # Qwen3-8B's parameter count
    assert 100e9 < m["total"] < rep.MEM_GB * 1e9  # every default case fits the budget
    assert rep.case_memory_bytes(t, d, 128, 8192)["total"] > rep.MEM_GB * 1e9
    assert m["total"] == sum(v for k, v in m.items() if k != "total")


# ----------------------------------------------------------------------------- speedup

def test_implied_speedup():
    assert rep.implied_speedup(6.55, 4.0, 5.0) == pytest.approx(5.24)
    assert rep.implied_speedup(16, 10.0, 10.0) == 16
    assert rep.implied_speedup(1, 3.0, 6.0) == 0.5


def test_summary_row():
    fl = {"draft+verify": 4000.0, "decode": 3600.0}
    r = rep.summary_row(1, 4300.0, 3700.0, fl)
    assert r["iter/floor"] == pytest.approx(1.075) and r["<=1.1 (B=1)"] == "yes"
    assert r["decode/floor"] == pytest.approx(3700 / 3600) and r["<=1.1"] == "yes"
    assert r["speedup @6.55"] == pytest.approx(6.55 * 3700 / 4300)
    assert r["speedup @16"] == pytest.approx(16 * 3700 / 4300)
    assert r["paper (B200, B=1)"] == 5.2 and r["iter ms"] == 4.3
    r = rep.summary_row(8, 4500.0, 4000.0, fl)
    assert r["<=1.1 (B=1)"] == "-" and r["<=1.1"] == "NO" and r["paper (B200, B=1)"] is None
    assert rep.summary_row(1, 4500.0, 3700.0, fl)["<=1.1 (B=1)"] == "NO"


# ----------------------------------------------------------------------------- cases

def test_parse_cases():
    assert e2e.parse_cases("1x1024,64x8k") == [(1, 1024), (64, 8192)]
    assert e2e.parse_cases(" 8X1K , 32x2048 ,") == [(8, 1024), (32, 2048)]
    for bad in ("1y2", "8", "x1024", "1x1024x3", "ax1024", "0x1024", "1x8", "", " , "):
        with pytest.raises(ValueError):
            e2e.parse_cases(bad)
    with pytest.raises(ValueError, match="--cases"):
        e2e.parse_cases("8", "--cases")


def test_cases_from_env(monkeypatch):
    monkeypatch.delenv(e2e.ENV_CASES, raising=False)
    assert e2e.cases_from_env(False) == [(1, 1024), (8, 1024), (32, 1024), (64, 1024),
                                         (1, 8192), (8, 8192), (32, 8192), (64, 8192)]
    assert e2e.cases_from_env(True) == e2e.QUICK_CASES
    monkeypatch.setenv(e2e.ENV_CASES, "2x4k")
    assert e2e.cases_from_env(True) == [(2, 4096)]
    monkeypatch.setenv(e2e.ENV_CASES, "2y4k")
    with pytest.raises(ValueError, match=e2e.ENV_CASES):
        e2e.cases_from_env(False)


def test_case_label_round_trip():
    assert rep.parse_case_label(rep.case_label(64, 8192)) == (64, 8192)


# ----------------------------------------------------------------------------- report

def _fake(us):
    return {"us": us, "p20": us, "p80": us, "samples": 10, "mode": "graph replay"}


def test_report_tables(tmp_path):
    t, d = tiny_target_cfg(), tiny_drafter_cfg()
    res = rep.E2EResults("e2e-test", floors={"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0})
    m = {"batch": 1, "context": 64, "draft": _fake(10.0), "verify": _fake(30.0),
         "iteration": _fake(41.0), "decode": _fake(25.0),
         "loop": {"wall_us": 50.0, "graphs_us": 40.0, "idle_us": 10.0, "iters": 20},
         "loop staged": {"wall_us": 60.0, "graphs_us": 40.0, "idle_us": 20.0, "iters": 20}}
    entries = [{"batch": 1, "context": 64, "mem": 1e9, "m": m, "note": ""},
               {"batch": 9, "context": 64, "mem": 2e11, "m": None, "note": "skipped: too big"}]
    loops = [{"batch": 1, "new": 32, "note": "",
              "stats": {"iterations": 31, "host syncs": 34, "syncs/iter": 34 / 31}}]
    rep.report(res, t, d, entries, loops)
    tabs = res.tables()
    assert list(tabs) == [rep.SUMMARY, rep._steps_title(64), rep.HOST, rep.TERMS, rep.REAL]
    summ = tabs[rep.SUMMARY]
    assert summ[0]["speedup @6.55"] == pytest.approx(6.55 * 25 / 41)
    assert summ[1]["note"] == "skipped: too big" and "iter ms" not in summ[1]
    assert summ[0]["iter/serial"] == pytest.approx(41.0 / (1000 * summ[0]["iter serial floor ms"]))
    assert summ[0]["iter/serial"] <= summ[0]["iter/floor"]
    assert all(r["serial floor us"] >= r["floor us"] * (1 - 1e-9) for r in tabs[rep.TERMS])
    steps = {r["impl"]: r for r in tabs[rep._steps_title(64)]}
    assert set(steps) == {"draft", "verify", "draft+verify", "decode"}
    assert steps["draft+verify"]["floor us"] == pytest.approx(
        steps["draft"]["floor us"] + steps["verify"]["floor us"])
    host = {r["loop"]: r for r in tabs[rep.HOST]}
    assert host["one graph"]["GPU idle ms/iter"] == pytest.approx(0.01)
    assert host["staged"]["GPU idle ms/iter"] == pytest.approx(0.02)
    text = res.format()
    assert "B=9 S=64" in text and "speedup @16" in text
    paths = res.write(tmp_path)
    assert (tmp_path / "e2e-test.md").exists() and (tmp_path / "e2e-test.json").exists()
    assert all(p.exists() for p in paths)


def test_report_exact_table():
    """bench e2e --exact: the exact-mode table, its costs against the default of the same run."""
    t, d = tiny_target_cfg(), tiny_drafter_cfg()
    res = rep.E2EResults("e2e-test", floors={"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0})
    m = {"batch": 1, "context": 64, "draft": _fake(10.0), "verify": _fake(30.0),
         "iteration": _fake(41.0), "decode": _fake(25.0), "verify exact": _fake(33.0),
         "iteration exact": _fake(43.0), "decode exact": _fake(30.0),
         "loop": {"wall_us": 50.0, "graphs_us": 40.0, "idle_us": 10.0, "iters": 20}}
    rep.report(res, t, d, [{"batch": 1, "context": 64, "mem": 1e9, "m": m, "note": ""}], [])
    row = res.tables()[rep.EXACT][0]
    assert row["verify exact cost %"] == pytest.approx(10.0)
    assert row["decode exact cost %"] == pytest.approx(20.0)
    assert row["draft+verify exact us"] == 43.0 and row["draft+verify us"] == 41.0


# ----------------------------------------------------------------------------- no GPU

@NO_CUDA
def test_run_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        e2e.run(quick=True)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        e2e.bench(tiny_target_cfg(), tiny_drafter_cfg(), [(1, 64)])


def _script(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_OPS_BENCH_E2E")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_script_help():
    p = _script("--help")
    assert p.returncode == 0, p.stderr
    assert "--quick" in p.stdout and "--cases" in p.stdout


def test_script_bad_cases():
    p = _script("--cases", "1y2")
    assert p.returncode == 2 and "not BxS" in p.stderr


@NO_CUDA
def test_script_needs_cuda(tmp_path):
    p = _script("--quick", "--out", str(tmp_path))
    assert p.returncode == 1
    assert "needs a CUDA GPU" in p.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_host_loop_is_the_loops_iteration(monkeypatch):
    """host_loop runs speculative_generate's iteration (speculator.step.Iteration) on the steps:
    on the CPU with static (uncaptured) steps, one Iteration call an iteration, each at the
    context (the starts are reset after every iteration); as one step, or staged."""
    from dflash_ops.models.drafter import DFlashDrafter, random_drafter_state
    from dflash_ops.models.target import Target
    from dflash_ops.speculator.draft_step import DraftStep
    from dflash_ops.speculator.step import Iteration
    from dflash_ops.speculator.verify_step import VerifyStep

    tcfg, dcfg = tiny_target_cfg(), tiny_drafter_cfg()
    one = dict(num_blocks=1, max_requests=1, max_len=16, dtype=torch.float32)
    target = Target.random(tcfg, seed=0, block_size=16, **one)
    drafter = DFlashDrafter(dcfg, random_drafter_state(dcfg), embed_tokens=target.embed,
                            lm_head=target.lm_head, cache_block_size=16, **one)
    batch, context, b = 2, 40, dcfg.block_size
    max_len = context + 2 * b
    e2e.install_caches(target, drafter, batch + 1, batch * -(-max_len // 16) + 1, max_len)
    for r in range(batch):
        target.add_request(r, max_len)
        drafter.cache.add_request(r, max_len)
    dstep = DraftStep(drafter, max_batch=batch, scratch_request=batch, block_size=b,
                      logits=False)
    vstep = VerifyStep(target, max_batch=batch, block_size=b, scratch_request=batch,
                       tap_layers=dcfg.target_layer_ids, logits=False)
    starts, real = [], Iteration.__call__
    monkeypatch.setattr(Iteration, "__call__", lambda self, state, rows: (
        starts.append(state.start.tolist()), real(self, state, rows))[1])
    pending = (torch.randn(batch * b, dcfg.n_taps * dcfg.target_hidden_size), torch.arange(batch),
               (context - b + torch.arange(b)).repeat(batch, 1))
    ones, real_one = [], Iteration._one_step
    monkeypatch.setattr(Iteration, "_one_step", lambda self, state, bucket: (
        ones.append(bucket), real_one(self, state, bucket))[1])
    for one in (True, False):  # the iteration as one step, then staged
        starts.clear(), ones.clear()
        with torch.no_grad():
            wall = e2e.host_loop(target, drafter, dstep, vstep, batch, context, pending,
                                 stop_id=tcfg.vocab_size - 1, iters=2, warmup=1, one=one)
        assert wall > 0 and starts == [[context] * batch] * 3
        assert ones == ([batch] * 3 if one else [])


def test_registered_suite():
    from dflash_ops.bench.harness import SUITES

    assert SUITES["e2e"][0] == "dflash_ops.bench.e2e"
    assert isinstance(rep.E2EResults("x"), Results)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_bench_tiny_on_gpu(tmp_path):
    """The whole suite on tiny models: every table filled, the real loop ran under graphs."""
    res = e2e.bench(tiny_target_cfg(), tiny_drafter_cfg(), [(1, 64), (3, 200)], quick=True,
                    name="e2e-tiny")
    tabs = res.tables()
    summ = tabs[rep.SUMMARY]
    assert [r["case"] for r in summ] == ["B=1 S=64", "B=3 S=200"]
    assert all(r.get("iter ms") and r.get("decode ms") and not r["note"] for r in summ), summ
    assert all("GPU idle ms/iter" in r for r in tabs[rep.HOST]), tabs[rep.HOST]
    real = tabs[rep.REAL]
    assert [r["case"] for r in real] == ["B=1", "B=3"]
    for r in real:
        assert not r["note"], r
        # 1 (first token) + 1 an iteration + 1 a capture (draft and verify, per bucket used:
        # at most buckets 3, 2 and 1 as requests finish)
        assert r["iterations"] + 1 < r["host syncs"] <= r["iterations"] + 1 + 2 * 3
    res.write(tmp_path)


def test_a_graph_that_disagrees_with_its_eager_step_is_not_timed():
    from dflash_ops.bench import e2e
    want = torch.arange(20)
    near = want.clone()
    near[3] = 0  # a near tie: one token of twenty
    assert e2e._agree("draft", near, want) == pytest.approx(0.95)
    with pytest.raises(RuntimeError, match=r"WRONG, not timed: the verify graph's tokens equal "
                                           r"its eager run's in 50\.0% of places"):
        e2e._agree("verify", torch.where(want % 2 == 0, want, -1), want)
