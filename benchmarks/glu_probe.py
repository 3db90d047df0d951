"""The SwiGLU in gate_up's epilogue (issue 19): ``glu_proj`` (one launch) against the chain it
replaces (the table's Triton GEMM, then ``silu_mul``) and cuBLAS + silu_mul, at Qwen3-8B's MLP
(gate_up [24576, 4096]) and 1 / 8 / 16 / 32 rows (decode, draft, verify at batch 1-2), bf16,
CUDA-graph replay over enough weight copies that the weight does not stay in L2. Second table:
the post-attention norm folded (o_proj's epilogue adds the residual, gate_up's applies rstd:
``proj_add_norm_`` + ``glu_proj(rstd=...)``) against o_proj + ``fused_add_rms_norm_`` +
``glu_proj``, o_proj [4096, 4096] with the table's launch.

    python benchmarks/glu_probe.py        # ~20 s; gpu_check.sh issue19 runs it too

Each case is first checked: the fused result equals the chain's with the same tile, bit for
bit (the fold: within 2% of the chain's largest value; its bits differ by design). The floor column is the weight's bytes over the copy rate measured in the same run.
"""
import importlib.util
import sys
from pathlib import Path

N, K = 24576, 4096  # Qwen3-8B gate_up: 2 x 12288 rows of 4096
ROWS = (1, 8, 16, 32)
ROTATE_BYTES = 256 << 20


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    import torch.nn.functional as F

    from dflash_ops.bench.harness import measure_floors, time_fn
    from dflash_ops.models import linear as L
    from dflash_ops.triton.act import silu_mul
    from dflash_ops.triton.context import ProjCfg, glu_proj, glu_tile, kv_proj

    if not torch.cuda.is_available():
        print("glu_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dt = torch.bfloat16
    floors = measure_floors()
    copy = floors["copy_GBps"]
    wbytes = N * K * 2
    ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5
          for _ in range(max(2, -(-ROTATE_BYTES // wbytes)))]
    print(f"glu_probe: {torch.cuda.get_device_name()}, torch {torch.__version__}; gate_up "
          f"[{N}, {K}] bf16, {len(ws)} weight copies; copy {copy:.0f} GB/s; us a call")
    print("| M | table cfg | GEMM + silu_mul (table tile) | glu_proj (half tile) | "
          "GEMM + silu_mul (half tile) | cuBLAS + silu_mul | floor | bits of the table tile |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for m in ROWS:
        cfg = L.TABLE.get((N, K), {}).get(L.m_bucket(m)) or (16, 64, 128, 8, 4, 4, True, False)
        if cfg == L.CUDA_CFG or (len(cfg) > 8 and cfg[8] > 1):
            cfg = (16, 64, 128, 8, 4, 4, True, False)  # the probe wants an unsplit tile
        pc = ProjCfg(*cfg)
        half = glu_tile(pc)
        x = torch.randn(m, K, device="cuda", dtype=dt)
        sets = [(x, w) for w in ws]
        fused = glu_proj(x, ws[0], cfg=half)
        ok = torch.equal(fused, silu_mul(kv_proj(x, ws[0], cfg=half)))
        bad += not ok
        same_tile = torch.equal(fused, silu_mul(kv_proj(x, ws[0], cfg=pc)))  # information only
        row = [time_fn(lambda x, w: silu_mul(kv_proj(x, w, cfg=pc)), rotate=sets, graph=True),
               time_fn(lambda x, w: glu_proj(x, w, cfg=half), rotate=sets, graph=True),
               time_fn(lambda x, w: silu_mul(kv_proj(x, w, cfg=half)), rotate=sets, graph=True),
               time_fn(lambda x, w: silu_mul(F.linear(x, w)), rotate=sets, graph=True)]
        cells = " | ".join(f"{r['us']:.2f}" for r in row)
        print(f"| {m} | {list(cfg)} | {cells}{'' if ok else ' WRONG'} | "
              f"{wbytes / (copy * 1e3):.2f} | {'yes' if same_tile else 'no'} |", flush=True)
    from dflash_ops.triton.context import proj_add_norm_
    import dflash_ops

    wo_bytes = 4096 * 4096 * 2
    wos = [torch.randn(4096, 4096, device="cuda", dtype=dt) / 64 for _ in range(len(ws))]
    nw = torch.ones(4096, device="cuda", dtype=dt)
    print("\n| M | o_proj cfg | o_proj + fused_add_rms_norm_ + glu_proj | proj_add_norm_ + "
          "glu_proj(rstd) | floor |")
    print("|---|---|---|---|---|")
    for m in ROWS[:3]:
        cg = L.TABLE.get((N, K), {}).get(L.m_bucket(m)) or (16, 64, 128, 8, 4, 4, True, False)
        co = L.TABLE.get((4096, 4096), {}).get(L.m_bucket(m))
        if cg == L.CUDA_CFG or (len(cg) > 8 and cg[8] > 1) or co in (None, L.CUDA_CFG):
            print(f"| {m} | {co} | (no Triton launches in the table here) | | |")
            continue
        half, pco = glu_tile(ProjCfg(*cg)), ProjCfg(*co)
        attn = torch.randn(m, 4096, device="cuda", dtype=dt)
        res = torch.randn(m, 4096, device="cuda", dtype=dt)
        sets = [(wo, w) for wo, w in zip(wos, ws)]

        def chain(wo, w):
            o = kv_proj(attn, wo, cfg=pco)
            dflash_ops.fused_add_rms_norm_(o, res, nw, 1e-6)
            return glu_proj(o, w, cfg=half)

        def fold(wo, w):
            u, ss = proj_add_norm_(attn, wo, None, res, nw, cfg=pco)
            return glu_proj(u, w, cfg=half, rstd=(ss, 1e-6))

        r0 = res.clone()
        a = chain(*sets[0])
        res.copy_(r0)
        b = fold(*sets[0])
        res.copy_(r0)
        ok = bool(((a.float() - b.float()).abs().max() <= 0.02 * a.float().abs().max()).item())
        bad += not ok
        tc = time_fn(chain, rotate=sets, graph=True)["us"]
        tf = time_fn(fold, rotate=sets, graph=True)["us"]
        print(f"| {m} | {list(co)} | {tc:.2f} | {tf:.2f}{'' if ok else ' WRONG'} | "
              f"{(wbytes + wo_bytes) / (copy * 1e3):.2f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
