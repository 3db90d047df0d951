"""DFlash 2's two convolution ops alone (issue 16: each at >= 70% of the copy bandwidth for
T >= 4096 rows, and their fixed cost at the drafter's 8-64 block rows): ``dflash-ops bench
dflash2``'s grouped_dyn_conv and conv_add_rms_norm tables (Qwen3.8-27B-DFlash2's shape, bf16,
Triton and CUDA, each row with its error against the op's reference) at T 8 .. 16384, without
the suite's selector tables, in ~30 s.

    python benchmarks/conv_probe.py     # gpu_check.sh compare (COMPARE_SUITES=conv) runs this
                                        # file over an old and a new package
"""
import importlib.util
import sys
from pathlib import Path

CONV_T = (8, 64, 512, 4096, 16384)
NORM_T = (8, 64, 512, 4096)


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from dflash_ops.bench import dflash2
    from dflash_ops.bench.harness import Results, measure_floors

    if not torch.cuda.is_available():
        print("conv_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    res = Results("conv_probe", floors=measure_floors())
    timing = dict(warmup_ms=10, rep_ms=40)
    dflash2._conv(res, CONV_T, timing)
    dflash2._conv_norm(res, NORM_T, timing)
    print(res.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
