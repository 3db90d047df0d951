"""Launch-config sweep for the norm kernels on the K-norm shape x[T, 40, 128] bf16, w[5, 128]:
the Triton (BLOCK_M, num_warps) grid, with the CUDA kernel as built for comparison. Prints GB/s
and % of copy bandwidth; the chosen defaults live in dflash_ops/triton/norm.py:config and
csrc/norm.cu:choose_shape."""
import sys

import torch

import dflash_ops
from dflash_ops.bench.harness import measure_floors, rotating, time_fn
from dflash_ops.triton import norm as tn

only_cuda = "--cuda-only" in sys.argv
copy = measure_floors()["copy_GBps"]
for t in (16, 4096, 16384):
    nbytes = 2 * t * 40 * 128 * 2

    def make():
        return (torch.randn(t, 40, 128, device="cuda", dtype=torch.bfloat16),
                torch.randn(5, 128, device="cuda", dtype=torch.bfloat16))

    sets = rotating(make, nbytes // 2)
    outs = [torch.empty_like(x) for x, _ in sets]
    res = []
    with dflash_ops.use_backend("cuda", ops=["rms_norm"]):
        us = time_fn(lambda x, w: torch.ops.dflash.rms_norm(x, w, 1e-6), rotate=sets,
                     graph=True)["us"]
    res.append(("cuda", us))
    if not only_cuda:
        for bm in (4, 8, 16, 32):
            for nw in (1, 2, 4):
                if bm * 128 < 32 * nw * 4:
                    continue
                table = {id(x): o for (x, _), o in zip(sets, outs)}
                fn = lambda x, w, bm=bm, nw=nw: tn._launch(  # noqa: E731
                    x, None, table[id(x)], w, 1e-6, "rms_norm", cfg=(bm, nw))
                res.append((f"triton BM{bm} w{nw}", time_fn(fn, rotate=sets, graph=True)["us"]))
    res.sort(key=lambda r: r[1])
    print(f"T={t} ({nbytes / 1e6:.1f} MB, floor {nbytes / copy / 1e3:.1f} us; triton default "
          f"{tn.config(128, t * 40)}):")
    for name, us in res[:8]:
        print(f"   {name:<22} {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s  "
              f"{100 * nbytes / us / 1e3 / copy:5.1f}%")
