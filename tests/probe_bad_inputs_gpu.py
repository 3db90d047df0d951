"""Runs every bad-input case on CUDA with the cuda backend forced, one subprocess each (a
segfault kills only its own case); prints one line per case: raised / NO RAISE / CRASH.

First, the format probe (csrc/format_probe.*): one TORCH_CHECK_VALUE per kind of message value
(text, std::string, int64, double, IntArrayRef, Device), thrown from nvcc-compiled and from
host-compiled code, to name what crashes (found on the H200, 2026-11-29)."""
import subprocess, sys, concurrent.futures as cf
sys.path.insert(0, ".")
ONE = r'''
import sys, torch, dflash_ops
sys.path.insert(0, ".")
import tests.test_bad_inputs as t
op, cid = sys.argv[1], sys.argv[2]
mutate, arg = next((m, a) for c, m, a in t.CASES[op] if c == cid)
torch.manual_seed(0)
kw = t.BASES[op](); mutate(kw); kw = t._to_cuda(kw)
with dflash_ops.use_backend("cuda", ops=[op]):
    try:
        t._call(op, kw); torch.cuda.synchronize(); print("NO RAISE")
    except Exception as e:
        print("raised", type(e).__name__, "names-arg" if t._names(str(e), arg) else "MISSING-ARG", str(e)[:150].replace("\n", " "))
'''
FORMAT = r'''
import sys, torch, dflash_ops
try:
    getattr(torch.ops.dflash_probe, sys.argv[1])(int(sys.argv[2]))
    print("NO RAISE")
except Exception as e:
    print("raised", type(e).__name__, str(e).splitlines()[0][:100])
'''
for f in ("raise_cu", "raise_cpp"):
    for k, what in enumerate(("text", "std::string", "int64", "double", "IntArrayRef", "Device")):
        p = subprocess.run([sys.executable, "-c", FORMAT, f, str(k)], capture_output=True,
                           text=True, timeout=120)
        res = p.stdout.strip() if p.returncode == 0 else f"CRASH rc={p.returncode}"
        print(f"format probe {f:9} {what:12} {res}", flush=True)

import tests.test_bad_inputs as t
from dflash_ops import dispatch
jobs = [(op, c) for op, cases in t.CASES.items() if dispatch.has_backend(op, "cuda") for c, _, _ in cases]
def run(j):
    p = subprocess.run([sys.executable, "-c", ONE, *j], capture_output=True, text=True, timeout=120)
    out = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    return j, (out if p.returncode == 0 else f"CRASH rc={p.returncode} {p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else ''}")
with cf.ThreadPoolExecutor(12) as ex:
    for (op, c), r in ex.map(run, jobs):
        print(f"{op:22} {c:32} {r}", flush=True)
