"""A small experiment harness for the CUDA block_attention kernel's launch settings: graph-replay
time and % of copy bandwidth of ``block_attention`` (cuda backend, non-causal, Hq 32, Hkv 8, D
128, 16 queries a request, paged bf16 cache) at a few shapes, under whatever DFLASH_OPS_ATTN_*
environment this process was started with (stages, split keys, carveout; DFLASH_OPS_ATTN_DEBUG=1
prints the kernel's registers, shared memory and occupancy). Compare settings by running it once
per setting:

    for st in 2 3; do for cv in "" 100; do
      DFLASH_OPS_ATTN_STAGES=$st DFLASH_OPS_ATTN_CARVEOUT=$cv DFLASH_OPS_ATTN_DEBUG=1 \\
        python benchmarks/attn_probe.py --cases 1x131072,32x4096; done; done
"""
import argparse
import os

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x131072,32x4096,128x8192")
    a = ap.parse_args()
    from dflash_ops.bench import attention as ba
    from dflash_ops.bench.harness import measure_floors, time_fn

    floors = measure_floors()
    bw = floors["copy_GBps"]
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("DFLASH_OPS_ATTN")) or "defaults"
    for spec in a.cases.split(","):
        b, s = (int(x) for x in spec.split("x"))
        case = ba.Case(b, s)
        col = ba.ours(case, "cuda")
        with col.ctx():  # forces the cuda backend
            t = time_fn(col.fn, rotate=case.sets, graph=True, warmup_ms=25, rep_ms=200)
        moved = case.bytes_moved(s)
        gbps = moved / (t["us"] * 1e3)
        pct = f"{100 * gbps / bw:5.1f}% of copy"
        print(f"B={b} S={s}: {t['us']:8.1f} us  {gbps:7.1f} GB/s  {pct}  [{settings}]",
              flush=True)
        del case
        torch.cuda.empty_cache()
    print(f"floors: {floors}")


if __name__ == "__main__":
    main()
