"""What folding silu_mul into the down projection's Triton GEMM saves (issue 19: the SwiGLU MLP's
launch between gate_up and down), at the decode / verify sizes of the Qwen3-8B target.

For M = 1, 8, 16 rows and down [4096, 12288] (bf16), with the launch the shipped linear table
names for that M (used on any GPU here, so the two sides run the same GEMM):

* ``silu_mul``: the SwiGLU op alone (its default kernel);
* ``gemm``: the GEMM alone on silu_mul's output;
* ``chain``: silu_mul then the GEMM (what the MLP ran before ``models.linear.linear_glu``);
* ``glu``: the GEMM reading gate | up and forming silu_mul's values in its loads
  (``triton.context.glu_proj``);

each the median us a call of CUDA-graph replays, inputs rotating over 2x L2 (the weight alone is
100 MB). ``glu`` is checked bit for bit against ``chain`` first. Floor: the weight's and x's
bytes over this run's copy bandwidth.

    python benchmarks/glu_probe.py
"""
import importlib.util
import sys
from pathlib import Path

N, K = 4096, 12288


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    import dflash_ops  # noqa: F401
    from dflash_ops.bench.harness import floor_us, measure_floors, rotating, time_fn
    from dflash_ops.models import linear as L
    from dflash_ops.triton import context as tc

    floors = measure_floors()
    print(f"copy {floors['copy_GBps']:.0f} GB/s; GPU {torch.cuda.get_device_name()}")
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    print("| M | cfg | silu_mul us | gemm us | chain us | glu us | glu - chain | floor us |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (1, 8, 16):
        cfg = L.TABLE.get((N, K), {}).get(L.m_bucket(m))
        if cfg is None or cfg == L.CUDA_CFG:
            print(f"| {m} | no Triton entry in the table | | | | | | |")
            continue
        cfg = tc.ProjCfg(*cfg)
        sets = rotating(lambda: (torch.randn(m, 2 * K, device="cuda",
                                             dtype=torch.bfloat16) * 2,), m * 2 * K * 2)
        out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        silu = torch.ops.dflash.silu_mul
        a_sets = [(silu(x),) for (x,) in sets]

        def chain(x):
            tc.launch_proj(silu(x), w, None, out, cfg)

        def glu(x):
            tc.launch_proj(x, w, None, out, cfg, glu=True)

        x0 = sets[0][0]
        want = torch.empty_like(out)
        tc.launch_proj(silu(x0), w, None, want, cfg)
        glu(x0)
        assert torch.equal(out, want), f"M {m}: glu differs from silu_mul + the same GEMM"
        t = {name: time_fn(fn, rotate=s, graph=True)["us"]
             for name, fn, s in (("silu_mul", silu, sets),
                                 ("gemm", lambda a: tc.launch_proj(a, w, None, out, cfg),
                                  a_sets),
                                 ("chain", chain, sets), ("glu", glu, sets))}
        fl = floor_us(floors, bytes_moved=N * K * 2 + m * 2 * K * 2 + m * N * 2)
        print(f"| {m} | {tuple(cfg)} | {t['silu_mul']:.2f} | {t['gemm']:.2f} | "
              f"{t['chain']:.2f} | {t['glu']:.2f} | {t['glu'] - t['chain']:+.2f} | {fl:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
