"""Norm suite: ``rms_norm`` and ``fused_add_rms_norm_``, our backends against the baselines.

Columns, one run: our ``cuda`` and ``triton`` backends (forced with ``use_backend``), the PyTorch
reference eager, that reference under ``torch.compile`` (default mode, static shapes), Liger-Kernel,
and the floor. Bytes: rms_norm reads x and writes y (2 x.nbytes + the weight); fused_add_rms_norm_
reads x and residual and writes both (4 x.nbytes + the weight). Every column is checked against the
reference on the benchmark's own inputs before it is timed.

The ``host`` tables: the host time of one eager call (T = 16) of rms_norm, fused_add_rms_norm_
and silu_mul (the other elementwise op on hidden rows, with no suite of its own) with each op's
default backend, next to each backend forced; then the baselines' (torch reference eager and
compiled, Liger, one aten kernel for calibration). ``--tables host`` runs only those (seconds;
no floors are measured then).

Options (``dflash-ops bench norm ...`` or ``benchmarks/bench_norm.py``): ``--tables`` (names of
``TABLES``); a restricted run writes ``norm-<tables>.md/.json/.png``, never overwriting a full
run's files.
"""
from __future__ import annotations

import torch

from .columns import Impl, backend_host_table, compile_static, forced, host_table, msg, table
from .harness import Results, measure_floors, name_list, rotating

EPS = 1e-6
KNORM_T = (1, 4, 16, 64, 256, 1024, 4096, 16384)  # x[T, 40, 128]: 5 layers x 8 KV heads
HIDDEN_T = (1, 16, 256, 4096)  # x[T, 4096]
QUICK_KNORM_T, QUICK_HIDDEN_T = (1, 64, 4096, 16384), (1, 4096)
TABLES = ("rms_norm_knorm", "rms_norm_hidden", "fused_add_rms_norm_", "host")
HOST_T = 16
# CUDA-graph replay at every size: on the H200 machine one plain eager launch costs ~14 us of host
# time, more than the kernel at most sizes, and do_bench's per-call events then time the host (Liger
# fused add [4096, 4096]: 91 us with events, 35 us with graph replay). Events only if capture fails.
GRAPH = True


def _liger():
    """(rms_norm apply, fused_add apply, why missing)."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as FA
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as RN
        return RN.apply, FA.apply, None
    except Exception as e:  # noqa: BLE001 - not installed, or an import-time failure
        return None, None, f"liger-kernel unavailable ({msg(e)})"


def _rms_impls(w) -> list:
    from dflash_ops.ops.norm import rms_norm_ref

    ref = lambda x: rms_norm_ref(x, w, EPS)  # noqa: E731
    op = lambda x: torch.ops.dflash.rms_norm.default(x, w, EPS)  # noqa: E731
    compiled = compile_static(rms_norm_ref)
    liger, _, why = _liger()
    w1 = w if w.dim() == 1 else w[0].contiguous()  # Liger has no per-group weight: same bytes
    return [forced("rms_norm", "cuda", op, ref), forced("rms_norm", "triton", op, ref),
            Impl("torch eager", ref, ref),
            Impl("torch.compile", lambda x: compiled(x, w, EPS), ref),
            Impl("liger", lambda x: liger(x.view(-1, x.shape[-1]), w1, EPS, 0.0, "llama", False),
                 lambda x: rms_norm_ref(x, w1, EPS), missing=why),
            # The practical floor at this size: a copy kernel moving the same bytes (not checked).
            Impl("copy (same bytes)", lambda x: torch.empty_like(x).copy_(x), None)]


def _fused_add_impls(w) -> list:
    from dflash_ops import dispatch

    ref_ = dispatch.ops()["fused_add_rms_norm_"].impls["torch"]
    compiled = compile_static(ref_)

    def ref(x, r):
        ref_(x, r, w, EPS)
        return x, r

    def op(x, r):
        torch.ops.dflash.fused_add_rms_norm_.default(x, r, w, EPS)
        return x, r

    def comp(x, r):
        compiled(x, r, w, EPS)
        return x, r

    _, liger, why = _liger()  # out of place: returns (y, x + r), the same bytes
    return [forced("fused_add_rms_norm_", "cuda", op, ref),
            forced("fused_add_rms_norm_", "triton", op, ref),
            Impl("torch eager", ref, ref), Impl("torch.compile", comp, ref),
            Impl("liger", lambda x, r: liger(x, r, w, EPS, 0.0, "llama", False), ref, missing=why)]


def _table(res: Results, title: str, impls, cases, timing: dict) -> None:
    """cases: (T, make_set, input bytes per set, bytes moved per call)."""
    table(res, title, impls,
          [(t, lambda make=make, n=in_bytes: rotating(make, n), moved)
           for t, make, in_bytes, moved in cases],
          timing, progress=f"[norm] {title.split(' x')[0]}", graph=GRAPH)


def _host_tables(res: Results) -> None:
    from dflash_ops.ops.norm import rms_norm_ref

    t = HOST_T
    x = torch.randn(t, 40, 128, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(5, 128, dtype=torch.bfloat16, device="cuda")
    h, r = (torch.randn(t, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    wh = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    act = torch.randn(t, 2 * 12288, dtype=torch.bfloat16, device="cuda")  # Qwen3-8B gate + up
    calls = {"rms_norm": lambda: torch.ops.dflash.rms_norm.default(x, w, EPS),
             "fused_add_rms_norm_":
                 lambda: torch.ops.dflash.fused_add_rms_norm_.default(h, r, wh, EPS),
             "silu_mul": lambda: torch.ops.dflash.silu_mul.default(act)}
    backend_host_table(res, f"host overhead per eager call (us), default backend vs forced: "
                            f"rms_norm x[{t},40,128] w[5,128]; fused_add_rms_norm_ "
                            f"x,residual[{t},4096] w[4096]; silu_mul x[{t},24576]; bf16", calls)
    compiled, (liger, _, why) = compile_static(rms_norm_ref), _liger()
    host_table(res, f"host overhead per eager call, baselines: x[{t},40,128] bf16, w[5,128]", [
        Impl("(calibration) x.mul(2): one aten kernel", lambda: x.mul(2), None),
        Impl("rms_norm_ref eager", lambda: rms_norm_ref(x, w, EPS), None),
        Impl("torch.compile(rms_norm_ref)", lambda: compiled(x, w, EPS), None),
        Impl("liger", lambda: liger(x.view(-1, 128), w[0], EPS, 0.0, "llama", False), None,
             missing=why)])


def add_options(p) -> None:
    p.add_argument("--tables", type=name_list(TABLES, "tables"), default=None,
                   metavar="T1,T2", help=f"tables to run (default all of {', '.join(TABLES)})")


def run(quick: bool = False, tables=None) -> Results:
    """Measure floors, then the tables (``tables``: names of TABLES, default all); returns the
    Results (the caller prints and writes)."""
    import dflash_ops  # noqa: F401 - defines the ops, loads the CUDA extension

    tables = tables or list(TABLES)
    floors = measure_floors() if set(tables) - {"host"} else {}  # the host tables need none
    suffix = "" if len(tables) == len(TABLES) else "-" + "-".join(tables)
    res = Results("norm" + suffix, floors=floors)
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    bf16, dev = torch.bfloat16, "cuda"
    rnd = lambda *s: torch.randn(*s, dtype=bf16, device=dev)  # noqa: E731 - never zeros
    with torch.no_grad():
        w = 1 + 0.5 * rnd(5, 128)
        if "rms_norm_knorm" in tables:
            _table(res, "rms_norm K-norm x[T,40,128] bf16, w[5,128]", _rms_impls(w),
                   [(t, lambda t=t: (rnd(t, 40, 128),), t * 40 * 128 * 2,
                     2 * t * 40 * 128 * 2 + w.nbytes)
                    for t in (QUICK_KNORM_T if quick else KNORM_T)], timing)
        w = 1 + 0.5 * rnd(4096)
        hidden = [(t, t * 4096 * 2) for t in (QUICK_HIDDEN_T if quick else HIDDEN_T)]
        if "rms_norm_hidden" in tables:
            _table(res, "rms_norm hidden x[T,4096] bf16, w[4096]", _rms_impls(w),
                   [(t, lambda t=t: (rnd(t, 4096),), n, 2 * n + w.nbytes) for t, n in hidden],
                   timing)
        if "fused_add_rms_norm_" in tables:
            _table(res, "fused_add_rms_norm_ x,residual[T,4096] bf16, w[4096]",
                   _fused_add_impls(w),
                   [(t, lambda t=t: (rnd(t, 4096), rnd(t, 4096)), 2 * n, 4 * n + w.nbytes)
                    for t, n in hidden], timing)
        if "host" in tables:
            _host_tables(res)
    res.notes += [
        "timing: median per call of CUDA-graph replays (>= 32 calls a graph) at every size, since "
        "per-call events would include host launch time; do_bench events only where capture "
        "fails (said in the note); inputs rotate over sets totalling >= 2x L2 (<= 1024 sets)",
        "floor = bytes read + written / copy bandwidth of this run; x floor = us / floor",
        "err = max abs error against the torch reference on the timed inputs (bf16)",
        "liger: LigerRMSNormFunction on x.view(-1, D) with w[0] (no per-group weight; same "
        "bytes) plus one fp32 rstd per row (+1.6% bytes at D = 128); casting_mode='llama' "
        "(HF Llama/Qwen rounding); fused add: LigerFusedAddRMSNormFunction, out of place",
        "torch.compile: default mode, dynamic=False (one static compile per shape)",
        "host us: CPU time to issue one eager call while the GPU is kept busy (see "
        "dflash_ops.bench.harness.host_overhead_us); 'default': the backend a call gets with "
        "nothing forced, the other columns that backend forced with use_backend",
    ]
    return res
