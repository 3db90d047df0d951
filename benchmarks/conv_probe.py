"""DFlash 2's two convolution ops on the CUDA backend (the graphs' default), issue 16: each conv
op at >= 70% of the copy bandwidth for T >= 4096 rows, and their fixed cost at the drafter's
8-64 block rows. Qwen3.8-27B-DFlash2's shape: H 5120, K 2, groups of 16, blocks of 8, bf16;
``grouped_dyn_conv`` (the prepare conv) and ``conv_add_rms_norm_`` (the finish conv + residual
add + next RMSNorm), CUDA-graph replay over enough input sets that they do not stay in L2.

    python benchmarks/conv_probe.py     # ~20 s; gpu_check.sh compare (COMPARE_SUITES=conv)
                                        # runs this file over an old and a new package

Each case is first checked against the op's reference (grouped_dyn_conv: equal, the CUDA
kernel keeps the reference's rounding order; conv_add_rms_norm_: the residual equal, the
output within one bf16 ulp of 1 + its rstd's last bits); a case that differs prints WRONG and
the probe exits 1. The floor column is the bytes over the copy rate measured in the same run.
"""
import importlib.util
import sys
from pathlib import Path

H, K, GS, BLOCK = 5120, 2, 16, 8
TS = (8, 64, 512, 4096, 16384)


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from dflash_ops import dispatch
    from dflash_ops.bench.harness import floor_us, measure_floors, rotating, time_fn
    from dflash_ops.ops.conv import (conv_add_rms_norm, conv_add_rms_norm_ref, grouped_dyn_conv,
                                     grouped_dyn_conv_ref)

    if not torch.cuda.is_available():
        print("conv_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    floors = measure_floors()
    print(f"conv_probe: {torch.cuda.get_device_name()}, torch {torch.__version__}; H {H}, K {K}, "
          f"groups of {GS}, blocks of {BLOCK}, bf16; copy {floors['copy_GBps']:.0f} GB/s")
    print("| op | T | us | floor us | % of copy |")
    print("|---|---|---|---|---|")
    dev, bf16, g = "cuda", torch.bfloat16, H // GS
    w = 1 + 0.1 * torch.randn(H, dtype=bf16, device=dev)
    bad = 0
    with dispatch.use_backend("cuda", ops=("grouped_dyn_conv", "conv_add_rms_norm_")):
        for t in TS:
            def make(t=t):
                return (torch.randn(t, H, dtype=bf16, device=dev),
                        torch.randn(t, 2, K, g, dtype=bf16, device=dev)[:, 0],
                        torch.randn(K, H, dtype=bf16, device=dev))
            moved = t * H * 2 * 2 + t * K * g * 2 + K * H * 2  # x, y; dyn, base
            sets = rotating(make, moved)
            x, dyn, base = sets[0]
            ok = torch.equal(grouped_dyn_conv(x, dyn, base, GS, BLOCK),
                             grouped_dyn_conv_ref(x, dyn, base, GS, BLOCK))
            bad += not ok
            us = time_fn(lambda x, d, b: grouped_dyn_conv(x, d, b, GS, BLOCK), rotate=sets,
                         graph=True)["us"]
            fl = floor_us(floors, moved)
            print(f"| grouped_dyn_conv | {t} | {us:.2f}{'' if ok else ' WRONG'} | {fl:.2f} | "
                  f"{100 * fl / us:.1f} |", flush=True)
            del sets

            def make_n(t=t):
                return (torch.randn(t, H, dtype=bf16, device=dev),
                        torch.randn(t, H, dtype=bf16, device=dev),
                        torch.randn(t, 2, K, g, dtype=bf16, device=dev)[:, 0],
                        torch.randn(K, H, dtype=bf16, device=dev))
            moved = t * H * 2 * 4 + t * K * g * 2 + K * H * 2 + H * 2  # x, res r+w, out; ...
            sets = rotating(make_n, moved)
            x, r, dyn, base = sets[0]
            want, want_r = torch.empty_like(x), r.clone()
            conv_add_rms_norm_ref(x, want_r, dyn, base, GS, BLOCK, w, 1e-6, out=want)
            got_r = r.clone()
            got = conv_add_rms_norm(x, got_r, dyn, base, GS, BLOCK, w, 1e-6)
            ulp = want.float().abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 ulp, and a margin
            ok = torch.equal(got_r, want_r) and bool(((got.float() - want.float()).abs()
                                                       <= ulp + 1e-6).all())
            bad += not ok
            us = time_fn(lambda x, r, d, b: conv_add_rms_norm(x, r, d, b, GS, BLOCK, w, 1e-6),
                         rotate=sets, graph=True)["us"]
            fl = floor_us(floors, moved)
            print(f"| conv_add_rms_norm_ | {t} | {us:.2f}{'' if ok else ' WRONG'} | {fl:.2f} | "
                  f"{100 * fl / us:.1f} |", flush=True)
            del sets
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
