"""CPU tests of the benchmark plumbing: suite options on the command line (``harness.main``,
the runners under benchmarks/) and the host-overhead table by backend (``columns``)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dflash_ops import dispatch
from dflash_ops.bench import columns, harness

ROOT = Path(__file__).resolve().parent.parent


def test_name_list_keeps_known_order_and_rejects_unknown():
    parse = harness.name_list(("a", "b", "c"), "tables")
    assert parse("c, a") == ["a", "c"]
    with pytest.raises(Exception, match=r"unknown tables \['x'\]; tables are \['a', 'b', 'c'\]"):
        parse("a,x")


@pytest.fixture
def fake_suite(monkeypatch):
    """A suite ``fake`` whose run records its arguments; CUDA reported available."""
    mod = types.ModuleType("fake_bench_suite")
    seen = {}
    res = harness.Results("fake", meta={"date": "d"})  # before CUDA is faked (env_info)

    def add_options(p):
        p.add_argument("--tables", type=harness.name_list(("a", "b"), "tables"), default=None)

    def run(quick=False, tables=None):
        seen.update(quick=quick, tables=tables)
        return res

    mod.add_options, mod.run = add_options, run
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(harness.SUITES, "fake", (mod.__name__, "a test suite"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return seen


def test_suite_options_reach_run_and_the_results(fake_suite, tmp_path):
    assert harness.main(["fake", "--quick", "--tables", "b", "--out", str(tmp_path),
                         "--no-plot"]) == 0
    assert fake_suite == {"quick": True, "tables": ["b"]}
    meta = json.loads((tmp_path / "fake.json").read_text())
    assert meta["options"] == {"tables": ["b"]}
    assert "options: tables=['b']" in (tmp_path / "fake.md").read_text()


def test_suite_options_need_one_suite(fake_suite, capsys):
    with pytest.raises(SystemExit) as e:
        harness.main(["fake", "norm", "--tables", "a"])
    assert e.value.code == 2 and not fake_suite
    assert "accepted with one suite named" in capsys.readouterr().err


def test_bad_option_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        harness.main(["attention", "--cases", "1x100"])
    assert e.value.code == 2
    assert "'1x100': need B >= 1 and S a multiple of 16" in capsys.readouterr().err


@pytest.mark.parametrize("suite, options", [
    ("norm", ["--tables"]),
    ("attention", ["--cases", "--tables", "--no-flex"]),
    ("context_kv", ["--models", "--tables", "--no-compiled-chain"]),
])
def test_runner_help_lists_the_suite_options(suite, options):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"bench_{suite}.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"{suite} options" in p.stdout
    for opt in options:
        assert opt in p.stdout


@pytest.mark.skipif(dispatch.has_backend("rms_norm", "cuda"), reason="CPU-only build expected")
@pytest.mark.parametrize("syncs", [(), ("rms_norm",)])
def test_backend_host_table_runs_each_backend_it_names(monkeypatch, syncs):
    """The default column runs the backend the op resolves to, each other column its backend
    forced; backends the op lacks (cuda in a CPU build) and the torch backend of an op that
    synchronises are n/a."""
    ran = []
    monkeypatch.setattr(columns, "host_overhead_us", lambda fn: (ran.append(fn()), len(ran))[1])
    res = harness.Results("t", meta={"date": "d"})
    columns.backend_host_table(res, "host", {"rms_norm": lambda: dispatch.resolve("rms_norm")},
                               syncs=syncs)
    (row,) = res.rows
    default = dispatch.resolve("rms_norm")
    assert row["op"] == "rms_norm" and row["default"] == default
    assert ran == [default, "triton"] + ([] if syncs else ["torch"])
    assert row["default us"] == 1 and row["triton us"] == 2 and row["cuda us"] is None
    assert row["torch us"] == (None if syncs else 3)
    assert ("torch: not measured (synchronises)" in row["note"]) == bool(syncs)


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1, (out, err)
    assert lines[0].startswith("dflash-ops bench: error: "), lines
    return lines[0]


@pytest.mark.parametrize("value", ["5", "-1", "two"])
def test_policy_share_out_of_range_is_one_line(value, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        harness.main(["policy", "--share", value])
    assert e.value.code == 2
    line = _one_error_line(capsys)
    assert f"argument --share: got '{value}'; allowed: an integer 0 .. 4" in line, line


@pytest.mark.parametrize("suite, var, value, message", [
    ("policy", "DFLASH_OPS_BENCH_POLICY_CASES", "2x1q", "'2x1q' is not BxS"),
    ("policy", "DFLASH_OPS_BENCH_POLICY_PS", "0.3", "'0.3' is not a comma-separated subset"),
    ("drafter", "DFLASH_OPS_BENCH_DRAFTER_CASES", "1x1", "'1x1': need B >= 1 and S >= 16"),
    ("e2e", "DFLASH_OPS_BENCH_E2E_CASES", "8xk", "'8xk' is not BxS"),
    ("e2e", "DFLASH_OPS_BENCH_E2E_MEM_GB", "lots", "got 'lots'; allowed: a number of GB > 0"),
    ("e2e", "DFLASH_OPS_BENCH_E2E_MEM_GB", "-5", "got '-5'; allowed: a number of GB > 0"),
])
@pytest.mark.parametrize("named", [True, False])
def test_bad_bench_env_is_one_line_before_the_gpu_check(suite, var, value, message, named,
                                                        monkeypatch, capsys):
    """On a machine without a GPU too: the suites' checks run before harness.main's GPU check
    (before, a CPU run said "needs a CUDA GPU", a GPU run ended in a ValueError traceback)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(var, value)
    assert harness.main([suite] if named else []) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"dflash-ops bench: error: {var}: ") and message in line, line


def test_every_suite_that_reads_a_variable_checks_it_before_the_gpu_check():
    """harness.main turns a suite's check_options ValueError into one line before the GPU check;
    run has no such catch, so a suite that reads DFLASH_OPS_BENCH_* must have check_options."""
    import importlib
    for name, (module, _) in harness.SUITES.items():
        if _vars_read(module):
            assert callable(getattr(importlib.import_module(module), "check_options", None)), name


def _vars_read(module_name: str) -> set:
    import importlib
    src = Path(importlib.import_module(module_name).__file__).read_text(encoding="utf-8")
    return set(re.findall(r"[\"'](DFLASH_OPS_BENCH_\w+)[\"']", src))


def test_suite_env_lists_exactly_the_variables_each_suite_reads(capsys):
    for name, (module, _) in harness.SUITES.items():
        assert set(harness.SUITE_ENV.get(name, {})) == _vars_read(module), name
    assert harness.main(["--list"]) == 0
    out = capsys.readouterr().out
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for name, variables in harness.SUITE_ENV.items():
        listed = out.split(f"\n{name} ", 1)[1].split("\n")
        for var, what in variables.items():
            assert any(line.strip() == var + what for line in listed[1:len(variables) + 1]), var
            assert f"`{var}" in readme, var


@pytest.mark.parametrize("call_ms, want_samples", [(45.0, 16), (0.01, 10000)])
def test_events_timing_takes_at_least_ten_samples(monkeypatch, call_ms, want_samples):
    """do_bench repeats ~rep / one call: a 45 ms call got 2 samples at rep 100 ms; time_fn
    reruns it with a longer rep, and reports the samples it got."""
    import triton.testing
    from dflash_ops.bench import harness as h
    reps = []

    def fake_do_bench(fn, warmup=25, rep=100, return_mode="mean"):
        assert return_mode == "all"
        reps.append(rep)
        n = max(1, int(rep / call_ms))
        return [call_ms * (1 + 0.001 * (i % 3)) for i in range(n)]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    t = h.time_fn(lambda: None)
    assert t["samples"] == want_samples and t["mode"] == "events", (t, reps)
    assert t["us"] == pytest.approx(call_ms * 1e3, rel=0.01)
    assert len(reps) == (2 if call_ms > 10 else 1)
