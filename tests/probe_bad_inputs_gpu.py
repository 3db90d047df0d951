"""Runs every bad-input case on CUDA with the cuda backend forced, one subprocess each (a
segfault kills only its own case); prints one line per case: raised / NO RAISE / CRASH.

First, the format probe (csrc/format_probe.cpp, format_probe_nvcc.cu): one TORCH_CHECK_VALUE per kind of message value
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
DIAG = r"""
import torch, dflash_ops, dflash_ops._C as C, subprocess
print("torch", torch.__version__, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI, "ext", C.__file__)
print("libstdc++ in process:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libstdc++" in l or "libgcc_s" in l}))
for lib in (C.__file__, torch._C.__file__):
    out = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    print(lib.split("/")[-1], [l.strip() for l in out.splitlines() if "stdc++" in l or "gcc_s" in l])
try:
    torch.zeros(2) + torch.zeros(3)
except Exception as e:
    print("torch's own number message:", str(e).splitlines()[0][:120])
"""
p = subprocess.run([sys.executable, "-c", DIAG], capture_output=True, text=True, timeout=120)
print(p.stdout, p.stderr[-2000:], "rc", p.returncode, flush=True)
for tool in (["g++", "--version"], ["c++", "--version"], ["nvcc", "--version"]):
    try:
        print(" ".join(tool), "->", subprocess.run(tool, capture_output=True, text=True).stdout.strip().splitlines()[:1])
    except FileNotFoundError:
        print(tool[0], "not found")
import shutil
if shutil.which("gdb"):  # one backtrace of the int64 case
    p = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c",
                        FORMAT, "raise_cpp", "2"], capture_output=True, text=True, timeout=300)
    print("gdb:", "\n".join(p.stdout.splitlines()[-40:]), flush=True)
else:
    print("no gdb", flush=True)
for k in range(3):
    p = subprocess.run([sys.executable, "-c", "import torch, dflash_ops, sys; print(torch.ops.dflash_probe.fmt_cpp(int(sys.argv[1])))", str(k)],
                       capture_output=True, text=True, timeout=120)
    print(f"format probe fmt_cpp {k} ->", p.stdout.strip() if p.returncode == 0 else f"CRASH rc={p.returncode}", flush=True)
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
