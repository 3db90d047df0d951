"""block_attention at the target's decode and verify shapes (issue 19's attention part; issue 17
times the drafter's 16-query blocks): Qwen3-8B's attention (Hq 32, Hkv 8, D 128, bf16, pages of
16 keys), one query a request (decode) and 16 (verify / draft), CUDA kernel, CUDA-graph replay
over enough input sets (distinct pages of one cache) that K/V does not stay in L2.

    python benchmarks/attn_probe.py        # ~30 s; gpu_check.sh compare (COMPARE_SUITES=attn)
                                           # runs this file over an old and a new package
    python benchmarks/attn_probe.py --split-keys 64,128,256   # also at fixed key splits

Each case is first checked against the torch reference (2 bf16 ulps of the largest value).
The floor column is K/V bytes over the copy rate measured in the same run. ``--split-keys``:
one more column a value, the same call with ``split_keys`` (absolute splits of that many keys,
ceil(S / value) of them, at most 32): how many splits the decode shapes want (the automatic
count was tuned on 16-query blocks).
"""
import argparse
import importlib.util
import math
import sys
from pathlib import Path

HQ, HKV, D, BLOCK = 32, 8, 128, 16
CASES = ((1, 1024, 1), (1, 8192, 1), (1, 32768, 1), (8, 1024, 1), (8, 8192, 1), (32, 1024, 1),
         (32, 8192, 1), (1, 1024, 16), (8, 4096, 16))  # (B, keys a request, queries a request)
ROTATE_BYTES = 256 << 20  # K/V bytes the input sets span at least (several L2s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split-keys", default="", metavar="N,N,...",
                    help="also time split_keys = each value (multiples of 64)")
    args_ = ap.parse_args()
    split_keys = [int(v) for v in args_.split_keys.split(",") if v]
    if any(v <= 0 or v % 64 for v in split_keys):
        ap.error(f"--split-keys: positive multiples of 64, got {args_.split_keys}")
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    import dflash_ops
    from dflash_ops.bench.harness import measure_floors, time_fn

    if not torch.cuda.is_available():
        print("attn_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dt = "cuda", torch.bfloat16
    floors = measure_floors()
    copy = floors["copy_GBps"]
    print(f"attn_probe: {torch.cuda.get_device_name()}, torch {torch.__version__}; Hq {HQ}, "
          f"Hkv {HKV}, D {D}, bf16, pages of {BLOCK}; copy {copy:.0f} GB/s")
    extra = "".join(f" split_keys {v} us |" for v in split_keys)
    print(f"| B x S | queries a request | sets | us | floor us | x floor |{extra}")
    print("|---|---|---|---|---|---|" + "---|" * len(split_keys))
    g = torch.Generator(device=dev).manual_seed(0)
    scale = 1 / math.sqrt(D)
    for b, s, ql in CASES:
        blocks = b * (s // BLOCK)
        kv_bytes = 2 * b * s * HKV * D * 2
        sets = max(1, min(32, -(-ROTATE_BYTES // kv_bytes)))
        nb = sets * blocks
        kc = torch.randn(nb, BLOCK, HKV, D, device=dev, generator=g).to(dt)
        vc = torch.randn(nb, BLOCK, HKV, D, device=dev, generator=g).to(dt)
        perm = torch.randperm(nb, device=dev, generator=g).to(torch.int32)
        sl = torch.full((b,), s, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, b * ql + 1, ql, dtype=torch.int32, device=dev)
        args = []
        for i in range(sets):
            table = perm[i * blocks:(i + 1) * blocks].view(b, s // BLOCK)
            q = torch.randn(b * ql, HQ, D, device=dev, generator=g).to(dt)
            args.append((q, table, torch.empty_like(q)))

        def call(q, table, out, backend="cuda", sk=0):
            with dflash_ops.use_backend(backend, ops=["block_attention_out_"]):
                dflash_ops.block_attention(q, kc, vc, table, sl, qsl, scale, False, -1, None,
                                           sk, out=out)

        q, table, out = args[0]
        want = torch.empty_like(q)
        call(q, table, want, "torch")
        call(q, table, out)
        torch.cuda.synchronize()
        err = (out.float() - want.float()).abs().max().item()
        # 2 bf16 ulps of max |ref|, no floor at 1: outputs shrink with S (~0.03 at 1 x 32k),
        # and a floor let a kernel that dropped one of 32 key splits pass
        tol = 2 * 2 ** -7 * want.float().abs().max().item()
        if not err <= tol:
            print(f"attn_probe: {b} x {s}: max error {err:.3e} > {tol:.3e} against the torch "
                  f"reference", file=sys.stderr)
            return 1
        us = time_fn(call, rotate=args, graph=True)["us"]
        floor = kv_bytes / (copy * 1e3)
        cols = ""
        for v in split_keys:
            if -(-s // v) > 32:
                cols += " n/a (> 32 splits) |"
                continue
            call(q, table, out, sk=v)
            torch.cuda.synchronize()
            err = (out.float() - want.float()).abs().max().item()
            if not err <= tol:
                print(f"attn_probe: {b} x {s} split_keys {v}: max error {err:.3e} > {tol:.3e}",
                      file=sys.stderr)
                return 1
            t = time_fn(lambda q, table, out: call(q, table, out, sk=v), rotate=args,
                        graph=True)["us"]
            cols += f" {t:.2f} |"
        print(f"| {b} x {s} | {ql} | {sets} | {us:.2f} | {floor:.2f} | {us / floor:.2f} |{cols}",
              flush=True)
        del kc, vc, args, want
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
