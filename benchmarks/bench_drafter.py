"""Drafter benchmark (one Qwen3-8B-DFlash draft step: the dflash reference eager, our drafter
eager and under its CUDA graph, the floor): a thin wrapper over ``dflash-ops bench drafter``.

    python benchmarks/bench_drafter.py [--out DIR] [--quick] [--no-plot]
                                       [--cases BxS,...] [--no-ref]

``--cases`` sets ``DFLASH_OPS_BENCH_DRAFTER_CASES`` (e.g. ``1x1024,64x4096,1x131072``: B
requests x S committed context tokens), ``--no-ref`` ``DFLASH_OPS_BENCH_DRAFTER_REF=0`` (no
reference column). The variables can also be set directly, for ``dflash-ops bench drafter``.
Shapes, columns, the floor and the run time: ``dflash_ops/bench/drafter.py``'s docstring.
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path


def _main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--cases", default=None)
    p.add_argument("--no-ref", action="store_true")
    a, rest = p.parse_known_args()
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    if a.cases is not None:
        os.environ["DFLASH_OPS_BENCH_DRAFTER_CASES"] = a.cases
    if a.no_ref:
        os.environ["DFLASH_OPS_BENCH_DRAFTER_REF"] = "0"
    if importlib.util.find_spec("dflash_ops") is None:  # run from a checkout without installing
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dflash_ops.bench import main

    return main(["drafter", *rest])


if __name__ == "__main__":
    sys.exit(_main())
