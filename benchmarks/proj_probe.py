"""DFlash 2's kernel projection (x[8, 5120] @ w[1280, 5120]^T, bf16) launched back to back
inside one CUDA graph, each launch on its own copy of the weight (NW copies, more bytes than
L2 holds, so every launch streams its weight from HBM as in the draft step), for issue 16:
how far is the split-K GEMM from a kernel that only reads the same 13.1 MB?

Rows: a read-only Triton kernel over the weight (programs x chunk, a sum a program: the
bytes a GEMM must read, nothing else), cuBLAS (F.linear), the model's table config and
split-K / stage variants of ``launch_proj`` (session 40 refuted a stream-K launch: NOTES).
Then (session 40) the table config's split-K launch taken apart, each with PDL off as the
read-only kernel: its TMA tile loads alone (summed, no dot), its main loop alone (partials
stored, no counter and no reduction) and the whole launch: what the GEMM adds to the bytes.
Each GEMM row is checked against F.linear in fp32 before it is timed. us a launch:
harness.time_fn's graph mode over the NW copies (median over its replays).

    python benchmarks/proj_probe.py [--m 8] [--nw 12] [--write-table PATH]

--write-table PATH: a copy of models/linear_table.json whose (1280, 5120, M) entry holds the
fastest variant, written only where it beats the table's config by >= 0.5 us a launch (for
an A/B of the whole step with gpu_check.sh compare on a tree carrying that table).
"""
import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

if importlib.util.find_spec("dflash_ops") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dflash_ops.triton.context import _slice_acc, _tile_ids  # noqa: E402

N, H = 1280, 5120

# (name, ProjCfg fields): bm, bn, bk, gm, warps, stages, tma, persistent, split, serial;
# main() times models.linear's own table entry for the shape first (the "table:" row)
VARIANTS = [
    ("bn32 split4 st4", (16, 32, 128, 8, 4, 4, True, False, 4, False)),
    ("bn32 split4 st6", (16, 32, 128, 8, 4, 6, True, False, 4, False)),
    ("bn32 split3 st4 (120 progs)", (16, 32, 128, 8, 4, 4, True, False, 3, False)),
    ("bn32 split3 st8", (16, 32, 128, 8, 4, 8, True, False, 3, False)),
    ("bn16 split8 st4 (640)", (16, 16, 128, 8, 4, 4, True, False, 8, False)),
    ("bn16 split5 st4 (400)", (16, 16, 128, 8, 4, 4, True, False, 5, False)),
    ("bn64 split6 st4 (120)", (16, 64, 128, 8, 4, 4, True, False, 6, False)),
    ("bn64 split13 st3 (260)", (16, 64, 128, 8, 4, 3, True, False, 13, False)),
    ("bn32 split10 bk64 st4 (400)", (16, 32, 64, 8, 4, 4, True, False, 10, False)),
    ("bn32 split4 bk64 st8", (16, 32, 64, 8, 4, 8, True, False, 4, False)),
    ("bn32 split10 st3 (400)", (16, 32, 128, 8, 4, 3, True, False, 10, False)),
    ("bn16 split20 st2 (1600)", (16, 16, 128, 8, 4, 2, True, False, 20, False)),
]


@triton.jit
def _read_kernel(w_ptr, out_ptr, n_elem, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # program p sums w[p * CHUNK : (p + 1) * CHUNK] (flat): reads the bytes, writes one float
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = p.to(tl.int64) * CHUNK
    for i in range(0, CHUNK, BLOCK):
        idx = base + i + offs
        acc += tl.load(w_ptr + idx, mask=idx < n_elem, other=0.0).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc, 0))


# The table config's launch taken apart (session 40), each with PDL off like the read-only
# kernel: its TMA tile loads alone (summed, no dot), its main loop alone (context._slice_acc,
# the fp32 partial stored, no counter, no reduction), then the whole launch with PDL off.
@triton.jit
def _tile_read_kernel(w_desc, out_ptr, H, KS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr):
    # program (tile, slice) loads w[tile's BLOCK_N rows, slice's K range] box by box, sums it;
    # the loop's loads pipelined STAGES deep as the GEMM's (Triton pipelines a loop without a
    # dot only when asked: tl.range's num_stages)
    n0 = tl.program_id(0) * BLOCK_N
    k_lo = tl.program_id(1) * KS
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(k_lo, tl.minimum(k_lo + KS, H), BLOCK_K, num_stages=STAGES):
        acc += w_desc.load([n0, k0]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))


@triton.jit
def _loop_only_kernel(x_desc, w_desc, part_ptr, T, N, H, KS, NUM_M, NUM_N,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    # _proj_splitk_kernel's program without its PDL wait, counter and reduction
    pid_m, pid_n = _tile_ids(tl.program_id(0), NUM_M, NUM_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * KS
    acc = _slice_acc(x_desc, w_desc, rows, cols, pid_m * BLOCK_M, pid_n * BLOCK_N, k_lo,
                     tl.minimum(k_lo + KS, H), T, N, 0, 0, 0, 0, True, BLOCK_M, BLOCK_N,
                     BLOCK_K)
    pn = NUM_N * BLOCK_N
    off = tl.program_id(1).to(tl.int64) * NUM_M * BLOCK_M * pn + rows[:, None] * pn + cols[None, :]
    tl.store(part_ptr + off, acc, mask=(rows < T)[:, None] & (cols >= 0)[None, :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--nw", type=int, default=12)
    ap.add_argument("--write-table", metavar="PATH", default=None)
    a = ap.parse_args()
    if a.m < 1 or a.nw < 1:
        ap.error(f"--m and --nw must be >= 1, got --m {a.m} --nw {a.nw}")
    if not torch.cuda.is_available():
        print("proj_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dflash_ops.bench.harness import measure_floors, time_fn
    from dflash_ops.models import linear
    from dflash_ops.triton.context import ProjCfg, launch_proj

    def graph_us(fn):  # fn(w, out) over the weight copies, in one graph: (median, p20) us
        r = time_fn(fn, rotate=list(zip(ws, outs)), graph=True, calls=a.nw)
        return r["us"], r["p20"]

    fl = measure_floors()
    bw = fl["copy_GBps"]
    torch.manual_seed(0)
    ws = [torch.randn(N, H, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(a.nw)]
    x = torch.randn(a.m, H, dtype=torch.bfloat16, device="cuda")
    outs = [torch.empty(a.m, N, dtype=torch.bfloat16, device="cuda") for _ in range(a.nw)]
    ref = F.linear(x.float(), ws[0].float())
    wbytes = N * H * 2
    print(f"{torch.cuda.get_device_name()}  M {a.m}  N {N}  K {H}  weight {wbytes / 1e6:.1f} MB"
          f"  copies {a.nw}  copy {bw:.0f} GB/s")
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # a program's loads in flight: BLOCK elements an iteration (32 KB at 16384), so that even
    # one program an SM keeps ~4 MB in flight over the GPU
    for progs, block in ((sms, 16384), (2 * sms, 8192), (4 * sms, 4096)):
        chunk = triton.cdiv(triton.cdiv(N * H, progs), block) * block
        grid = triton.cdiv(N * H, chunk)
        red = torch.empty(grid, dtype=torch.float32, device="cuda")
        med, lo = graph_us(lambda w, o, c=chunk, b=block, g=grid, r=red: _read_kernel[(g,)](
            w, r, N * H, CHUNK=c, BLOCK=b, num_warps=8))
        rows.append((f"read only, {grid} programs x {chunk * 2 // 1024} KB", med, lo, "-"))
    med, lo = graph_us(lambda w, o: torch.mm(x, w.t(), out=o))
    err = (outs[0].float() - ref).abs().max().item()
    rows.append(("cuBLAS (x @ w^T)", med, lo, f"{err:.3g}"))
    entry = linear.choice(a.m, N, H, x.dtype, x.device, graph=True)  # what the step runs
    table = [(f"table: {entry}", entry)] if entry and entry != linear.CUDA_CFG else []
    for name, f in table + VARIANTS:
        cfg = ProjCfg(*f)
        try:
            launch_proj(x, ws[0], None, outs[0], cfg)
            torch.cuda.synchronize()
            err = (outs[0].float() - ref).abs().max().item()
            if not err < 0.05:
                rows.append((name, float("nan"), float("nan"), f"WRONG {err:.3g}"))
                continue
            med, lo = graph_us(lambda w, o, c=cfg: launch_proj(x, w, None, o, c))
            rows.append((name, med, lo, f"{err:.3g}"))
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects is a row too
            rows.append((name, float("nan"), float("nan"), f"failed: {type(e).__name__}: {e}"[:90]))
    tcfg = ProjCfg(*table[0][1]) if table else None
    if tcfg is not None and tcfg.split > 1 and tcfg.tma:
        rows += _decompose(tcfg, x, ws[0], outs[0], ref, graph_us)
    base = min(r[1] for r in rows[:3])
    print("| kernel | us a launch (median) | p20 | vs read-only | GB/s | max err |")
    print("|---|---|---|---|---|---|")
    for name, med, lo, err in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {med / base:.2f}x | {wbytes / med / 1e3:.0f} |"
              f" {err} |")
    print(f"floor (bytes / copy bandwidth {bw:.0f} GB/s): {wbytes / bw / 1e3:.2f} us")
    if a.write_table:
        _write_table(a.write_table, a.m, rows)
    return 0


def _decompose(cfg, x, w0, out0, ref, graph_us):
    """Rows for the table config's split-K launch taken apart, all with PDL off (as the
    read-only kernel): its tile loads alone, its main loop alone (its partials' sum on
    ``w0`` checked against ``ref``), the whole launch (checked too, into ``out0``)."""
    import os
    from unittest import mock

    from dflash_ops.triton.context import _operands, launch_proj

    m = x.shape[0]
    ks = triton.cdiv(triton.cdiv(H, cfg.split), cfg.bk) * cfg.bk
    num_m, num_n = triton.cdiv(m, cfg.bm), triton.cdiv(N, cfg.bn)
    grid = (num_m * num_n, cfg.split)
    red = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    part = torch.empty(cfg.split, num_m * cfg.bm, num_n * cfg.bn, dtype=torch.float32,
                       device=x.device)
    xd, _ = _operands(x, w0, cfg.bm, cfg.bn, cfg.bk, True)

    def wd(w):
        return _operands(x, w, cfg.bm, cfg.bn, cfg.bk, True)[1]

    kw = dict(num_warps=cfg.warps, num_stages=cfg.stages)
    out = []
    def tile_read(w, o):
        _tile_read_kernel[grid](wd(w), red, H, ks, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk,
                                STAGES=cfg.stages, **kw)

    tile_read(w0, None)
    want = w0.float().sum().item()  # every element read once
    err = abs(red.sum().item() - want)
    if not err < 1e-3 * max(1.0, abs(want)) + 1.0:
        raise RuntimeError(f"proj_probe: the tile-load kernel's sum is wrong (off by {err:.3g})")
    med, lo = graph_us(tile_read)
    out.append((f"table cfg: its TMA loads only ({cfg.bn} x {cfg.bk} boxes summed), PDL off",
                med, lo, "-"))

    def loop_only(w, o):
        _loop_only_kernel[grid](xd, wd(w), part, m, N, H, ks, num_m, num_n, BLOCK_M=cfg.bm,
                                BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.gm, **kw)

    loop_only(w0, None)
    err = (part[:, :m, :N].sum(0) - ref).abs().max().item()  # the slices' fp32 partials
    if not err < 0.05:
        raise RuntimeError(f"proj_probe: the main-loop-only kernel is wrong (max err {err:.3g})")
    med, lo = graph_us(loop_only)
    out.append(("table cfg: main loop only (partials stored; no counter, no reduction), "
                "PDL off", med, lo, f"{err:.3g}"))
    with mock.patch.dict(os.environ, {"DFLASH_OPS_PDL": "0"}):  # read at each launch (_pdl.py)
        launch_proj(x, w0, None, out0, cfg)
        err = (out0.float() - ref).abs().max().item()
        if not err < 0.05:
            raise RuntimeError(f"proj_probe: the PDL-off launch is wrong (max err {err:.3g})")
        med, lo = graph_us(lambda w, o: launch_proj(x, w, None, o, cfg))
    out.append(("table cfg: the whole launch, PDL off", med, lo, f"{err:.3g}"))
    return out


def _write_table(path, m, rows):
    from dflash_ops.models import linear

    names = dict(VARIANTS)  # only these may be written (the table row is the baseline)
    gemm = [(t, n) for n, t, _, e in rows if n in names and not math.isnan(t)]
    table = next((t for n, t, _, e in rows if n.startswith("table:")), float("nan"))
    best_t, best = min(gemm) if gemm else (float("nan"), None)
    if best is None or not best_t <= table - 0.5:
        print(f"--write-table: nothing written (best {best} {best_t:.2f} us vs the table's "
              f"{table:.2f})")
        return
    doc = json.loads(linear.TABLE_PATH.read_text())
    cfg = list(names[best])
    hit = [e for e in doc["entries"] if (e["n"], e["k"], e["m"]) == (N, H, m)]
    if not hit:
        print(f"--write-table: the table has no ({N}, {H}, {m}) entry; nothing written")
        return
    for e in hit:
        e["cfg"] = cfg
        e["measured"] = f"proj_probe: {best} {best_t:.2f} us vs the table's {table:.2f} (graph)"
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"--write-table: {path}: ({N}, {H}, {m}) -> {best} {cfg}")


if __name__ == "__main__":
    sys.exit(main())
