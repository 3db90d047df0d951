"""Whether a graph branch pays in the DFlash 2 draft step (issue 16; a question for the GPU
before the drafter changes).

Each DFlash 2 conv projection x [T, H] @ w [2 K G, H]^T (H 5120, 2 K G 1280: 13 MB at
Qwen3.8-27B-DFlash2) feeds the prepare convolution with its first half and the finish
convolution, after the sublayer, with its second. Split in two GEMMs, the second half could run
on a CUDA-graph branch beside the sublayer, so the step's chain keeps half the weight. Whether
that gains depends on what a fork / join costs in a graph and how much the branch GEMM slows
the sublayer's own weight streams. Five layers of the attention sublayer's pattern, T 8 rows
(a batch-1 draft block), captured in one graph and replayed (weights 0.6 GB, from HBM):

    x2 = x + dyn0 (the prepare conv's stand-in: a small add), qkv = x2 @ Wqkv^T [6144],
    o = qkv[:, :4096] @ Wo^T [5120], o[:, :640] += dyn1 (the finish conv's stand-in), x = o

with the projection as
* ``serial``: one GEMM [1280], both halves before the sublayer (the drafter today);
* ``split``: two GEMMs [640] back to back (the split's own cost, no branch);
* ``branch``: dyn0's GEMM in the chain, dyn1's on a side stream forked before the sublayer
  and joined before the finish add;
* ``empty fork``: ``serial`` plus a fork / join a layer around an empty side kernel (what the
  branch costs by itself).

Every variant's output is checked against ``serial`` (bf16 tolerance: the split GEMMs may sum
in another order). Prints us a step and the difference to ``serial``. Prediction (session 43,
H100): split +1 to +3 us a layer (two launches), empty fork +1 to +3 us a layer, branch -2 to
-4 us a layer against serial (half the projection's ~9 us leaves the chain, its bytes, ~2 us
of bandwidth, land on the sublayer's streams). The branch pays if it beats serial by >= 10
us over the five layers.

    python benchmarks/results/session43-2026-12-07/fork_probe.py     # ~20 s
"""
import importlib.util
import sys
from pathlib import Path

H, QKV, O_IN, PROJ, HALF, T, LAYERS = 5120, 6144, 4096, 1280, 640, 8, 5


def main() -> int:
    if importlib.util.find_spec("dflash_ops") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    import torch

    if not torch.cuda.is_available():
        print("fork_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dflash_ops.bench.harness import time_fn
    from dflash_ops.models.linear import linear

    g = torch.Generator(device="cuda").manual_seed(0)

    def mat(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)

    layers = [dict(wp=mat(PROJ, H), wqkv=mat(QKV, H), wo=mat(H, O_IN)) for _ in range(LAYERS)]
    for w in layers:  # the split halves as their own contiguous weights
        w["wp0"], w["wp1"] = w["wp"][:HALF].contiguous(), w["wp"][HALF:].contiguous()
    x0 = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    side = torch.cuda.Stream()
    scratch = torch.zeros(16, device="cuda")

    def sublayer(x, dyn0, w):
        x2 = x.clone()
        x2[:, :HALF] += dyn0
        qkv = linear(x2, w["wqkv"])
        return linear(qkv[:, :O_IN], w["wo"])

    def step(variant):
        x = x0
        main_s = torch.cuda.current_stream()
        for w in layers:
            if variant == "serial" or variant == "empty fork":
                dyn = linear(x, w["wp"])
                dyn0, dyn1 = dyn[:, :HALF], dyn[:, HALF:]
                if variant == "empty fork":
                    side.wait_stream(main_s)
                    with torch.cuda.stream(side):
                        scratch.add_(1.0)
                o = sublayer(x, dyn0, w)
                if variant == "empty fork":
                    main_s.wait_stream(side)
            elif variant == "split":
                dyn0, dyn1 = linear(x, w["wp0"]), linear(x, w["wp1"])
                o = sublayer(x, dyn0, w)
            else:  # branch
                dyn0 = linear(x, w["wp0"])
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    dyn1 = linear(x, w["wp1"])
                o = sublayer(x, dyn0, w)
                main_s.wait_stream(side)
            o[:, :HALF] += dyn1
            x = o
        return x

    variants = ("serial", "split", "branch", "empty fork")
    want = step("serial").float()
    torch.cuda.synchronize()
    print(f"fork_probe: {torch.cuda.get_device_name()}, torch {torch.__version__}; T {T}, "
          f"{LAYERS} layers (projection {PROJ} x {H}, qkv {QKV} x {H}, o {H} x {O_IN}), bf16")
    print("| variant | us a step | vs serial | max err vs serial |")
    print("|---|---|---|---|")
    base, bad = None, 0
    for v in variants:
        got = step(v).float()
        torch.cuda.synchronize()
        err = (got - want).abs().max().item()
        ok = err <= 0.05 * want.abs().max().item()
        bad += not ok
        t = time_fn(lambda: step(v), graph=True)["us"]
        base = t if base is None else base
        print(f"| {v} | {t:.1f} | {t - base:+.1f} | {err:.3g}{'' if ok else ' WRONG'} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
