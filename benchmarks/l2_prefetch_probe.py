"""Does prefetching a decoder layer's o_proj weight into L2 while its attention runs pay?

    python benchmarks/l2_prefetch_probe.py [--cases decode:1x1024,verify:1x1024,...]
                                           [--extra-mb 0,8] [--ctas 32] [--rounds 2]

At small batch the attention, its combine and the q/k norm + RoPE of a layer are latency-bound:
~13 us a layer at 1 x 1k during which HBM is nearly idle, followed by o_proj, which streams
33.5 MB (Qwen3-8B) at ~80% of copy. This probe forks a side stream after each layer's qkv GEMM
and issues ``cp.async.bulk.prefetch.L2`` of that layer's o_proj weight (and optionally the first
``--extra-mb`` MB of gate_up) with an evict_last policy, joined at the end of the forward, in the
target's greedy step (Qwen3-8B shapes, random bf16 weights) recorded in a CUDA graph; then times
graph replays with and without, alternating (``--rounds``), and checks the logits are bit-equal
(the prefetch is a hint: it must change nothing but time). Needs CUDA (sm_90) and nvcc (the
prefetch kernel is compiled at start with nvcc into a small library called through ctypes).
An experiment: if it pays, the prefetch becomes an op and a model path; if not, this file goes.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

CUDA_SRC = r"""
#include <cuda_runtime.h>

__global__ void l2_prefetch_kernel(const char* base, long long bytes, int chunk) {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  const long long n = (bytes + chunk - 1) / chunk;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long off = i * chunk;
    const long long left = bytes - off;
    const unsigned size = (unsigned)(left < chunk ? left : chunk);
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                 :: "l"(base + off), "r"(size), "l"(policy) : "memory");
  }
}

extern "C" int l2_prefetch(const void* base, long long bytes, int ctas, int chunk, void* stream) {
  l2_prefetch_kernel<<<ctas, 32, 0, (cudaStream_t)stream>>>((const char*)base, bytes, chunk);
  return (int)cudaGetLastError();
}
"""


class Ext:
    """The prefetch kernel, built with nvcc into a small shared library (no torch headers: a
    few seconds) and called through ctypes on the current stream (captured like any launch)."""

    def __init__(self):
        import ctypes
        import subprocess
        import tempfile
        d = Path(tempfile.mkdtemp(prefix="l2pf"))
        (d / "l2pf.cu").write_text(CUDA_SRC)
        subprocess.run(["nvcc", "-arch=sm_90a", "-O3", "-shared", "-Xcompiler", "-fPIC",
                        "-o", str(d / "l2pf.so"), str(d / "l2pf.cu")], check=True)
        self.lib = ctypes.CDLL(str(d / "l2pf.so"))
        self.lib.l2_prefetch.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_void_p]
        self.lib.l2_prefetch.restype = ctypes.c_int

    def l2_prefetch(self, t: torch.Tensor, nbytes: int, ctas: int, chunk: int) -> None:
        assert t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0
        assert nbytes % 16 == 0 and chunk % 16 == 0 and nbytes <= t.numel() * t.element_size()
        err = self.lib.l2_prefetch(t.data_ptr(), nbytes, ctas, chunk,
                                   torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"l2_prefetch launch: CUDA error {err}")


class Prefetcher:
    """Patches models.layer.linear: after a layer's qkv GEMM is enqueued, the side stream waits
    for the main one and prefetches that layer's o_proj weight (+ extra bytes of gate_up);
    ``join()`` (after the forward) makes the main stream wait for the side stream."""

    def __init__(self, ext, target, extra_mb: float, ctas: int, chunk: int):
        from dflash_ops.models import layer as layer_mod
        self.mod, self.orig = layer_mod, layer_mod.linear
        self.ext, self.ctas, self.chunk = ext, ctas, chunk
        self.by_qkv = {}
        for lay in target.layers:
            gu_bytes = lay.gate_up.numel() * lay.gate_up.element_size()
            extra = min(int(extra_mb * 2 ** 20) // 16 * 16, gu_bytes)
            self.by_qkv[lay.qkv.data_ptr()] = (lay.o, lay.gate_up, extra)
        self.side = torch.cuda.Stream()
        self.on = False

    def linear(self, x, w, b=None, exact=False):
        out = self.orig(x, w, b, exact)
        hit = self.by_qkv.get(w.data_ptr()) if self.on else None
        if hit is not None:
            o, gu, extra = hit
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.ext.l2_prefetch(o, o.numel() * o.element_size(), self.ctas, self.chunk)
                if extra:
                    self.ext.l2_prefetch(gu, extra, self.ctas, self.chunk)
        return out

    def join(self):
        if self.on:
            torch.cuda.current_stream().wait_stream(self.side)

    def __enter__(self):
        self.mod.linear = self.linear
        return self

    def __exit__(self, *exc):
        self.mod.linear = self.orig


def replay_us(g, n: int = 50) -> float:
    for _ in range(5):
        g.replay()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def run_case(kind, batch, context, models, ext, variants, ctas, chunk, rounds):
    from dflash_ops import dispatch
    from dflash_ops.bench import e2e
    from dflash_ops.ops.select import argmax_last

    target, drafter = models
    b = 16 if kind == "verify" else 1
    max_len = context + 32
    per_req = -(-max_len // e2e.KV_BLOCK)
    e2e.install_caches(target, drafter, batch + 1, batch * per_req + 1, max_len)
    for r in range(batch):
        target.add_request(r, max_len)
    dev = target.device
    ra = torch.arange(batch, device=dev)
    st = torch.full((batch,), context, dtype=torch.long, device=dev)
    n = torch.full((batch,), b, dtype=torch.long, device=dev)
    ids = torch.randint(0, 1000, (batch * b,), device=dev)
    taps = drafter.cfg.target_layer_ids
    graphs = {}
    for name, extra in variants:
        pf = Prefetcher(ext, target, extra or 0.0, ctas, chunk)
        pf.on = extra is not None

        def fn():
            logits, _ = target.forward(ids, ra, st, n, taps, fp32_logits=False)
            pf.join()
            return logits, argmax_last(logits)
        with pf:
            g, out = dispatch.capture_graph(fn)
        graphs[name] = (g, out)
    base_g, (base_z, base_t) = graphs[variants[0][0]]
    base_g.replay()
    torch.cuda.synchronize()
    ref = base_z.clone()
    times = {name: [] for name, _ in variants}
    same = {}
    for _ in range(rounds):
        for name, _ in variants:
            g, (z, _) = graphs[name]
            times[name].append(replay_us(g))
            same[name] = torch.equal(z, ref)
    label = f"{kind} {batch} x {context}"
    base = statistics.median(times[variants[0][0]])
    for name, _ in variants:
        t = statistics.median(times[name])
        runs = " / ".join(f"{x:.1f}" for x in times[name])
        print(f"| {label} | {name} | {t:.1f} | {runs} | {t - base:+.1f} ({100 * (t / base - 1):+.2f}%) "
              f"| {'yes' if same[name] else 'NO'} |", flush=True)
    del graphs
    e2e.release_caches(target, drafter)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="decode:1x1024,verify:1x1024,decode:1x8192,decode:32x8192")
    ap.add_argument("--extra-mb", default="0,12", help="gate_up MB prefetched besides o_proj")
    ap.add_argument("--ctas", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=16384, help="bytes a bulk prefetch")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("l2_prefetch_probe.py needs CUDA")
    ext = Ext()
    from dflash_ops.bench import e2e
    models = e2e.build_models(e2e.qwen3_8b_target_config(), e2e.qwen3_8b_dflash_config())
    variants = [("none", None)] + [(f"o_proj{f' + {x} MB gate_up' if float(x) else ''}", float(x))
                                   for x in a.extra_mb.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  ctas {a.ctas} "
          f"chunk {a.chunk}")
    print("| step B x S | prefetch | us (median) | rounds | vs none | logits equal |")
    print("|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        kind, shape = case.split(":")
        batch, context = (int(x) for x in shape.lower().split("x"))
        run_case(kind, batch, context, models, ext, variants, a.ctas, a.chunk, a.rounds)


if __name__ == "__main__":
    main()
