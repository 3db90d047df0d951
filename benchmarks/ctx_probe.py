"""What context_kv_'s hidden_rms epilogue costs at the vLLM plugin's decode sizes (issue 15: the
precompute's replaced kernels, measured in vLLM by the torch profiler's kernel durations).

Under programmatic dependent launch (PDL, on by default on the H200) our epilogue kernel may
start while the cuBLAS GEMM before it drains and wait in ``griddepcontrol.wait``: a profiler
then counts that wait as the kernel's own time. This probe separates the two, on the Qwen3-8B
drafter's shapes (H 4096, 5 layers, Hkv 8, D 128, bf16, block size 16), for T = 1, 8 and 32
tokens:

* ``gemm``: ``torch.mm(x, w_kv.t())`` alone, CUDA-graph replay, us a call;
* ``op``: the whole ``context_kv_(..., hidden_rms=True)`` (that GEMM, then the epilogue), the
  same way; ``op - gemm`` is what the epilogue adds to the stream;
* ``profiler``: each kernel's mean duration over eager calls of the op (torch.profiler), the
  number a vLLM profile reports.

    python benchmarks/ctx_probe.py              # DFLASH_OPS_PDL=0 to compare without PDL

Each T runs twice: with small caches (a few blocks) and with caches the size vLLM gives them
(``BIG_GB``, at most a third of the GPU's memory, over the 10 K / V tensors, slots spread over all of it), where each row's store and
the cos/sin row land on their own pages: vLLM's profile (5.25 us an iteration at one token)
against this probe's 3.6 us may be that (TLB misses), or not.

The op's output is checked against the torch reference first (tolerance: 2 bf16 ulps of the
largest value), so a fast wrong kernel shows as wrong. About 40 s on the H200 (the 48 GB
caches and the reference's take ~100 GB of GPU memory).
"""
import importlib.util
import os
import sys
from pathlib import Path

H, LAYERS, HKV, D, BLOCK = 4096, 5, 8, 128, 16
BIG_GB = 48  # the caches' total in the vLLM-sized runs (vLLM gave its 8B-width pair ~60% of 141 GB)


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    from torch.profiler import ProfilerActivity, profile

    import dflash_ops
    from dflash_ops.bench.harness import time_fn
    from dflash_ops.ops.rope import make_cos_sin_cache

    if not torch.cuda.is_available():
        print("ctx_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    n = LAYERS * 2 * HKV * D
    w_kv = (torch.randn(n, H, device=dev, generator=g) * H ** -0.5).to(dt)
    k_weight = (1 + 0.1 * torch.randn(LAYERS, D, device=dev, generator=g)).to(dt)
    cs = make_cos_sin_cache(40960, D, base=1e6, device=dev)
    pdl = os.environ.get("DFLASH_OPS_PDL", "1") != "0"
    print(f"ctx_probe: {torch.cuda.get_device_name()}, torch {torch.__version__}, PDL "
          f"{'on' if pdl else 'off'}; H {H}, L {LAYERS}, Hkv {HKV}, D {D}, bf16")
    print("| T | caches | gemm us | op us | op - gemm | profiler: kernel us a call |")
    print("|---|---|---|---|---|---|")
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    big_gb = min(BIG_GB, int(total_gb / 3))  # the reference's copy doubles the caches
    big_nb = big_gb * 2 ** 30 // (2 * LAYERS * BLOCK * HKV * D * 2)
    for t, nb in [(t, nb) for t in (1, 8, 32) for nb in (t // BLOCK + 4, big_nb)]:
        label = f"{2 * LAYERS * nb * BLOCK * HKV * D * 2 / 2 ** 30:.3g} GB"
        x = torch.randn(t, H, device=dev, generator=g).to(dt)
        pos = torch.randint(0, 40960, (t,), device=dev, generator=g)
        slots = torch.randperm(nb * BLOCK, device=dev, generator=g)[:t]
        kc = [torch.zeros(nb, BLOCK, HKV, D, device=dev, dtype=dt) for _ in range(LAYERS)]
        vc = [torch.zeros_like(c) for c in kc]

        def op(backend="cuda", k=kc, v=vc):
            with dflash_ops.use_backend(backend, ops=["context_kv_"]):
                torch.ops.dflash.context_kv_(x, w_kv, None, k_weight, pos, cs, slots, k, v,
                                             1e-6, True, None, True)

        rk = [torch.zeros_like(c) for c in kc]
        rv = [torch.zeros_like(c) for c in kc]
        op("torch", rk, rv)
        op()
        for got, want in zip(kc + vc, rk + rv):  # the written rows (the caches may be 48 GB)
            got, want = got.view(-1, HKV, D)[slots].float(), want.view(-1, HKV, D)[slots].float()
            err = (got - want).abs().max().item()
            tol = 2 * 2 ** -7 * max(1.0, want.abs().max().item())
            if not err <= tol:
                print(f"ctx_probe: T {t}: max error {err:.3e} > {tol:.3e} against the torch "
                      f"reference", file=sys.stderr)
                return 1
        gemm = time_fn(lambda: torch.mm(x, w_kv.t()), graph=True, calls=20)["us"]
        full = time_fn(op, graph=True, calls=20)["us"]
        for _ in range(3):
            op()
        torch.cuda.synchronize()
        calls = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                op()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(
                e, "self_cuda_time_total", 0)
            if us > 0:
                kernels[e.key] = us / calls
        ks = ", ".join(f"{name.split('(')[0].split('<')[0][-28:]} {us:.2f}"
                       for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"| {t} | {label} | {gemm:.2f} | {full:.2f} | {full - gemm:+.2f} | {ks} |",
              flush=True)
        del op, kc, vc, rk, rv
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
