"""Columns of a suite's tables: an implementation checked against its reference, then timed.

Shared by the suites (``bench.norm``, ``bench.context_kv``): ``Impl`` is one column, ``forced``
one of our backends forced with ``use_backend``; ``measure`` checks a column on the benchmark's
own inputs (2 bf16 ulps, or bit-exact) and times it (CUDA-graph replay, event timing where
capture fails or the column opts out); ``table`` adds one timing table (one row per column and
case, then the floor row); ``host_table`` one host-overhead table of columns,
``backend_host_table`` one of ops: each op's default backend next to every backend forced.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from .harness import Results, floor_us, host_overhead_us, time_fn

BF16_ULP = 2.0 ** -7  # bf16 spacing at 1.0; a column is wrong past 2 ulps of the output's max
_compiled: dict = {}


def msg(e: BaseException) -> str:
    """``Type: first line of the message`` (160 characters at most), for a note."""
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}"


def _tuple(v):
    return v if isinstance(v, tuple) else (v,)


def max_err(got, want):
    """(max abs error over outputs, tolerance): 2 bf16 ulps of the largest reference value."""
    err, scale = 0.0, 1.0
    for g, w in zip(_tuple(got), _tuple(want)):
        d = (g.reshape(w.shape).float() - w.float()).abs().max().item()
        err = d if d != d else max(err, d)  # keep a NaN
        scale = max(scale, w.float().abs().max().item())
    return err, 2 * BF16_ULP * scale


def exact_err(got, want):
    """(elements that differ bit for bit, tolerance 0); outputs are sequences of 16-bit tensors."""
    bad = 0
    for g, w in zip(got, want):
        bad += int((g.view(torch.int16) != w.view(torch.int16)).sum())
    return float(bad), 0.0


def compile_static(fn):
    """``torch.compile(fn, dynamic=False)``, once per function (one static compile per shape)."""
    if fn not in _compiled:
        cfg = torch._dynamo.config
        for k in ("recompile_limit", "cache_size_limit"):  # one static compile per shape
            with contextlib.suppress(AttributeError):
                setattr(cfg, k, max(getattr(cfg, k), 64))
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


class Impl:
    """A column: ``fn(*set)`` timed, ``ref(*set)`` its oracle (None: not checked), ``ctx()``
    around both; ``missing``: why it is n/a; ``graph=False``: event timing only (a column that
    synchronises and cannot be captured), None: the table's default."""

    def __init__(self, name, fn, ref, ctx=contextlib.nullcontext, missing=None,
                 graph: Optional[bool] = None):
        self.name, self.fn, self.ref, self.ctx, self.missing = name, fn, ref, ctx, missing
        self.graph = graph


def forced(op: str, backend: str, fn, ref, name: Optional[str] = None) -> Impl:
    """Column ``name`` (default: the backend) running ``fn`` under ``use_backend(backend)``;
    n/a when the op has no kernel for that backend."""
    import dflash_ops
    from dflash_ops import dispatch

    missing = None if dispatch.has_backend(op, backend) else \
        f"no {backend} kernel for {op} (available: {dispatch.available_backends(op)})"
    return Impl(name or backend, fn, ref, lambda: dflash_ops.use_backend(backend, ops=[op]),
                missing)


def measure(impl: Impl, sets, pristine, timing: dict, *, graph: bool = True,
            exact: bool = False):
    """(time_fn dict or None, note, err): checked on clones of ``pristine`` against the
    reference (``exact``: bit for bit), then timed over ``sets`` (which in-place ops keep
    mutating). ``graph``: the default timing mode, unless the column says otherwise."""
    if impl.missing:
        return None, impl.missing, None
    fresh = lambda: tuple(t.clone() for t in pristine)  # noqa: E731
    opted_out = impl.graph is False
    graph = graph if impl.graph is None else impl.graph
    note = "event timing (not capturable)" if opted_out else ""
    with impl.ctx():
        try:
            if impl.ref is None:
                err, tol = 0.0, 1.0
            else:
                got, want = impl.fn(*fresh()), impl.ref(*fresh())
                err, tol = exact_err(got, want) if exact else max_err(got, want)
        except Exception as e:  # noqa: BLE001 - a broken column is reported, not fatal
            return None, f"failed: {msg(e)}", None
        if not err <= tol:
            what = "elements differ" if exact else "max abs err"
            return None, f"WRONG: {what} {err:.3g} > tol {tol:.3g}; not timed", err
        try:
            return time_fn(impl.fn, rotate=sets, graph=graph, **timing), note, err
        except Exception as e:  # noqa: BLE001
            if not graph:
                return None, f"failed: {msg(e)}", err
            note = f"graph capture failed ({msg(e)}); event timing"
        try:
            return time_fn(impl.fn, rotate=sets, graph=False, **timing), note, err
        except Exception as e:  # noqa: BLE001
            return None, f"failed: {msg(e)}", err


def table(res: Results, title: str, impls, cases, timing: dict, *, progress: str,
          graph: bool = True, exact: bool = False) -> None:
    """One timing table. cases: (T, build_sets() -> the rotating input sets, bytes moved per
    call); per case one row per column, then the floor row. ``progress``: what the progress
    line on stderr starts with (``[suite] short title``)."""
    for t, build_sets, moved in cases:
        sets = build_sets()
        pristine = tuple(x.clone() for x in sets[0])
        floor = floor_us(res.floors, moved)
        for impl in impls:
            tm, note, err = measure(impl, sets, pristine, timing, graph=graph, exact=exact)
            res.add_time(title, f"T={t}", impl.name, tm, bytes_moved=moved, floor=floor,
                         err=err, note=note, x=t)
            us = f"{tm['us']:.2f} us ({tm['mode']})" if tm else "n/a"
            print(f"{progress} T={t} {impl.name}: {us} {note}", file=sys.stderr, flush=True)
        res.add_time(title, f"T={t}", "floor", {"us": floor, "mode": "bytes/copy"},
                     bytes_moved=moved, floor=floor, x=t)
        del sets, pristine
        torch.cuda.empty_cache()


def _host_us(fn, ctx=contextlib.nullcontext):
    """(``host_overhead_us(fn)`` under ``ctx()``, None) or (None, why it failed)."""
    with ctx():
        try:
            return host_overhead_us(fn), None
        except Exception as e:  # noqa: BLE001 - a broken row is reported, not fatal
            return None, f"failed: {msg(e)}"


def host_table(res: Results, title: str, rows) -> None:
    """One row per column: ``host_overhead_us(fn)`` (``fn()`` takes no arguments) under its
    ``ctx()``, or n/a with the reason."""
    for r in rows:
        us, note = (None, r.missing) if r.missing else _host_us(r.fn, r.ctx)
        res.add(title, impl=r.name, **{"host us": us}, note=note or "")


def backend_host_table(res: Results, title: str, calls: dict, syncs=()) -> None:
    """One row per op of ``calls`` (op -> ``fn()``, no arguments, on a tiny input): the host
    time of an eager call with the op's default backend (nothing forced: what a caller of the
    op gets), then with each backend forced (``use_backend``; n/a where the op has none).
    ``syncs``: ops whose torch backend synchronises, not measured (the host would wait for the
    GPU)."""
    import dflash_ops
    from dflash_ops import dispatch

    for op, fn in calls.items():
        default = dispatch.resolve(op)
        row, notes = {"op": op, "default": default}, []
        runs = [("default", default, contextlib.nullcontext)]
        runs += [(b, b, lambda b=b: dflash_ops.use_backend(b, ops=[op]))
                 for b in ("cuda", "triton", "torch")]
        for col, backend, ctx in runs:
            us = None
            if backend == "torch" and op in syncs:
                notes += ["torch: not measured (synchronises)"] if col == "torch" else []
            elif dispatch.has_backend(op, backend):
                us, why = _host_us(fn, ctx)
                notes += [f"{col}: {why}"] if why else []
            row[f"{col} us"] = us
        res.add(title, **row, note="; ".join(notes))
