"""Norm suite: ``rms_norm`` and ``fused_add_rms_norm_``, our backends against the baselines.

Columns, one run: our ``cuda`` and ``triton`` backends (forced with ``use_backend``), the PyTorch
reference eager, that reference under ``torch.compile`` (default mode, static shapes), Liger-Kernel,
and the floor. Bytes: rms_norm reads x and writes y (2 x.nbytes + the weight); fused_add_rms_norm_
reads x and residual and writes both (4 x.nbytes + the weight). Every column is checked against the
reference on the benchmark's own inputs before it is timed.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from .harness import Results, floor_us, host_overhead_us, measure_floors, rotating, time_fn

EPS = 1e-6
KNORM_T = (1, 4, 16, 64, 256, 1024, 4096, 16384)  # x[T, 40, 128]: 5 layers x 8 KV heads
HIDDEN_T = (1, 16, 256, 4096)  # x[T, 4096]
QUICK_KNORM_T, QUICK_HIDDEN_T = (1, 64, 4096, 16384), (1, 4096)
# CUDA-graph replay at every size: on the H200 machine one plain eager launch costs ~14 us of host
# time, more than the kernel at most sizes, and do_bench's per-call events then time the host (Liger
# fused add [4096, 4096]: 91 us with events, 35 us with graph replay). Events only if capture fails.
GRAPH = True
BF16_ULP = 2.0 ** -7  # bf16 spacing at 1.0; a column is wrong past 2 ulps of the output's max
_compiled: dict = {}


def _msg(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}"


def _tuple(v):
    return v if isinstance(v, tuple) else (v,)


def _max_err(got, want):
    """(max abs error over outputs, tolerance): 2 bf16 ulps of the largest reference value."""
    err, scale = 0.0, 1.0
    for g, w in zip(_tuple(got), _tuple(want)):
        d = (g.reshape(w.shape).float() - w.float()).abs().max().item()
        err = d if d != d else max(err, d)  # keep a NaN
        scale = max(scale, w.float().abs().max().item())
    return err, 2 * BF16_ULP * scale


def _compile(fn):
    if fn not in _compiled:
        cfg = torch._dynamo.config
        for k in ("recompile_limit", "cache_size_limit"):  # one static compile per shape
            with contextlib.suppress(AttributeError):
                setattr(cfg, k, max(getattr(cfg, k), 64))
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


def _liger():
    """(rms_norm apply, fused_add apply, why missing)."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as FA
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as RN
        return RN.apply, FA.apply, None
    except Exception as e:  # noqa: BLE001 - not installed, or an import-time failure
        return None, None, f"liger-kernel unavailable ({_msg(e)})"


class Impl:
    """A column: ``fn(*set)`` timed, ``ref(*set)`` its oracle, ``ctx()`` around both."""

    def __init__(self, name, fn, ref, ctx=contextlib.nullcontext, missing=None):
        self.name, self.fn, self.ref, self.ctx, self.missing = name, fn, ref, ctx, missing


def _forced(op: str, backend: str, fn, ref) -> Impl:
    import dflash_ops
    from dflash_ops import dispatch

    missing = None if dispatch.has_backend(op, backend) else \
        f"no {backend} kernel for {op} (available: {dispatch.available_backends(op)})"
    return Impl(backend, fn, ref, lambda: dflash_ops.use_backend(backend, ops=[op]), missing)


def _rms_impls(w) -> list:
    from dflash_ops.ops.norm import rms_norm_ref

    ref = lambda x: rms_norm_ref(x, w, EPS)  # noqa: E731
    op = lambda x: torch.ops.dflash.rms_norm.default(x, w, EPS)  # noqa: E731
    compiled = _compile(rms_norm_ref)
    liger, _, why = _liger()
    w1 = w if w.dim() == 1 else w[0].contiguous()  # Liger has no per-group weight: same bytes
    return [_forced("rms_norm", "cuda", op, ref), _forced("rms_norm", "triton", op, ref),
            Impl("torch eager", ref, ref),
            Impl("torch.compile", lambda x: compiled(x, w, EPS), ref),
            Impl("liger", lambda x: liger(x.view(-1, x.shape[-1]), w1, EPS, 0.0, "llama", False),
                 lambda x: rms_norm_ref(x, w1, EPS), missing=why),
            # The practical floor at this size: a copy kernel moving the same bytes (not checked).
            Impl("copy (same bytes)", lambda x: torch.empty_like(x).copy_(x), None)]


def _fused_add_impls(w) -> list:
    from dflash_ops import dispatch

    ref_ = dispatch.ops()["fused_add_rms_norm_"].impls["torch"]
    compiled = _compile(ref_)

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
    return [_forced("fused_add_rms_norm_", "cuda", op, ref),
            _forced("fused_add_rms_norm_", "triton", op, ref),
            Impl("torch eager", ref, ref), Impl("torch.compile", comp, ref),
            Impl("liger", lambda x, r: liger(x, r, w, EPS, 0.0, "llama", False), ref, missing=why)]


def _measure(impl: Impl, sets, pristine, graph: bool, timing: dict):
    """(time_fn dict or None, note, max err): check on ``pristine`` against the reference, then
    time over ``sets`` (which in-place ops mutate)."""
    if impl.missing:
        return None, impl.missing, None
    fresh = lambda: tuple(t.clone() for t in pristine)  # noqa: E731
    with impl.ctx():
        try:
            err, tol = _max_err(impl.fn(*fresh()), impl.ref(*fresh())) if impl.ref else (0.0, 1.0)
        except Exception as e:  # noqa: BLE001 - a broken column is reported, not fatal
            return None, f"failed: {_msg(e)}", None
        if not err <= tol:
            return None, f"WRONG: max abs err {err:.3g} > tol {tol:.3g}; not timed", err
        try:
            return time_fn(impl.fn, rotate=sets, graph=graph, **timing), "", err
        except Exception as e:  # noqa: BLE001
            if not graph:
                return None, f"failed: {_msg(e)}", err
            note = f"graph capture failed ({_msg(e)}); event timing"
        try:
            return time_fn(impl.fn, rotate=sets, graph=False, **timing), note, err
        except Exception as e:  # noqa: BLE001
            return None, f"failed: {_msg(e)}", err


def _table(res: Results, title: str, impls, cases, timing: dict) -> None:
    """cases: (T, make_set, input bytes per set, bytes moved per call)."""
    for t, make, in_bytes, moved in cases:
        sets = rotating(make, in_bytes)
        pristine = tuple(t.clone() for t in sets[0])
        floor = floor_us(res.floors, moved)
        for impl in impls:
            tm, note, err = _measure(impl, sets, pristine, GRAPH, timing)
            res.add_time(title, f"T={t}", impl.name, tm, bytes_moved=moved, floor=floor,
                         err=err, note=note, x=t)
            us = f"{tm['us']:.2f} us ({tm['mode']})" if tm else "n/a"
            print(f"[norm] {title.split(' x')[0]} T={t} {impl.name}: {us} {note}",
                  file=sys.stderr, flush=True)
        res.add_time(title, f"T={t}", "floor", {"us": floor, "mode": "bytes/copy"},
                     bytes_moved=moved, floor=floor, x=t)
        del sets, pristine
        torch.cuda.empty_cache()


def _host_table(res: Results) -> None:
    import dflash_ops
    from dflash_ops.ops.norm import rms_norm_ref

    title = "host overhead per eager call, x[16,40,128] bf16, w[5,128]"
    x = torch.randn(16, 40, 128, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(5, 128, dtype=torch.bfloat16, device="cuda")
    op = lambda: torch.ops.dflash.rms_norm.default(x, w, EPS)  # noqa: E731
    rows = [Impl(f"dflash.rms_norm default ({dflash_ops.backend_for('rms_norm')})", op, None)]
    rows += [_forced("rms_norm", b, op, None) for b in ("cuda", "triton", "torch")]
    for r in rows[1:]:
        r.name = f"dflash.rms_norm {r.name}"
    compiled, (liger, _, why) = _compile(rms_norm_ref), _liger()
    rows += [Impl("(calibration) x.mul(2): one aten kernel", lambda: x.mul(2), None),
             Impl("rms_norm_ref eager", lambda: rms_norm_ref(x, w, EPS), None),
             Impl("torch.compile(rms_norm_ref)", lambda: compiled(x, w, EPS), None),
             Impl("liger", lambda: liger(x.view(-1, 128), w[0], EPS, 0.0, "llama", False), None,
                  missing=why)]
    for r in rows:
        us, note = None, r.missing or ""
        if not r.missing:
            with r.ctx():
                try:
                    us = host_overhead_us(r.fn)
                except Exception as e:  # noqa: BLE001
                    note = f"failed: {_msg(e)}"
        res.add(title, impl=r.name, **{"host us": us}, note=note)


def run(quick: bool = False) -> Results:
    """Measure floors, then every table; returns the Results (the caller prints and writes)."""
    import dflash_ops  # noqa: F401 - defines the ops, loads the CUDA extension

    floors = measure_floors()
    res = Results("norm", floors=floors)
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    bf16, dev = torch.bfloat16, "cuda"
    rnd = lambda *s: torch.randn(*s, dtype=bf16, device=dev)  # noqa: E731 - never zeros
    with torch.no_grad():
        w = 1 + 0.5 * rnd(5, 128)
        _table(res, "rms_norm K-norm x[T,40,128] bf16, w[5,128]", _rms_impls(w),
               [(t, lambda t=t: (rnd(t, 40, 128),), t * 40 * 128 * 2,
                 2 * t * 40 * 128 * 2 + w.nbytes) for t in (QUICK_KNORM_T if quick else KNORM_T)],
               timing)
        w = 1 + 0.5 * rnd(4096)
        hidden = [(t, t * 4096 * 2) for t in (QUICK_HIDDEN_T if quick else HIDDEN_T)]
        _table(res, "rms_norm hidden x[T,4096] bf16, w[4096]", _rms_impls(w),
               [(t, lambda t=t: (rnd(t, 4096),), n, 2 * n + w.nbytes) for t, n in hidden], timing)
        _table(res, "fused_add_rms_norm_ x,residual[T,4096] bf16, w[4096]", _fused_add_impls(w),
               [(t, lambda t=t: (rnd(t, 4096), rnd(t, 4096)), 2 * n, 4 * n + w.nbytes)
                for t, n in hidden], timing)
        _host_table(res)
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
        "dflash_ops.bench.harness.host_overhead_us)",
    ]
    return res
