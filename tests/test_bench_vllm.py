"""benchmarks/bench_vllm.py's table (the vLLM variants' run needs vLLM on a GPU: gpu_check.sh
vllm-bench) and its ``ours`` variant (our loop on the pair's checkpoints: runs on CPU too)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _table(rows, tmp_path, *args) -> list:
    """bench_vllm.py table over ``rows`` (written as a results file): its output lines."""
    res = tmp_path / "r.jsonl"
    res.write_text("\n".join(json.dumps(r) for r in rows))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "table",
                          str(res), *args], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()


def test_table_gives_each_variants_added_time_over_plain(tmp_path):
    rows = [dict(variant="plain", batch=1, context=1024, ms_per_iter=2.5, precompute_ms_mean=None),
            dict(variant="stock", batch=1, context=1024, ms_per_iter=4.25, precompute_ms_mean=0.3),
            dict(variant="plugin", batch=1, context=1024, ms_per_iter=3.75,
                 precompute_ms_mean=0.05),
            dict(variant="stock", batch=8, context=8192, ms_per_iter=9.0, precompute_ms_mean=1.0)]
    res = tmp_path / "r.jsonl"
    res.write_text("\n".join(json.dumps(r) for r in rows))
    md = tmp_path / "t.md"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "table",
                          str(res), "--md", str(md)], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[2] == ("| 1 x 1024 | 2.500 | 4.250 (+1.750) | 3.750 (+1.250) | - | - | "
                        "0.300 / 0.050 / - |")
    assert lines[3] == "| 8 x 8192 | - | 9.000 | - | - | - | 1.000 / - / - |"
    assert md.read_text().strip() == out.stdout.strip()


def test_table_reads_several_results_files_as_one(tmp_path):
    """Variants run in separate calls (stock, then plugin) make one table row."""
    files = []
    for i, r in enumerate([dict(variant="stock", batch=32, context=32768, ms_per_iter=52.19,
                                precompute_ms_mean=0.929),
                           dict(variant="plugin", batch=32, context=32768, ms_per_iter=52.022,
                                precompute_ms_mean=0.554)]):
        files.append(tmp_path / f"r{i}.jsonl")
        files[-1].write_text(json.dumps(r) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "table",
                          *map(str, files)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[2] == (
        "| 32 x 32768 | - | 52.190 | 52.022 | - | - | 0.929 / 0.554 / - |")
    missing = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"),
                              "table", str(files[0]), str(tmp_path / "nope.jsonl")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "results: expected a results file" in missing.stderr
    assert "nope.jsonl" in missing.stderr and "Traceback" not in missing.stderr


def _gen(path, outputs, accepted, drafted, drafts=((1, 2),)):
    path.write_text(json.dumps({"dtype": "float32", "outputs": outputs, "drafts": drafts,
                                "metrics": {"vllm:spec_decode_num_accepted_tokens": accepted,
                                            "vllm:spec_decode_num_draft_tokens": drafted}}))
    return str(path)


def _compare(*args):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_check.py"), "compare",
                          *args], capture_output=True, text=True)
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_check_compare_exact_and_rate(tmp_path):
    """vllm_check compare (gpu_check.sh vllm-counter's gate): --exact fails on one differing
    output or accepted count; --rate-tol compares acceptance rates; --min-rate fails a pair
    whose drafts are not accepted."""
    a = _gen(tmp_path / "a.json", [[1, 2], [3]], 300, 320)
    same = _gen(tmp_path / "b.json", [[1, 2], [3]], 300, 320)
    other = _gen(tmp_path / "c.json", [[1, 2], [4]], 300, 320)
    fewer = _gen(tmp_path / "d.json", [[1, 2], [3]], 290, 320)
    rc, res = _compare(a, same, "--exact")
    assert rc == 0 and res["outputs_equal"] == "2 of 2" and res["rate"] == [0.9375, 0.9375]
    rc, res = _compare(a, other, "--exact")
    assert rc == 1 and res["outputs_equal"] == "1 of 2"
    assert _compare(a, fewer, "--exact")[0] == 1
    assert _compare(a, fewer, "--rate-tol", "0.05")[0] == 0  # 3.3% lower
    assert _compare(a, fewer, "--rate-tol", "0.01")[0] == 1
    assert _compare(a, same, "--min-rate", "0.95")[0] == 1


def test_table_parts_sum_profiled_kernels_and_subtract_plain(tmp_path):
    k_plain = {"kernel_unified_attention_2d": 100.0, "nvjet_tst_128x64": 2000.0,
               "rms_norm_kernel": 50.0, "triton_poi_fused_add_0": 30.0}
    k_stock = dict(k_plain, kernel_unified_attention_2d=400.0, rotary_embedding_kernel=20.0,
                   reshape_and_cache_flash_kernel=10.0, nvjet_tst_128x64=2600.0)
    rows = [dict(variant="plain", batch=1, context=1024, ms_per_iter=2.5,
                 precompute_ms_mean=None, kernels_us_per_iter=k_plain),
            dict(variant="stock", batch=1, context=1024, ms_per_iter=4.0,
                 precompute_ms_mean=0.3, kernels_us_per_iter=k_stock)]
    lines = _table(rows, tmp_path, "--parts")
    assert "| 1 x 1024 | plain | 100.0 | 2000.0 | 50.0 | 30.0 | 2180.0 |" in lines
    assert ("| 1 x 1024 | stock | 400.0 (+300.0) | 2600.0 (+600.0) | 80.0 (+30.0) | "
            "30.0 (+0.0) | 3110.0 (+930.0) |") in lines


def test_table_splits_attention_by_owner(tmp_path):
    """Stock's drafter runs TRITON_ATTN like its target: its share is stock's TRITON_ATTN time
    minus the custom run's (the target's only there); ours is the dflash_ops attention kernels,
    and no other dflash_ops kernel (their names contain "flash") counts as attention."""
    ours = "void dflash_ops::attention::attn_mma_kernel<dflash_ops::detail::BF16, 128>(x)"
    ctx = "void dflash_ops::(anonymous namespace)::silu_kernel<8>(y)"
    rows = [dict(variant="plain", batch=1, context=8192, ms_per_iter=2.0,
                 kernels_us_per_iter={"kernel_unified_attention_2d": 250.0}),
            dict(variant="stock", batch=1, context=8192, ms_per_iter=6.0,
                 kernels_us_per_iter={"kernel_unified_attention_2d": 4000.0,
                                      "_prepare_dflash_inputs_kernel": 5.0}),
            dict(variant="custom", batch=1, context=8192, ms_per_iter=4.0,
                 kernels_us_per_iter={"kernel_unified_attention_2d": 2200.0, ours: 150.0,
                                      ctx: 7.0, "_prepare_dflash_inputs_kernel": 5.0})]
    lines = _table(rows, tmp_path, "--parts")
    assert "| 1 x 8192 | 2200.0 | 250.0 | 1800.0 | 150.0 | 12.00x |" in lines
    # the parts table: attention of custom = TRITON_ATTN + ours; silu and prepare are "other"
    assert any(ln.startswith("| 1 x 8192 | custom | 2350.0 (+2100.0) |") for ln in lines), lines


def test_table_takes_the_median_of_repeated_runs_and_judges_the_spread(tmp_path):
    def row(v, ms, b=1, s=1024):
        return dict(variant=v, batch=b, context=s, ms_per_iter=ms, precompute_ms_mean=None)
    rows = [row("plain", 2.0), row("stock", 4.0), row("plugin", 3.0), row("custom", 2.5),
            row("plain", 2.2), row("stock", 5.0), row("plugin", 4.5), row("custom", 2.6),
            row("stock", 4.4), row("plugin", 3.2),
            row("stock", 8.0, b=8), row("plugin", 9.0, b=8), row("stock", 8.2, b=8),
            row("plugin", 9.5, b=8)]
    lines = _table(rows, tmp_path)
    # the main table shows medians (plain: (2.0 + 2.2) / 2; stock 4.4; plugin 3.2)
    assert lines[2] == ("| 1 x 1024 | 2.100 | 4.400 (+2.300) | 3.200 (+1.100) | "
                        "2.550 (+0.450) | - | - / - / - |")
    at = lines.index(next(x for x in lines if x.startswith("repeated runs")))
    assert lines[at + 4] == ("| 1 x 1024 | 2.100 [2.000 - 2.200] (2) | 4.400 [4.000 - 5.000] "
                             "(3) | 3.200 [3.000 - 4.500] (3) | 2.550 [2.500 - 2.600] (2) | - | "
                             "-1.200 (within the spread) | -1.850 (faster) |")
    assert lines[at + 5] == ("| 8 x 1024 | - | 8.100 [8.000 - 8.200] (2) | 9.250 [9.000 - "
                             "9.500] (2) | - | - | +1.150 (slower) | - |")
    # one run each: no repeats table; a side with one run: no verdict
    assert not any(x.startswith("repeated runs") for x in _table(rows[:4], tmp_path))
    lines = _table(rows[:5], tmp_path)  # plain twice, the others once
    assert lines[-1].endswith("| -1.000 (one run a side: no spread) | "
                              "-1.500 (one run a side: no spread) |"), lines[-1]
    # runs of another setting are not merged into the median
    mixed = [dict(rows[0], new=64), dict(rows[4], new=128)]
    res = tmp_path / "m.jsonl"
    res.write_text("\n".join(json.dumps(r) for r in mixed))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "table",
                          str(res)], capture_output=True, text=True)
    assert out.returncode != 0 and "mixes runs of (new, dtype)" in out.stderr, out.stderr


def test_table_splits_the_precompute_kernels_the_plugin_replaces(tmp_path):
    """Stock's replaced kernels: the non-GEMM kernels only its profile has (vLLM's rms_norm,
    rotary, copies) plus the drafter's share of reshape_and_cache (shared with the target);
    the plugin's: those only its profile has (context_kv_'s). A GEMM in one profile only
    (cuBLAS picking another algorithm) and the kernels both run are not counted."""
    common = {"kernel_unified_attention_2d": 900.0, "nvjet_tst_128x16": 1500.0,
              "triton_red_fused_add_rms_norm_0": 20.0}
    st = dict(common, **{"void vllm::rms_norm_kernel<bf16, 8, 2, true>(x)": 2.0,
                         "void vllm::rotary_embedding_kernel<bf16>(y)": 2.0,
                         "void at::native::elementwise_kernel<128, 4>(copy)": 3.0,
                         "reshape_and_cache_kernel_flash": 22.0,
                         "nvjet_tst_256x160_coopA": 18.0})
    pl = dict(common, **{"void dflash_ops::(anonymous namespace)::rms_norm_block_kernel<8>(a)":
                         1.5, "void dflash_ops::(anonymous namespace)::context_kv_kernel<b>(c)":
                         2.5, "reshape_and_cache_kernel_flash": 16.0})
    rows = [dict(variant=v, batch=8, context=1024, ms_per_iter=3.0, kernels_us_per_iter=k)
            for v, k in (("stock", st), ("plugin", pl))]
    lines = _table(rows, tmp_path, "--parts")
    # stock: 2 + 2 + 3 + (22 - 16) = 13; plugin: 1.5 + 2.5 = 4; removed 1 - 4 / 13 = 69%
    assert "| 8 x 1024 | 13.0 | 4.0 | 69% |" in lines, lines


def test_ours_variant_runs_our_loop_on_the_pairs_checkpoints(tmp_path):
    """``run --variant ours`` (no vLLM): our loop and our plain decode on a tiny pair written by
    vllm_check.py make-pair; the table puts its time over our own plain decode. 32 new tokens:
    the plain decode's time is a difference of two runs (with and without them), and with 8 a
    loaded CPU once made it negative (clamped to 0)."""
    bench, check = (str(ROOT / "benchmarks" / f) for f in ("bench_vllm.py", "vllm_check.py"))
    pair, res = tmp_path / "pair", tmp_path / "r.jsonl"
    subprocess.run([sys.executable, check, "make-pair", str(pair), "--width", "tiny"],
                   capture_output=True, text=True, check=True)
    r = subprocess.run([sys.executable, bench, "run", str(pair), "--variant", "ours", "--batch",
                        "1,2", "--context", "32", "--new", "32", "--dtype", "float32", "--profile",
                        "2", "--out", str(res)], capture_output=True, text=True, env={
                            **__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert [(x["variant"], x["batch"], x["context"]) for x in rows] == [
        ("ours", 1, 32), ("ours", 2, 32)]
    for x in rows:
        assert x["iterations"] >= 1 and x["ms_per_iter"] > 0 and x["plain_ms_per_token"] > 0
        assert x["steps"] == "direct"  # CPU: no graphs
        assert isinstance(x["kernels_us_per_iter"], dict)  # --profile ran (CPU: no GPU time)
    lines = _table(rows, tmp_path)
    want = rows[0]
    assert lines[2].startswith("| 1 x 32 | - | - | - | - | ")
    assert f"{want['ms_per_iter']:.3f} (+{want['ms_per_iter'] - want['plain_ms_per_token']:.3f} " \
           f"over {want['plain_ms_per_token']:.3f})" in lines[2]


def test_gpu_memory_outside_a_fraction_is_named(tmp_path):
    for bad in ("0", "1.5", "-0.2"):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "run",
                              str(tmp_path), "--variant", "stock", "--out",
                              str(tmp_path / "o.jsonl"), "--gpu-memory", bad],
                             capture_output=True, text=True)
        assert out.returncode == 2 and "--gpu-memory: expected a fraction in (0, 1]" in out.stderr
        assert not (tmp_path / "o.jsonl").exists()
