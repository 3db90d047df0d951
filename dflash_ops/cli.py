"""The ``dflash-ops`` command: ``demo``, ``info``, ``check``, ``bench``."""
from __future__ import annotations

import argparse
import platform
import sys


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
    print()
    print(f"{'op':<22} {'torch':<6} {'triton':<7} {'cuda':<5} default on CUDA")
    for name in sorted(dispatch.ops()):
        have = [("yes" if dispatch.has_backend(name, b) else "-") for b in dispatch.BACKENDS]
        print(f"{name:<22} {have[0]:<6} {have[1]:<7} {have[2]:<5} {dispatch.resolve(name, 'cuda')}")
    return 0


def _check(args) -> int:
    import torch

    import dflash_ops  # noqa: F401
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":  # the bench suite parses its own arguments
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="dflash-ops", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, GPU, extension status, backends per op")
    c = sub.add_parser("check", help="every op vs the reference on random inputs; non-zero "
                                     "exit on a mismatch")
    c.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    c.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="test dtype (default: bf16 on CUDA, fp16 on CPU)")
    sub.add_parser("bench", help="run benchmark suites (dflash-ops bench --list)")
    from dflash_ops.speculator import demo
    demo.add_parser(sub)
    args = parser.parse_args(argv)
    return {"info": _info, "check": _check, "demo": demo.run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
