"""End-to-end DFlash benchmark: one iteration (draft + verify CUDA graphs) of a
Qwen3-8B-shaped target with a Qwen3-8B-DFlash-shaped drafter against a plain decode step, the
floors, the implied speedup, GPU idle time and host syncs. A wrapper over
``dflash-ops bench e2e``; what is measured and how: ``dflash_ops/bench/e2e.py``'s docstring (the
formulas and tables: ``dflash_ops/bench/e2e_report.py``'s).

    python benchmarks/bench_e2e.py [--quick] [--exact] [--cases 1x1024,64x8k] [--mem-gb 120]
                                   [--no-loop] [--out DIR] [--no-plot]

Needs a CUDA GPU with ~111 GB free for the largest default case (B 64 x S 8192; smaller budgets
skip the cases that do not fit). Full run ~3-4 minutes on an H200 (estimate), --quick ~1.5.
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_e2e.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="cases (1, 1024), (1, 8192), (32, 8192), shorter timing")
    p.add_argument("--cases", default=None,
                   help="comma-separated BxS (batch x context; k = 1024), e.g. 1x1024,64x8k "
                        "(sets DFLASH_OPS_BENCH_E2E_CASES)")
    p.add_argument("--mem-gb", type=float, default=None,
                   help="skip cases whose estimated memory exceeds this (default 120; sets "
                        "DFLASH_OPS_BENCH_E2E_MEM_GB)")
    p.add_argument("--exact", action="store_true",
                   help="also verify, iteration and decode in exact mode, beside the default")
    p.add_argument("--no-loop", action="store_true",
                   help="skip the speculative_generate run (host syncs from the real loop)")
    p.add_argument("--out", default=None, help="results directory (default ./benchmarks/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    return p


def _main() -> int:
    a = _parser().parse_args()
    if importlib.util.find_spec("dflash_ops") is None:  # run from a checkout without installing
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dflash_ops.bench import main
    from dflash_ops.bench.e2e import ENV_CASES, ENV_LOOP, ENV_MEM, parse_cases

    if a.cases is not None:
        try:
            parse_cases(a.cases, "--cases")
        except ValueError as e:
            print(f"bench_e2e.py: {e}", file=sys.stderr)
            return 2
        os.environ[ENV_CASES] = a.cases
    if a.mem_gb is not None:
        os.environ[ENV_MEM] = str(a.mem_gb)
    if a.no_loop:
        os.environ[ENV_LOOP] = "0"
    rest = ["--quick"] * a.quick + ["--exact"] * a.exact + ["--no-plot"] * a.no_plot
    rest += ["--out", a.out] if a.out else []
    return main(["e2e", *rest])


if __name__ == "__main__":
    sys.exit(_main())
