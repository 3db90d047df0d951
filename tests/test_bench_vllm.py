"""benchmarks/bench_vllm.py's table (the run needs vLLM on a GPU: gpu_check.sh vllm-bench)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    assert lines[2] == ("| 1 x 1024 | 2.500 | 4.250 (+1.750) | 3.750 (+1.250) | - | "
                        "0.300 / 0.050 / - |")
    assert lines[3] == "| 8 x 8192 | - | 9.000 | - | - | 1.000 / - / - |"
    assert md.read_text().strip() == out.stdout.strip()
