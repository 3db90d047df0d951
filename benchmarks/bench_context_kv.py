"""Context K/V benchmarks (knorm_rope_, qk_norm_rope_, store_kv_): a thin wrapper over
``dflash-ops bench context_kv``.

    python benchmarks/bench_context_kv.py [--out DIR] [--quick] [--no-plot]

``DFLASH_OPS_BENCH_MODELS=Qwen3-8B`` (or gpt-oss-20b-DFlash) runs one model's tables only.
"""
import sys
from pathlib import Path

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_ops.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["context_kv", *sys.argv[1:]]))
