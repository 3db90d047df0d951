"""DFlash 2's kernel projection (x[8, 5120] @ w[1280, 5120]^T, bf16) launched back to back
inside one CUDA graph, each launch on its own copy of the weight (NW copies, more bytes than
L2 holds, so every launch streams its weight from HBM as in the draft step), for issue 16:
how far is the split-K GEMM from a kernel that only reads the same 13.1 MB?

Rows: a read-only Triton kernel over the weight (programs x chunk, a sum a program: the
bytes a GEMM must read, nothing else), cuBLAS (F.linear), the model's table config and
split-K / stage variants of ``launch_proj``, and a stream-K kernel defined here (session 39's
experiment: every program streams the same bytes, where split-K's 160 programs put a second
one on 28 of the 132 SMs). Each GEMM row is checked against F.linear in
fp32 before it is timed. us a launch = graph replay time / NW (median of REPS replays).

    python benchmarks/proj_probe.py [--m 8] [--nw 12] [--reps 50] [--write-table PATH]

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

N, H = 1280, 5120

# (name, ProjCfg fields): bm, bn, bk, gm, warps, stages, tma, persistent, split, serial
VARIANTS = [
    ("table: bn32 split4 st4", (16, 32, 128, 8, 4, 4, True, False, 4, False)),
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


@triton.jit
def _streamk_kernel(x_desc, w_desc, out_ptr, part_ptr, cnt_ptr, T, N, U, P, KSTEPS, J, o_st,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # stream-K (an experiment of session 39): the U = NUM_N * KSTEPS units (an N tile x one
    # BLOCK_K step) split evenly over P programs, program p taking [p U / P, (p + 1) U / P):
    # every program streams the same bytes +-1 unit whatever N and the SM count. A program's
    # range crosses tiles: it stores one fp32 partial per tile it touches (part[p, j], j the
    # tile's index among its tiles); a tile's last program to finish (a counter a tile, the
    # split-K kernel's acq_rel order) sums the partials of its programs in program order,
    # rounds once and resets the counter. The owner of unit u is (((u + 1) P - 1) // U).
    p = tl.program_id(0)
    u0 = (p * U) // P
    u1 = ((p + 1) * U) // P
    t_first = u0 // KSTEPS
    rows = tl.arange(0, BM)
    pmask = (rows < T)[:, None]
    u = u0
    while u < u1:
        tile = u // KSTEPS
        kb = u - tile * KSTEPS
        ke = tl.minimum(KSTEPS, kb + (u1 - u))
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(kb, ke):
            a = x_desc.load([0, ks * BK])
            b = w_desc.load([tile * BN, ks * BK])
            acc = tl.dot(a, tl.trans(b), acc)
        cols = tile * BN + tl.arange(0, BN)
        poff = rows[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(part_ptr + (p * J + tile - t_first).to(tl.int64) * (BM * BN) + poff, acc,
                 mask=pmask)
        tl.debug_barrier()
        pf = ((tile * KSTEPS + 1) * P - 1) // U
        pl = (((tile + 1) * KSTEPS) * P - 1) // U
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == pl - pf:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for q in range(pf, pl + 1):
                jq = tile - ((q * U) // P) // KSTEPS
                total += tl.load(part_ptr + (q * J + jq).to(tl.int64) * (BM * BN) + poff,
                                 mask=pmask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows[:, None] * o_st + cols[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=pmask & (cols < N)[None, :])
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        u = tile * KSTEPS + ke


class StreamK:
    """x[T, K] @ w[N, K]^T with _streamk_kernel over ``programs`` programs (T <= bm; K a
    multiple of bk); buffers made once, so a graph may capture it."""

    def __init__(self, t, n, k, programs, bm=16, bn=16, bk=128, stages=4, warps=4,
                 device="cuda"):
        from triton.tools.tensor_descriptor import TensorDescriptor

        assert t <= bm and k % bk == 0, (t, k)
        self.desc = TensorDescriptor
        self.t, self.n, self.bm, self.bn, self.bk = t, n, bm, bn, bk
        self.ksteps = k // bk
        self.u = triton.cdiv(n, bn) * self.ksteps
        self.p = min(programs, self.u)
        self.j = triton.cdiv(triton.cdiv(self.u, self.p), self.ksteps) + 1
        self.part = torch.empty(self.p * self.j * bm * bn, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=device)
        self.stages, self.warps = stages, warps

    def __call__(self, x, w, out):
        xd = self.desc(x, list(x.shape), list(x.stride()), [self.bm, self.bk])
        wd = self.desc(w, list(w.shape), list(w.stride()), [self.bn, self.bk])
        _streamk_kernel[(self.p,)](xd, wd, out, self.part, self.cnt, self.t, self.n, self.u,
                                   self.p, self.ksteps, self.j, out.stride(0), BM=self.bm,
                                   BN=self.bn, BK=self.bk, num_warps=self.warps,
                                   num_stages=self.stages)


def _graph_us(fn, nw, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(nw):  # warm-up: compiles, autotunes, allocates
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(nw):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / nw)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--nw", type=int, default=12)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--write-table", metavar="PATH", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("proj_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dflash_ops.bench.harness import measure_floors
    from dflash_ops.triton.context import ProjCfg, launch_proj

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
        med, lo = _graph_us(lambda i, c=chunk, b=block, g=grid, r=red: _read_kernel[(g,)](
            ws[i], r, N * H, CHUNK=c, BLOCK=b, num_warps=8), a.nw, a.reps)
        rows.append((f"read only, {grid} programs x {chunk * 2 // 1024} KB", med, lo, "-"))
    med, lo = _graph_us(lambda i: torch.mm(x, ws[i].t(), out=outs[i]), a.nw, a.reps)
    err = (outs[0].float() - ref).abs().max().item()
    rows.append(("cuBLAS (x @ w^T)", med, lo, f"{err:.3g}"))
    for name, f in VARIANTS:
        cfg = ProjCfg(*f)
        try:
            launch_proj(x, ws[0], None, outs[0], cfg)
            torch.cuda.synchronize()
            err = (outs[0].float() - ref).abs().max().item()
            if not err < 0.05:
                rows.append((name, float("nan"), float("nan"), f"WRONG {err:.3g}"))
                continue
            med, lo = _graph_us(lambda i, c=cfg: launch_proj(x, ws[i], None, outs[i], c), a.nw,
                                a.reps)
            rows.append((name, med, lo, f"{err:.3g}"))
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects is a row too
            rows.append((name, float("nan"), float("nan"), f"failed: {type(e).__name__}: {e}"[:90]))
    # stream-K (this file's experiment): P programs, every one the same bytes +-1 unit
    for progs, bn in ((sms, 16), (2 * sms, 16), (sms, 32), (2 * sms, 32)):
        name = f"stream-K {progs} programs, bn {bn}, bk 128, st 4"
        try:
            sk = StreamK(a.m, N, H, progs, bn=bn)
            outs[0].zero_()
            sk(x, ws[0], outs[0])
            torch.cuda.synchronize()
            err = (outs[0].float() - ref).abs().max().item()
            if not err < 0.05:
                rows.append((name, float("nan"), float("nan"), f"WRONG {err:.3g}"))
                continue
            med, lo = _graph_us(lambda i, f=sk: f(x, ws[i], outs[i]), a.nw, a.reps)
            rows.append((name, med, lo, f"{err:.3g}"))
        except Exception as e:  # noqa: BLE001
            rows.append((name, float("nan"), float("nan"), f"failed: {type(e).__name__}: {e}"[:90]))
    base = min(r[1] for r in rows[:3])
    print("| kernel | us a launch (median) | min | vs read-only | GB/s | max err |")
    print("|---|---|---|---|---|---|")
    for name, med, lo, err in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {med / base:.2f}x | {wbytes / med / 1e3:.0f} |"
              f" {err} |")
    print(f"floor (bytes / copy bandwidth {bw:.0f} GB/s): {wbytes / bw / 1e3:.2f} us")
    if a.write_table:
        _write_table(a.write_table, a.m, rows)
    return 0


def _write_table(path, m, rows):
    from dflash_ops.models import linear

    names = dict(VARIANTS)
    gemm = [(t, n) for n, t, _, e in rows if n in names and not math.isnan(t)]
    table = next((t for n, t, _, e in rows if n.startswith("table:")), float("nan"))
    best_t, best = min(gemm) if gemm else (float("nan"), None)
    if best is None or not best_t <= table - 0.5:
        print(f"--write-table: nothing written (best {best} {best_t:.2f} us vs the table's "
              f"{table:.2f})")
        return
    doc = json.loads(linear.TABLE_PATH.read_text())
    cfg = list(dict(VARIANTS)[best])
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
