"""row_topk's launch widths (issue 16: the selector's top-k is 18.6 us of kernel time at B 1 x 1k
on the H100, four launches; session 35's profile): the DFlash 2 draft step's logits, [7 R,
248320] bf16, k 16, at R 1 and 8, timed with each launch's warp count changed alone and in
the combinations below, against the default (``triton.select.TOPK_WARPS``), CUDA-graph replay
over enough input sets that the logits do not stay in L2.

    python benchmarks/topk_probe.py     # ~40 s

Every variant is first checked bit for bit against the reference (row_topk_ref: torch.topk with
ties by index); a variant that differs prints WRONG and the probe exits 1. The floor column is
the logits' bytes over the copy rate measured in the same run.
"""
import importlib.util
import sys
from pathlib import Path

V, K = 248320, 16
ROWS = (7, 56)  # B 1 and 8 draft blocks of 8 (7 mask rows a request)
ROTATE_BYTES = 256 << 20
VARIANTS = ({}, {"merge": 2}, {"merge": 4}, {"threshold": 2}, {"threshold": 4}, {"chunk": 8},
            {"chunk": 2}, {"chunk": 1}, {"chunk_max": 8}, {"chunk_max": 2})


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from dflash_ops import dispatch
    from dflash_ops.bench.harness import measure_floors, time_fn
    from dflash_ops.ops.select import row_topk, row_topk_ref
    from dflash_ops.triton import select as ts

    if not torch.cuda.is_available():
        print("topk_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy = measure_floors()["copy_GBps"]
    base = dict(ts.TOPK_WARPS)
    print(f"topk_probe: {torch.cuda.get_device_name()}, torch {torch.__version__}; V {V}, k {K}, "
          f"bf16; copy {copy:.0f} GB/s; default warps {base}")
    print("| rows | warps changed | us | vs default | floor us |")
    print("|---|---|---|---|---|")
    bad = 0
    with dispatch.use_backend("triton", ops=("row_topk",)):
        for m in ROWS:
            nbytes = m * V * 2
            n = max(2, min(64, -(-ROTATE_BYTES // nbytes)))
            sets = [(torch.randn(m, V, device="cuda", dtype=torch.bfloat16),) for _ in range(n)]
            want = row_topk_ref(sets[0][0], K)
            fl = nbytes / (copy * 1e3)
            t0 = None
            for var in VARIANTS:
                ts.TOPK_WARPS.clear()
                ts.TOPK_WARPS.update(base, **var)
                got = row_topk(sets[0][0], K)
                ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                bad += not ok
                t = time_fn(lambda z: row_topk(z, K), rotate=sets, graph=True)["us"]
                t0 = t if t0 is None else t0
                name = ", ".join(f"{a} {b}" for a, b in var.items()) or "default"
                print(f"| {m} | {name} | {t:.2f}{'' if ok else ' WRONG'} | {t - t0:+.2f} | "
                      f"{fl:.2f} |", flush=True)
            del sets
    ts.TOPK_WARPS.clear()
    ts.TOPK_WARPS.update(base)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
