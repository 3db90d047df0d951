"""Which GEMM launches give exact mode's bits (issue 19): a question for the GPU, not a contract.

Exact mode needs a row's logits independent of the rows sharing the call. Its default launch
fixes the whole launch per (N, K) (``models.linear.exact_default``: one tile, one split, serial
or not by M; session 25's answer below let the table pick a tile per M). If the bits depend only on the split and the order of the k16 MMA steps, not on the tile
(BLOCK_M / N / K, warps, stages, TMA or pointers), exact mode could take a large-M tile at the
verify's 512 rows (its +41% at 32 x 8k in session 21 is the 64 x 128 tile's speed there) and
keep the bits. This script answers it on the GPU it runs on: for each shape and M, exact
mode's launch is the reference and every other launch in a grid (same split, the slices summed
alike) is compared with it bit for bit; the table lists each launch's verdict (equal, or the
count of differing elements and the largest difference in ulps of bf16), and cuBLAS's for
scale. Rows of x are random; a row's result is also compared between M 1 and M 512 calls.

    python benchmarks/exact_probe.py [--shapes o,qkv,down] [--ms 1,16,512]

About 1-2 minutes on the H200 (~35 compiles dominate).
"""
import argparse
import importlib.util
import sys
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}


def ulps(a, b):
    """Elementwise distance in bf16 ulps (the bit patterns as ordered integers)."""
    import torch

    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return (ordered(a) - ordered(b)).abs()


def launches(ref, tc):
    """The grid: exact mode's launch ``ref`` with one thing changed at a time (BLOCK_M 128,
    BLOCK_N 64 / 256, BLOCK_K 128, 8 warps, 2 / 4 stages, TMA, serial flipped), and two large
    tiles (128 x 128 and 128 x 256, 8 warps, TMA): every one a wgmma tile with the same split."""
    r = ref
    for cfg in (r._replace(bm=128), r._replace(bn=64), r._replace(bn=256, warps=8),
                r._replace(bk=128), r._replace(warps=8), r._replace(stages=2),
                r._replace(stages=4), r._replace(tma=True), r._replace(serial=not r.serial),
                r._replace(bm=128, bn=128, warps=8, tma=True),
                r._replace(bm=128, bn=256, warps=8, tma=True)):
        yield cfg._replace(stages=tc._stages(cfg.stages, cfg.bm, cfg.bn, cfg.bk, 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="o,qkv,down", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--ms", default="1,16,512")
    a = ap.parse_args()
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; known: {list(SHAPES)}")
    ms = [int(v) for v in a.ms.split(",") if v]
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("exact_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dflash_ops.models import linear as L
    from dflash_ops.triton import context as tc

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name in shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        x_all = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        rows = {}
        for m in ms:
            x = x_all[:m]
            ref_cfg = L.exact_default(m, n, k, x.device)
            ref = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            tc.launch_proj(x, w, None, ref, ref_cfg)
            rows[m] = ref
            print(f"\n{name} N={n} K={k} M={m}: exact {tuple(ref_cfg)}", flush=True)
            same = 0
            for cfg in launches(ref_cfg, tc):
                out = torch.empty_like(ref)
                try:
                    tc.launch_proj(x, w, None, out, cfg)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"   {tuple(cfg)}: failed {type(e).__name__}: {str(e)[:60]}")
                    continue
                d = ulps(out, ref)
                bad_n = int((d > 0).sum())
                same += bad_n == 0
                print(f"   {tuple(cfg)}: " + ("equal" if bad_n == 0 else
                      f"{bad_n} of {d.numel()} differ, max {int(d.max())} ulp"), flush=True)
            d = ulps(F.linear(x, w), ref)
            print(f"   cuBLAS: {int((d > 0).sum())} of {d.numel()} differ, max {int(d.max())} "
                  f"ulp; {same} launches equal to exact mode's", flush=True)
        m0 = min(ms)
        for m in ms:  # exact mode itself: the first rows alike at every M
            d = ulps(rows[m][:m0], rows[m0])
            print(f"{name}: exact rows 0..{m0 - 1} at M {m} vs M {m0}: "
                  f"{'equal' if int(d.max()) == 0 else f'DIFFER (max {int(d.max())} ulp)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
