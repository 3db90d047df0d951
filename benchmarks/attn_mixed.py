"""block_attention on batches of mixed lengths (CUDA graph replay), against the copy floor.

The paged table (``dflash-ops bench attention``) gives every request the same length. Serving
batches do not: this times the CUDA kernel (its automatic choice) on B requests whose lengths
are drawn, seeded, from [S / 8, S] (16 queries each, Hq 32 / Hkv 8, D 128, pages of 16, bf16,
a random block permutation), with the same one-line report per case as the paged table's
columns: us, % of copy (bytes = the keys each request holds, K and V once, plus q and out).
Run it in two trees to compare kernels within one call (`python benchmarks/attn_mixed.py` in
`.old` and here; session 23 compared the refuted persistent wgmma kernel this way).

    python benchmarks/attn_mixed.py [--cases 64x1024,32x4096,64x8192] [--seed 0]
"""
from __future__ import annotations

import argparse
import os

import torch

import dflash_ops
from dflash_ops.bench.harness import floor_us, measure_floors, rotating, time_fn
from dflash_ops.ops.attention import block_attention_ref

HQ, HKV, D, BS, QLEN = 32, 8, 128, 16, 16


def case(b: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(QLEN, s // 8), s + 1, (b,), generator=g)
    m = s // BS
    nb = b * m
    table = torch.randperm(nb, generator=g).view(b, m).to(torch.int32).cuda()
    seq = lens.to(torch.int32).cuda()
    qsl = (torch.arange(b + 1, dtype=torch.int32) * QLEN).cuda()
    keys = int(lens.sum())
    moved = 2 * keys * HKV * D * 2 + 2 * b * QLEN * HQ * D * 2 + nb * 4

    def make():
        return (torch.randn(b * QLEN, HQ, D, dtype=torch.bfloat16, device="cuda"),
                torch.randn(nb, BS, HKV, D, dtype=torch.bfloat16, device="cuda"),
                torch.randn(nb, BS, HKV, D, dtype=torch.bfloat16, device="cuda"))
    return table, seq, qsl, moved, keys, rotating(make, 2 * nb * BS * HKV * D * 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="64x1024,32x4096,64x8192",
                    help="comma-separated BxS: B requests of lengths in [S/8, S]")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cases = []
    for item in a.cases.split(","):
        parts = item.strip().lower().split("x")
        if (len(parts) != 2 or not all(x.isdigit() for x in parts) or int(parts[0]) < 1
                or int(parts[1]) < QLEN):
            ap.error(f"--cases: expected BxS with B >= 1 and S >= {QLEN} (e.g. 64x1024), "
                     f"got {item!r}")
        cases.append((item.strip(), *(int(x) for x in parts)))
    floors = measure_floors()
    print(f"commit {os.environ.get('DFLASH_OPS_COMMIT', '?')} copy {floors['copy_GBps']:.0f} "
          f"GB/s; lengths in [S/8, S], seed {a.seed}; checked against block_attention_ref "
          f"(max error <= 2 bf16 ulps of max |ref|) before timing")
    print(f"{'case':<12} {'keys':>9} {'us':>9} {'% copy':>7} {'floor us':>9} {'err':>9}")
    scale = D ** -0.5
    for item, b, s in cases:
        table, seq, qsl, moved, keys, sets = case(b, s, a.seed)
        q, kc, vc = sets[0]
        got = dflash_ops.block_attention(q, kc, vc, table, seq, qsl, scale).float()
        want = block_attention_ref(q, kc, vc, table, seq, qsl, scale).float()
        err = (got - want).abs().max().item()
        if not err <= 2 * 2.0 ** -7 * want.abs().max().item():  # 2 bf16 ulps (eps 2^-7)
            print(f"{item:<12} FAILED the check: max error {err:.3g}; not timed")
            continue
        t = time_fn(lambda q, kc, vc: dflash_ops.block_attention(q, kc, vc, table, seq, qsl,
                                                                 scale),
                    rotate=sets, graph=True)
        fl = floor_us(floors, moved)
        print(f"{item:<12} {keys:>9} {t['us']:>9.2f} {100 * fl / t['us']:>7.1f} {fl:>9.2f} "
              f"{err:>9.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
