"""The ``dflash-ops`` command: ``demo``, ``info``, ``check``, ``bench``, ``train-tiny``."""
from __future__ import annotations

import argparse
import os
import platform
import sys


class UsageError(Exception):
    """A bad option value found after parsing; printed as one ``<prog>: error:`` line, exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message>`` on stderr, exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(low: int, why: str = ""):
    """An argparse type: an integer >= ``low``; the error names what was given and the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer >= {low}{why}")
        return value

    return parse


def int_in(low: int, high: int, why: str = ""):
    """An argparse type: an integer in ``low .. high``; the error names what was given and the
    range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer {low} .. "
                                             f"{high}{why}")
        return value

    return parse


def seed_arg(text: str) -> int:
    """An argparse type: a torch.Generator seed, -2**63 .. 2**64 - 1 (what manual_seed takes)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -2 ** 63 <= value < 2 ** 64:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer -2**63 .. 2**64 - 1")
    return value


def device_arg(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``, usable by this torch on this machine."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    n_gpus = torch.cuda.device_count()
    if dev is not None and dev.type == "cuda" and n_gpus == 0:
        why = ("a CPU-only build" if torch.version.cuda is None
               else f"CUDA {torch.version.cuda}, but no GPU is visible")
        raise argparse.ArgumentTypeError(
            f"got {text!r}, but this torch {torch.__version__} ({why}) has no CUDA device; "
            f"allowed here: cpu")
    if dev is None or not ((dev.type == "cpu" and dev.index is None) or
                           (dev.type == "cuda" and (dev.index or 0) < n_gpus)):
        gpus = "cuda:0" if n_gpus == 1 else f"cuda:0 .. cuda:{n_gpus - 1}"
        raise argparse.ArgumentTypeError(
            f"got {text!r}; allowed here: cpu" + (f", cuda, {gpus}" if n_gpus else ""))
    return text


def linear_table_line() -> str:
    """Which GPUs the models' linear table (models/linear_table.json) holds on, and whether it
    holds on this one: where it does not, every linear layer runs cuBLAS."""
    import torch

    from .models import linear as L

    gpus = L.TABLE_GPUS
    if not L.TABLE:
        return "linear table: none (every linear layer runs cuBLAS)"
    where = "any GPU" if gpus is None else ", ".join(gpus)
    if not torch.cuda.is_available():
        return f"linear table: holds on {where} (no GPU here)"
    here = L.table_applies(torch.device("cuda", torch.cuda.current_device()))
    return (f"linear table: holds on {where}; here: "
            + ("yes (our Triton GEMMs where they won)" if here else "no (cuBLAS)"))


def _info(args) -> int:
    import torch

    import dflash_ops
    from dflash_ops import _ext, dispatch

    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    print(f"dflash_ops {dflash_ops.__version__}  python {platform.python_version()}  "
          f"torch {torch.__version__}  triton {triton_v}  CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"GPU: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.0f} GiB)")
    else:
        print("GPU: none (CPU only: ops run the torch reference; triton under TRITON_INTERPRET=1)")
    st = _ext.STATUS
    print(f"CUDA extension: {st['how']} ({st['detail']})")
    print(linear_table_line())
    forced = os.environ.get("DFLASH_OPS_BACKEND", "").strip().lower()
    if forced:
        print(f"backend forced by DFLASH_OPS_BACKEND={forced}: every op runs {forced}; a call of "
              f"an op without a {forced} kernel (marked 'missing') raises "
              f"BackendUnavailableError")
    print()
    # default: the op's declared backend on CUDA (every call recorded into a CUDA graph); eager:
    # the declared one for calls outside capture, where it differs; runs: what an eager / a
    # captured CUDA call resolves to here (unless a kernel is absent or a backend is forced);
    # a forced backend without the op's kernel shows as "<backend> (missing)"
    print(f"{'op':<22} {'torch':<6} {'triton':<7} {'cuda':<5} {'default':<8} {'eager':<7} "
          f"runs on CUDA (eager / graph)")

    def runs(name, graph):
        b = dispatch.resolve(name, "cuda", graph=graph)
        return b if dispatch.has_backend(name, b) else f"{b} (missing)"

    for name, op in sorted(dispatch.ops().items()):
        have = [("yes" if dispatch.has_backend(name, b) else "-") for b in dispatch.BACKENDS]
        print(f"{name:<22} {have[0]:<6} {have[1]:<7} {have[2]:<5} {op.default:<8} "
              f"{op.eager or '-':<7} {runs(name, False)} / {runs(name, True)}")
    return 0


def _check(args) -> int:
    import torch

    from dflash_ops import check

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             None: None}[args.dtype]
    rows = check.run(device=args.device, dtype=dtype)
    print(check.format_table(rows))
    bad = [r for r in rows if r["ok"] is False]
    ran = [r for r in rows if r["ok"] is not None]
    print(f"\n{len(ran) - len(bad)} passed, {len(bad)} failed "
          f"({rows[0]['device'] if rows else '-'}, {rows[0]['dtype'] if rows else '-'})")
    return 1 if bad else 0


def _bench(rest) -> int:
    from dflash_ops.bench import main as bench_main

    return bench_main(rest) or 0


def build_parser() -> Parser:
    import dflash_ops
    from dflash_ops import train_tiny
    from dflash_ops.speculator import demo

    parser = Parser(prog="dflash-ops", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"dflash-ops {dflash_ops.__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="{info,check,bench,demo,train-tiny}", required=True)
    sub.add_parser("info", help="versions, GPU, extension status, backends per op")
    c = sub.add_parser("check", help="every op vs the reference on random inputs; non-zero "
                                     "exit on a mismatch")
    c.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if a GPU is visible, else cpu)")
    c.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="test dtype (default: bf16 on CUDA, fp16 on CPU)")
    sub.add_parser("bench", help="run benchmark suites (dflash-ops bench --list)")
    demo.add_parser(sub)
    train_tiny.add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":  # the bench suite parses its own arguments
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from dflash_ops import train_tiny
    from dflash_ops.speculator import demo

    try:
        return {"info": _info, "check": _check, "demo": demo.run,
                "train-tiny": train_tiny.run}[args.cmd](args)
    except UsageError as e:
        print(f"dflash-ops {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
