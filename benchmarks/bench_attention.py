"""Block attention benchmarks (``block_attention``: 16 queries a request over a paged KV cache,
against SDPA's backends and FlexAttention): a thin wrapper over ``dflash-ops bench attention``.

    python benchmarks/bench_attention.py [--out DIR] [--quick] [--no-plot]
                                         [--cases BxS,...] [--tables paged,masks] [--no-flex]

``--cases`` sets ``DFLASH_OPS_BENCH_ATTN_CASES`` (e.g. ``1x131072,128x8192``: the shapes of the
paged table), ``--tables`` ``DFLASH_OPS_BENCH_ATTN_TABLES`` (paged, masks), ``--no-flex``
``DFLASH_OPS_BENCH_ATTN_FLEX=0`` (no FlexAttention columns: their torch.compile calls are most of
the run time). The variables can also be set directly, for ``dflash-ops bench attention``.
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path


def _main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--cases", default=None)
    p.add_argument("--tables", default=None)
    p.add_argument("--no-flex", action="store_true")
    a, rest = p.parse_known_args()
    if a.cases is not None:
        os.environ["DFLASH_OPS_BENCH_ATTN_CASES"] = a.cases
    if a.tables is not None:
        os.environ["DFLASH_OPS_BENCH_ATTN_TABLES"] = a.tables
    if a.no_flex:
        os.environ["DFLASH_OPS_BENCH_ATTN_FLEX"] = "0"
    if importlib.util.find_spec("dflash_ops") is None:  # run from a checkout without installing
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dflash_ops.bench import main

    return main(["attention", *rest])


if __name__ == "__main__":
    sys.exit(_main())
