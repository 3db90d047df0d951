"""RMSNorm benchmarks (rms_norm, fused_add_rms_norm_): a thin wrapper over ``dflash-ops bench norm``.

    python benchmarks/bench_norm.py [--out DIR] [--quick] [--no-plot] [--tables T1,T2]

``--tables host``: only the host-overhead tables (each op's default backend next to the others).
"""
import sys
from pathlib import Path

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_ops.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["norm", *sys.argv[1:]]))
