"""Context K/V benchmarks (knorm_rope_, qk_norm_rope_, store_kv_, the fused context_kv_ path): a
thin wrapper over ``dflash-ops bench context_kv``.

    python benchmarks/bench_context_kv.py [--out DIR] [--quick] [--no-plot]
                                          [--models M1,M2] [--tables T1,T2]
                                          [--compiled-chain | --no-compiled-chain]

``--models``: Qwen3-8B, gpt-oss-20b-DFlash, Qwen3-4B, Qwen3.8-27B-DFlash2; ``--tables``:
knorm_rope_, qk_norm_rope_, store_kv_, context_kv_, context_kv_hidden_norm, host; e.g. only the
context_kv_ table of one model: ``--models Qwen3-8B --tables context_kv_``; only the host
overhead of each op's default backend: ``--tables host``.
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
