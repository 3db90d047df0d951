"""DFlash 2 op benchmarks (grouped_dyn_conv, select_candidates): a thin wrapper over
``dflash-ops bench dflash2``.

    python benchmarks/bench_dflash2.py [--out DIR] [--quick] [--no-plot]

"""
import sys
from pathlib import Path

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_ops.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["dflash2", *sys.argv[1:]]))
