"""Block attention benchmarks (``block_attention``: 16 queries a request over a paged KV cache,
against SDPA's backends and FlexAttention): a thin wrapper over ``dflash-ops bench attention``.

    python benchmarks/bench_attention.py [--out DIR] [--quick] [--no-plot]
                                         [--cases BxS,...] [--tables paged,masks] [--no-flex]

``--cases`` (e.g. ``1x131072,128x8192``) replaces the shapes of the paged table, ``--tables``
picks tables, ``--no-flex`` drops the FlexAttention columns (their torch.compile calls are most
of the run time).
"""
import sys
from pathlib import Path

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_ops.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["attention", *sys.argv[1:]]))
