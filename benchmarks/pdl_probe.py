"""What programmatic dependent launch (PDL) saves between dependent kernels in a CUDA graph on
this GPU (issue 19: a decode step is ~400 kernels, most of them launch-bound; a question for the
GPU before any kernel of ours is changed).

A Hopper kernel launched with PDL may start while its predecessor in the stream is finishing;
it must execute ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``) before it reads what the
predecessor wrote. The predecessor may call ``griddepcontrol.launch_dependents`` to let it start
earlier still. Chains of dependent Triton kernels, captured in one CUDA graph and replayed,
each timed per kernel:

* ``tiny``: 400 launches of a one-program kernel adding 1 to a 4096-element vector (x -> y ->
  x ...): the launch-to-launch cost itself;
* ``gemv``: 72 launches alternating a weight-streaming GEMV (one row of x [4096] times a 4096 x
  4096 bf16 weight, 32 MB, 256 programs; weights rotate over 8 copies, 256 MB, so they come from
  HBM) and the tiny kernel: a decode step's pattern. Its PDL variant ``gemv-prefetch`` loads
  the program's first weight block before the wait (weights do not depend on the predecessor).

Each variant's chain is checked first, eagerly and replaying a captured graph, against the
chain without PDL. Variants: no PDL; PDL with the wait first and no trigger (the dependents launch as the grid
ends); PDL with ``launch_dependents`` right after the wait (session 21 tried that on the
attention combine: refuted, its dependents' CTAs resident early); PDL with the trigger in the
epilogue (after the loads / the K loop, before the store). Each result is checked (the chain's final vector) so a missing wait shows as wrong,
not fast. Prints us a kernel per variant and the saving against no PDL.

    python benchmarks/pdl_probe.py

About 30 s on the H200.
"""
import importlib.util
import sys
from pathlib import Path

N = 4096
TINY_CHAIN = 400
GEMV_PAIRS = 36


def main():
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    import triton
    import triton.language as tl

    if not torch.cuda.is_available():
        print("pdl_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dflash_ops.bench.harness import time_fn

    @triton.jit
    def tiny_kernel(x_ptr, y_ptr, N: tl.constexpr, GDC: tl.constexpr, TRIGGER: tl.constexpr):
        # TRIGGER: 0 none (the dependents launch as this grid ends), 1 after the wait, 2 after
        # the loads (before the store: the epilogue)
        if GDC:
            tl.extra.cuda.gdc_wait()
            if TRIGGER == 1:
                tl.extra.cuda.gdc_launch_dependents()
        offs = tl.arange(0, N)
        v = tl.load(x_ptr + offs) + 1.0
        if GDC and TRIGGER == 2:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(y_ptr + offs, v)

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, y_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GDC: tl.constexpr, TRIGGER: tl.constexpr, PREFETCH: tl.constexpr):
        # y[n] = sum_k x[k] w[n, k] for a BN-row block of w, BK columns a step
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        k = tl.arange(0, BK)
        w0 = tl.zeros((BN, BK), dtype=tl.bfloat16)
        if PREFETCH:  # the first weight block needs nothing from the predecessor
            w0 = tl.load(w_ptr + rows[:, None] * K + k[None, :])
        if GDC:
            tl.extra.cuda.gdc_wait()
            if TRIGGER == 1:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if PREFETCH and k0 == 0:
                w = w0
            else:
                w = tl.load(w_ptr + rows[:, None] * K + (k0 + k)[None, :])
            xk = tl.load(x_ptr + k0 + k).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        if GDC and TRIGGER == 2:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(y_ptr + rows, acc)

    dev = "cuda"
    x = torch.zeros(N, device=dev)
    y = torch.zeros(N, device=dev)
    ws = [torch.randn(N, N, device=dev, dtype=torch.bfloat16) * 0.01 for _ in range(8)]
    variants = {"no PDL": dict(pdl=False, GDC=False, TRIGGER=0),
                "PDL, wait first": dict(pdl=True, GDC=True, TRIGGER=0),
                "PDL, wait, trigger at start": dict(pdl=True, GDC=True, TRIGGER=1),
                "PDL, wait, trigger at epilogue": dict(pdl=True, GDC=True, TRIGGER=2)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)

    def tiny(src, dst, v):
        tiny_kernel[(1,)](src, dst, N=N, GDC=v["GDC"], TRIGGER=v["TRIGGER"], launch_pdl=v["pdl"],
                          num_warps=4)

    def gemv(src, dst, w, v, prefetch):
        gemv_kernel[(N // 16,)](src, w, dst, K=N, BN=16, BK=256, GDC=v["GDC"], TRIGGER=v["TRIGGER"],
                                PREFETCH=prefetch, launch_pdl=v["pdl"], num_warps=4)

    def tiny_chain(v):
        bufs = (x, y)
        for i in range(TINY_CHAIN):
            tiny(bufs[i % 2], bufs[(i + 1) % 2], v)

    def gemv_chain(v, prefetch=False):
        for i in range(GEMV_PAIRS):
            gemv(x, y, ws[i % len(ws)], v, prefetch)
            tiny(y, x, v)

    results = {}
    for chain, fn, kernels in (("tiny", tiny_chain, TINY_CHAIN),
                               ("gemv", gemv_chain, 2 * GEMV_PAIRS),
                               ("gemv-prefetch", lambda v: gemv_chain(v, True), 2 * GEMV_PAIRS)):
        for name, v in variants.items():
            if chain == "gemv-prefetch" and not v["pdl"]:
                continue
            try:
                # check, eagerly and replaying a captured graph: the chain from zeros equals
                # the same chain without PDL run eagerly (tiny: TINY_CHAIN added; gemv: the
                # last GEMV's output + 1)
                x.zero_()
                fn(variants["no PDL"])
                torch.cuda.synchronize()
                want = x.clone()
                x.zero_()
                fn(v)
                torch.cuda.synchronize()
                eager_ok = torch.equal(x, want)
                fn(v)  # compiled before the capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn(v)
                x.zero_()
                g.replay()
                torch.cuda.synchronize()
                if not (eager_ok and torch.equal(x, want)):
                    where = "graph replay" if eager_ok else "eager"
                    print(f"{chain:14s} {name:30s}: WRONG result ({where}; a missing wait?)",
                          flush=True)
                    continue
                del g
                r = time_fn(lambda: fn(v), graph=True, warmup_ms=5, rep_ms=100, calls=4)
            except Exception as e:  # noqa: BLE001 - e.g. a Triton without launch_pdl
                print(f"{chain:14s} {name:30s}: failed {type(e).__name__}: {str(e)[:100]}",
                      flush=True)
                continue
            us = r["us"] / kernels
            results[(chain, name)] = us
            base = results.get((chain if chain != "gemv-prefetch" else "gemv", "no PDL"))
            save = f", {base - us:+.2f} us a kernel vs no PDL" if base else ""
            print(f"{chain:14s} {name:30s}: {us:7.2f} us a kernel ({r['mode']}){save}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
