"""What the Triton block-attention kernel compiles to on the H200, without a GPU: the kernel
compiled for sm_90 (triton.compile with a GPUTarget; pointer and stride arguments marked
divisible by 16, as a launch specialises them), then its shared memory and the instructions
that say how it runs (wgmma: Hopper tensor cores; cp.async: pipelined loads; mma.sync: the
pre-Hopper path). One line per launch configuration:

    python benchmarks/triton_sm90_report.py [--configs 64x2x4,64x3x4,...]   # BN x stages x warps

Found with it (2026-12-02): with the block table read inside the key loop the kernel held 82
KB (Q + two K/V stages) whatever num_stages was; with the table read a tile ahead the
stages take effect (benchmarks/NOTES.md, session 16).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32",
            "sl_ptr": "*i32", "qsl_ptr": "*i32", "sink_ptr": "*bf16", "out_ptr": "*bf16",
            "op_ptr": "*fp32", "lse_ptr": "*fp32"}


def compile_attention(block_n: int, stages: int, warps: int, splits: int = 32,
                      pdl: bool = False, g: int = 4, combine: bool = False) -> dict:
    """The sm_90 compile of ``triton.attention._attn_kernel`` (bf16, D 128, GQA ``g``, 16
    queries a request, non-causal) for one configuration: shared bytes and instruction counts
    (``pdl``: as launched as a programmatic dependent, triton/_pdl.py; ``combine``: the split
    combine kernel instead, with sinks)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_ops.triton import attention as A
    gp = triton.next_power_of_2(g)
    if combine:
        fn = A._combine_kernel
        consts = dict(G=g, GP=gp, D=128, BLOCK_Q=64 // gp or 1, SPLITS=splits, HAS_SINKS=True,
                      PDL=pdl)
    else:
        fn = A._attn_kernel
        consts = dict(G=g, GP=gp, D=128, BLOCK_Q=64 // gp or 1, BLOCK_N=block_n, SPLITS=splits,
                      CAUSAL=False, HAS_SINKS=False, NUM_STAGES=stages, PDL=pdl)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        else:
            sig[name] = "fp32" if name == "scale2" else "i32"
        if name in POINTERS or "_st" in name:
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, launch_pdl=pdl))
    ptx = k.asm["ptx"]
    return {"shared_bytes": k.metadata.shared,
            **{n: len(re.findall(p, ptx)) for n, p in (("wgmma", r"wgmma\.mma_async"),
                                                       ("cp.async", r"cp\.async\.[a-z]"),
                                                       ("mma.sync", r"mma\.sync"),
                                                       ("griddepcontrol.wait",
                                                        r"griddepcontrol\.wait"))}}


def _configs(text: str) -> list:
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", part.strip())
        if not m:
            raise argparse.ArgumentTypeError(f"--configs: {part!r} is not BNxSTAGESxWARPS")
        out.append(tuple(int(x) for x in m.groups()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", type=_configs, default=_configs("64x2x4,64x3x4,64x4x4,128x3x4"),
                   help="BN x stages x warps, comma-separated (default: %(default)s)")
    args = p.parse_args(argv)
    print(f"{'BN':>4} {'stages':>6} {'warps':>5} {'shared KB':>9} {'wgmma':>5} {'cp.async':>8} "
          f"{'mma.sync':>8}")
    for bn, st, w in args.configs:
        r = compile_attention(bn, st, w)
        print(f"{bn:>4} {st:>6} {w:>5} {r['shared_bytes'] / 1024:>9.1f} {r['wgmma']:>5} "
              f"{r['cp.async']:>8} {r['mma.sync']:>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
