"""Timing harness for ``dflash-ops bench`` and benchmarks/bench_*.py.

Every number is a median of device-side timings (CUDA events), never host clocks around async
work. Two modes:

* events: ``triton.testing.do_bench``, one event pair around each call (it also wipes L2 with a
  256 MB memset before each call);
* graph: N calls captured in one CUDA graph, replayed; per-call time = replay time / N. Use it for
  launch-bound sizes, where event timing measures the launch gap more than the kernel.

Inputs rotate through several sets whose total size exceeds L2 (``rotating``), so a kernel does
not find last call's data in cache. Floors come from ``measure_floors`` in the same run: the
device copy bandwidth (bytes read + written) and the bf16 GEMM rate.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

L2_BYTES = 60 << 20  # H200; the device's own L2 size is used when it reports a larger one
_SLEEP_CYCLES = 20_000_000  # ~10 ms of torch.cuda._sleep at ~2 GHz

# name -> (module whose run(quick, **options) returns a Results, one-line description). A suite
# module may define ``add_options(parser)``: its own command-line options, accepted when it is
# the only suite named; their values reach ``run`` as keyword arguments; and
# ``check_options(quick, **options)``: its checks of them and of its environment variables
# (ValueError naming the bad one), run before the GPU check.
SUITES = {
    "norm": ("dflash_ops.bench.norm",
             "rms_norm (K-norm [T,40,128] w[5,128]; hidden [T,4096]) and fused_add_rms_norm_: "
             "cuda / triton vs torch eager, torch.compile, Liger, floor; host overhead of "
             "each op's default backend vs cuda / triton"),
    "context_kv": ("dflash_ops.bench.context_kv",
                   "knorm_rope_ (k = kv[:,:,0]), qk_norm_rope_ (QKV slices), store_kv_ (vLLM "
                   "caches), the fused context_kv_ path: Qwen3-8B / gpt-oss-20b-DFlash / Qwen3-4B "
                   "/ Qwen3.8-27B shapes; cuda / triton vs torch eager, torch.compile, unfused "
                   "chains, Liger, cuBLAS, floor; host overhead of each op's default backend vs "
                   "cuda / triton"),
    "attention": ("dflash_ops.bench.attention",
                  "block_attention, 16 queries/request over a paged bf16 cache (Hq 32, Hkv 8, "
                  "D 128; B x S up to 128 x 8192, 1 x 131072): triton / cuda vs SDPA flash / "
                  "cuDNN / efficient, FlexAttention (paged, contiguous), floor; causal / window"),
    "drafter": ("dflash_ops.bench.drafter",
                "one Qwen3-8B-DFlash draft step (context K/V + block + LM head + argmax), B 1-64 x "
                "S 1k-8k, 1 x 131k: dflash reference eager vs ours eager / CUDA graph, floor"),
    "dflash2": ("dflash_ops.bench.dflash2",
                "DFlash 2's grouped_dyn_conv (x[T,5120], K 2, group 16) and select_candidates "
                "(k 16, rank 256, V 248k) at Qwen3.8-27B-DFlash2 shapes: ours vs the dflash "
                "reference / torch walk vs floor"),
    "dflash2-step": ("dflash_ops.bench.dflash2_step",
                     "one Qwen3.8-27B-DFlash2 draft step (window 2048, conv + selector) under "
                     "our CUDA graph vs the same drafter without conv and selector vs floor, B "
                     "1-64 x S 1k-8k, 1 x 131k"),
    "policy": ("dflash_ops.bench.policy",
               "the loop's policy vs always drafting vs plain decode, an oracle drafter right "
               "with probability p in 0-0.95, Qwen3-8B shapes, B 1-32 x S 1k-32k: tokens/s "
               "and a plot"),
    "e2e": ("dflash_ops.bench.e2e",
            "one DFlash iteration (draft + verify graphs) vs a decode step, Qwen3-8B shapes, "
            "B 1-64 x S 1k-8k: floors, implied speedup, GPU idle, host syncs"),
}

# The DFLASH_OPS_BENCH_* variables each suite reads (its docstring says more): name -> meaning.
# ``dflash-ops bench --list`` prints them; tests/test_bench_cli.py checks this table against
# the variables the suites' modules name, and the README against it.
SUITE_ENV = {
    "drafter": {
        "DFLASH_OPS_BENCH_DRAFTER_CASES": "=BxS,... (e.g. 1x1024,64x4096): replaces the cases",
        "DFLASH_OPS_BENCH_DRAFTER_REF": "=0: no dflash reference column",
    },
    "policy": {
        "DFLASH_OPS_BENCH_POLICY_CASES": "=BxS,... (k = 1024, e.g. 32x1k,8x32k): replaces the "
                                         "cases",
        "DFLASH_OPS_BENCH_POLICY_PS": "=p,... (e.g. 0,0.2): only those p of the grid",
        "DFLASH_OPS_BENCH_POLICY_TRACE": "=PATH: appends the timed policy runs' choices to PATH "
                                         "(JSON lines)",
    },
    "e2e": {
        "DFLASH_OPS_BENCH_E2E_CASES": "=BxS,... (k = 1024, e.g. 1x1k,64x8k): replaces the cases",
        "DFLASH_OPS_BENCH_E2E_MEM_GB": "=GB: skips a case whose estimated memory is over it "
                                       "(default 120)",
        "DFLASH_OPS_BENCH_E2E_LOOP": "=0: skips the real-loop table",
    },
}

# ----------------------------------------------------------------------------- timing

def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return max(L2_BYTES, int(getattr(props, "L2_cache_size", 0) or 0))


def rotating(make_set: Callable[[], tuple], bytes_per_set: int, *, factor: float = 2.0,
             min_sets: int = 2, max_sets: int = 1024) -> List[tuple]:
    """``make_set()`` called enough times that the sets together hold ``factor`` x L2.

    ``bytes_per_set``: the input bytes of one set. Capped at ``max_sets``: tiny inputs (a few KB)
    then still fit in L2 together, but those sizes are launch-bound anyway.
    """
    n = math.ceil(factor * l2_bytes() / max(1, bytes_per_set))
    return [tuple(make_set()) for _ in range(min(max(n, min_sets), max_sets))]


def _stats(times_ms: Sequence[float], per: int = 1) -> dict:
    q = statistics.quantiles(times_ms, n=100, method="inclusive") if len(times_ms) > 1 \
        else [times_ms[0]] * 99
    med = statistics.median(times_ms)
    return {"us": med * 1e3 / per, "p20": q[19] * 1e3 / per, "p80": q[79] * 1e3 / per,
            "samples": len(times_ms)}


def _time_graph(fn, sets, warmup_ms, rep_ms, calls) -> dict:
    n = max(calls or 32, len(sets))
    n = -(-n // len(sets)) * len(sets)  # a whole number of passes over the sets
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream (autotune, compile, allocator)
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # torch.cuda.graph captures on its own side stream
        for i in range(n):
            fn(*sets[i % len(sets)])
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est_ms))):
        g.replay()
    reps = max(10, int(rep_ms / est_ms))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    torch.cuda._sleep(_SLEEP_CYCLES // 10)  # let the host queue replays ahead of the GPU
    for s, e in ev:
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    out = _stats([s.elapsed_time(e) for s, e in ev], per=n)
    del g
    return {**out, "mode": "graph", "calls_per_graph": n}


def time_fn(fn: Callable, *, rotate: Optional[Sequence[tuple]] = None, graph: bool = False,
            warmup_ms: float = 25, rep_ms: float = 100, calls: Optional[int] = None) -> dict:
    """Per-call device time of ``fn(*args)``; args cycle through ``rotate`` (or ``fn()``).

    Returns {"us": median, "p20", "p80", "mode": "events"|"graph", ...}. With ``graph=True``:
    one warm-up call per set on a side stream (autotuning and compilation happen before
    capture), then ``calls`` calls (default max(32, len(rotate)), rounded up to whole passes
    over the sets) captured in one graph and replayed for ``rep_ms``; times are per call.
    Events (do_bench) time each call from its launch, so when the host takes longer to issue a
    call than the GPU to run it they measure the host: prefer ``graph=True`` then.
    """
    sets = list(rotate) if rotate else [()]
    if graph:
        return _time_graph(fn, sets, warmup_ms, rep_ms, calls)
    from triton.testing import do_bench

    cycle = itertools.cycle(sets)
    call = lambda: fn(*next(cycle))  # noqa: E731
    # do_bench repeats about rep / (one call + its L2 wipe): a slow call (a 45 ms reference
    # step) got ~3 samples; run it again with a longer rep until a median has enough
    rep = rep_ms
    for _ in range(3):
        times = do_bench(call, warmup=warmup_ms, rep=rep, return_mode="all")
        if len(times) >= MIN_EVENT_SAMPLES:
            break
        rep *= 1.5 * MIN_EVENT_SAMPLES / max(1, len(times))
    return {**_stats(times), "mode": "events"}


MIN_EVENT_SAMPLES = 10


def host_overhead_us(fn: Callable[[], object], n: int = 50, rounds: int = 30) -> float:
    """Host time to issue one eager call of ``fn()``, in us (median over rounds).

    What it measures: the CPU wall time of ``n`` back-to-back calls divided by ``n``, while a
    ``torch.cuda._sleep`` kernel keeps the GPU busy, so the host never waits for the device: the
    number is Python + dispatcher + argument checks + launch API cost, the time a host-bound
    loop (small T, no CUDA graph) spends per call. ``fn`` should run on a tiny input; ``n`` stays
    small enough that the launch queue (about a thousand kernels) never fills.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        torch.cuda._sleep(_SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return statistics.median(per_call) * 1e6


_FLOORS: Dict[str, float] = {}


def measure_floors(copy_bytes: int = 2 << 30, gemm_n: int = 8192) -> dict:
    """The two ceilings, measured once per process (cached).

    copy_GBps: ``dst.copy_(src)`` of ``copy_bytes`` bf16, (bytes read + written) / median time.
    gemm_TFLOPs: ``torch.mm`` of random bf16 matrices, 2 m n k / median time, the best of
    n^3 and (2n x n/2) @ (n/2 x n) with n = ``gemm_n``.
    """
    if not _FLOORS:
        from triton.testing import do_bench

        src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")  # never zeros
        dst = torch.empty_like(src)
        ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, quantiles=[0.5])
        _FLOORS.update(copy_GBps=2 * src.nbytes / (ms * 1e-3) / 1e9, copy_bytes=src.nbytes,
                       copy_us=ms * 1e3)
        del src, dst
        # the best of a square GEMM and a wide one (cuBLAS runs some shapes faster than n^3)
        best = None
        for m, n, k in ((gemm_n, gemm_n, gemm_n), (2 * gemm_n, gemm_n, gemm_n // 2)):
            a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ms = do_bench(lambda: torch.mm(a, b, out=c), warmup=50, rep=300, quantiles=[0.5])
            tf = 2 * m * n * k / (ms * 1e-3) / 1e12
            if best is None or tf > best[0]:
                best = (tf, f"{m}x{n}x{k}", ms * 1e3)
            del a, b, c
        _FLOORS.update(gemm_TFLOPs=best[0], gemm_shape=best[1], gemm_us=best[2])
        torch.cuda.empty_cache()
    return dict(_FLOORS)


def floor_us(floors: dict, bytes_moved: float = 0.0, flops: float = 0.0) -> float:
    """max(bytes / copy bandwidth, flops / GEMM rate), in us."""
    return max(bytes_moved / (floors["copy_GBps"] * 1e3),
               flops / (floors.get("gemm_TFLOPs", math.inf) * 1e6))


# ----------------------------------------------------------------------------- results

def env_info() -> dict:
    """Date, GPU, versions and git commit (best effort; ``DFLASH_OPS_COMMIT`` overrides)."""
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["sm"] = "%d.%d" % torch.cuda.get_device_capability()
    try:
        import dflash_ops
        info["dflash_ops"] = dflash_ops.__version__
        info["cuda_ext"] = dflash_ops._ext.STATUS.get("how")
    except Exception:  # noqa: BLE001 - metadata only
        pass
    # the knobs that change what runs (forced backends, debug checks), as set in this run
    info["env"] = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith("DFLASH_OPS_") and k != "DFLASH_OPS_COMMIT"}
    repo = Path(__file__).resolve().parents[2]
    if os.environ.get("DFLASH_OPS_COMMIT"):  # a copy of the tree without .git (device machines)
        info["commit"] = os.environ["DFLASH_OPS_COMMIT"]
        return info
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True,  # noqa: E731
                                        text=True, timeout=10).stdout.strip()
        info["commit"] = git("rev-parse", "--short=12", "HEAD") or None
        if info["commit"] and git("status", "--porcelain", "--untracked-files=no"):
            info["commit"] += "+dirty"
    except Exception:  # noqa: BLE001 - not a checkout, or no git
        info["commit"] = None
    return info


NOTE_WIDTH = 90  # longest cell in the printed table
_HIDDEN = {"table", "x", "p20", "p80", "samples", "bytes", "calls_per_graph"}


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        a = abs(v)
        return f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3g}" if a else "0"
    return str(v)


class Results:
    """Rows of one benchmark run, in named tables; printed fixed-width, saved as md/json/png.

    ``add(table, **fields)`` adds any row; ``add_time`` adds a timing row and derives GB/s, % of
    the copy bandwidth and the multiple of the floor. Rows with an ``x`` field are plotted
    (% of copy bandwidth against x, one line per impl, one panel per table).
    """

    def __init__(self, name: str, floors: Optional[dict] = None, meta: Optional[dict] = None,
                 xlabel: str = "T (tokens)"):
        self.name, self.floors, self.xlabel = name, dict(floors or {}), xlabel
        self.meta = {**env_info(), **(meta or {})}
        self.rows: List[dict] = []
        self.notes: List[str] = []

    def add(self, table: str, **fields) -> dict:
        row = {"table": table, **fields}
        self.rows.append(row)
        return row

    def add_time(self, table: str, case: str, impl: str, t: Optional[dict], *,
                 bytes_moved: Optional[float] = None, floor: Optional[float] = None,
                 note: str = "", **extra) -> dict:
        us = t["us"] if t else None
        gbps = bytes_moved / (us * 1e3) if us and bytes_moved else None
        copy = self.floors.get("copy_GBps")
        return self.add(table, case=case, impl=impl, us=us,
                        **{"GB/s": gbps, "%copy": 100 * gbps / copy if gbps and copy else None,
                           "x floor": us / floor if us and floor else None},
                        timing=(t or {}).get("mode"), **extra, note=note, bytes=bytes_moved,
                        p20=(t or {}).get("p20"), p80=(t or {}).get("p80"))

    def tables(self) -> Dict[str, List[dict]]:
        out: Dict[str, List[dict]] = {}
        for r in self.rows:
            out.setdefault(r["table"], []).append(r)
        return out

    @staticmethod
    def _columns(rows) -> List[str]:
        cols: Dict[str, None] = {}
        for r in rows:
            cols.update((k, None) for k in r if k not in _HIDDEN)
        return list(cols)

    def _header_lines(self) -> List[str]:
        m, f = self.meta, self.floors
        lines = [f"{m.get('date')}  {m.get('gpu', 'no GPU')}  torch {m.get('torch')}  "
                 f"triton {m.get('triton')}  CUDA {m.get('cuda')}  commit {m.get('commit')}"]
        if m.get("env"):
            lines.append("settings: " + " ".join(f"{k}={v}" for k, v in m["env"].items()))
        if m.get("options"):
            lines.append("options: " + " ".join(f"{k}={v}" for k, v in m["options"].items()))
        if f:
            lines.append(f"floors (this run): copy {_fmt(f.get('copy_GBps'))} GB/s (read + write), "
                         f"bf16 GEMM {_fmt(f.get('gemm_TFLOPs'))} TFLOP/s")
        return lines

    def format(self) -> str:
        """Fixed-width tables for stdout."""
        out = [f"== {self.name} ==", *self._header_lines()]
        for title, rows in self.tables().items():
            cols = self._columns(rows)
            cells = [[_fmt(r.get(c))[:NOTE_WIDTH] for c in cols] for r in rows]  # full in md
            w = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
            num = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows)
                   for c in cols]
            line = lambda xs: "  ".join(x.rjust(w[i]) if num[i] else x.ljust(w[i])  # noqa: E731
                                        for i, x in enumerate(xs)).rstrip()
            out += ["", title, line(cols), line(["-" * n for n in w])]
            prev = None
            for r, c in zip(rows, cells):
                if prev is not None and r.get("case") != prev:
                    out.append("")
                prev = r.get("case")
                out.append(line(c))
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        out = [f"# {self.name}", "", *[f"{x}  " for x in self._header_lines()], ""]
        for title, rows in self.tables().items():
            cols = self._columns(rows)
            out += [f"## {title}", "", "| " + " | ".join(cols) + " |",
                    "|" + "|".join("---" for _ in cols) + "|"]
            out += ["| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in cols) + " |"
                    for r in rows]
            out.append("")
        out += [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    def to_json(self) -> dict:
        return {"name": self.name, **self.meta, "floors": self.floors, "notes": self.notes,
                "rows": self.rows}

    def plot(self, path: Path) -> Optional[Path]:
        """% of copy bandwidth against x per table, one line per impl; None without matplotlib."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        tabs = {k: [r for r in v if r.get("x") is not None and r.get("%copy")
                    and r["impl"] != "floor"] for k, v in self.tables().items()}
        tabs = {k: v for k, v in tabs.items() if v}
        if not tabs:
            return None
        fig, axes = plt.subplots(1, len(tabs), figsize=(6 * len(tabs), 4.5), squeeze=False)
        for ax, (title, rows) in zip(axes[0], tabs.items()):
            for impl in dict.fromkeys(r["impl"] for r in rows):
                ax.plot(*zip(*sorted((r["x"], r["%copy"]) for r in rows if r["impl"] == impl)),
                        marker="o", label=impl)
            ax.axhline(100, color="k", linestyle="--", linewidth=1, label="floor (copy)")
            ax.set(xscale="log", ylim=(0, 110), xlabel=self.xlabel,
                   ylabel="% of copy bandwidth (floor / time)", title=title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        return self._save_figure(fig, path)

    def _save_figure(self, fig, path):
        """Title (suite, GPU, date), layout, write ``path``, close; returns path."""
        import matplotlib.pyplot as plt

        fig.suptitle(f"{self.name}: {self.meta.get('gpu', '')} {self.meta.get('date', '')}",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def write(self, out_dir=None, plot: bool = True) -> List[Path]:
        """``<out_dir>/<name>.md``, ``.json`` (and ``.png``); default ./benchmarks/results."""
        d = Path(out_dir) if out_dir else Path.cwd() / "benchmarks" / "results"
        d.mkdir(parents=True, exist_ok=True)
        md, js = d / f"{self.name}.md", d / f"{self.name}.json"
        md.write_text(self.markdown())
        js.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        paths = [md, js]
        if plot:
            png = self.plot(d / f"{self.name}.png")
            paths += [png] if png else []
        return paths


# ----------------------------------------------------------------------------- CLI

def bxs_cases(text: str, need: Callable[[int, int], Optional[str]]) -> list:
    """A ``--cases`` value: comma-separated BxS (B requests x S tokens) as [(B, S), ...];
    ``need(b, s)`` names what a case lacks (None: fine). Raises argparse.ArgumentTypeError."""
    out = []
    for item in text.split(","):
        try:
            b, s = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not BxS (e.g. 8x4096)") from None
        why = need(b, s)
        if why:
            raise argparse.ArgumentTypeError(f"{item!r}: need {why}")
        out.append((b, s))
    return out


def name_list(known: Sequence[str], what: str) -> Callable[[str], List[str]]:
    """An argparse ``type``: comma-separated names of ``known``, returned in ``known``'s order."""
    def parse(text: str) -> List[str]:
        want = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in want if x not in known]
        if unknown or not want:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or [text]}; {what} are "
                                             f"{list(known)}")
        return [x for x in known if x in want]
    return parse


def _parser(suite_module=None, add_help: bool = True) -> argparse.ArgumentParser:
    from ..cli import Parser  # one-line errors, exit code 2

    p = Parser(prog="dflash-ops bench", add_help=add_help,
               description="Run dflash_ops benchmark suites on the CUDA GPU.")
    p.add_argument("names", nargs="*", help=f"suites to run (default: all of {list(SUITES)})")
    p.add_argument("--out", default=None, help="results directory (default ./benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    p.add_argument("--list", action="store_true",
                   help="list the suites and the DFLASH_OPS_BENCH_* variables each reads, and "
                        "exit")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    if suite_module is not None:
        suite_module.add_options(p.add_argument_group(
            f"{suite_module.__name__.rsplit('.', 1)[-1]} options (with that suite only)"))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``dflash-ops bench [names...] [--out DIR] [--quick] [--list] [--no-plot] [suite options]``.

    Suite options (a suite's ``add_options``) are accepted when that suite is the only one named.
    """
    argv = list(argv) if argv is not None else sys.argv[1:]
    named = [n for n in _parser(add_help=False).parse_known_args(argv)[0].names if n in SUITES]
    module = importlib.import_module(SUITES[named[0]][0]) if len(named) == 1 else None
    p = _parser(module if hasattr(module, "add_options") else None)
    a, extra = p.parse_known_args(argv)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}" + (
            f" (suite options are accepted with one suite named, not {named})"
            if len(named) > 1 else ""))
    if a.list:
        for name, (_, desc) in SUITES.items():
            print(f"{name:8s} {desc}")
            for var, what in SUITE_ENV.get(name, {}).items():
                print(f"{'':8s}   {var}{what}")
        return 0
    unknown = [n for n in a.names if n not in SUITES]
    if unknown:
        print(f"dflash-ops bench: unknown suite(s) {unknown}; suites are {list(SUITES)}",
              file=sys.stderr)
        return 2
    common = {"names", "out", "quick", "list", "no_plot"}
    options = {k: v for k, v in vars(a).items() if k not in common}
    try:  # the suites' own checks of their options and variables, before the GPU check
        for name in a.names or list(SUITES):
            check = getattr(importlib.import_module(SUITES[name][0]), "check_options", None)
            if check is not None:
                check(quick=a.quick, **options)
    except ValueError as e:
        print(f"dflash-ops bench: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"dflash-ops bench: needs a CUDA GPU, and torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Nothing was run.",
              file=sys.stderr)
        return 1
    for name in a.names or list(SUITES):
        res = importlib.import_module(SUITES[name][0]).run(quick=a.quick, **options)
        if options:
            res.meta["options"] = {k: v for k, v in options.items() if v is not None}
        paths = res.write(a.out, plot=not a.no_plot)
        print(res.format())
        print("wrote " + ", ".join(map(str, paths)))
    return 0
