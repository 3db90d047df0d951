"""Launch-config sweep for the Triton kv_proj and fused context_kv_ kernels (H200, bf16).

For each model K/V shape (x[T, H] @ w[N, H]^T) and T, times cuBLAS ``F.linear`` and a grid of
``ProjCfg`` launches of our kv_proj (TMA and pointer loads), then a grid of ``CtxCfg`` launches of
the fused context_kv_; every config is checked against F.linear / the torch reference on the
same inputs before it is timed (a wrong config is listed as such, never as fast). Prints, per (shape, T), the best few with their ratio to cuBLAS and to
the floor (max of bytes / copy bandwidth, FLOPs / GEMM rate, measured in the same run).
The chosen defaults live in dflash_ops/triton/context.py (proj_config, context_config).

    python benchmarks/sweep_context.py [--proj-only] [--ctx-only] [--models Qwen3-8B,...]
"""
import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

import dflash_ops
from dflash_ops.bench.harness import floor_us, measure_floors, time_fn
from dflash_ops.ops.rope import make_cos_sin_cache
from dflash_ops.triton import context as tc

MODELS = {  # name: (H, L, Hkv, D)
    "Qwen3-8B": (4096, 5, 8, 128), "Qwen3-4B": (2560, 5, 8, 128),
    "Qwen3.8-27B-DFlash2": (5120, 5, 8, 128), "gpt-oss-20b": (2880, 8, 8, 64)}
TS = (1, 16, 64, 256, 1024, 4096, 16384)
BF16 = torch.bfloat16


def proj_grid(t):
    if t <= 64:
        bm = max(16, triton_next_pow2(t))
        for bn, bk, st in itertools.product((32, 64, 128), (128, 256), (4, 6)):
            yield tc.ProjCfg(bm, bn, bk, 8, 4, tc._stages(st, bm, bn, bk, 2), True)
        yield tc.ProjCfg(bm, 32, 128, 8, 4, 4, False)
        yield tc.ProjCfg(bm, 64, 64, 8, 4, 4, True)
        for bn in (32, 64, 128):
            yield tc.ProjCfg(bm, bn, 128, 8, 4, tc._stages(4, bm, bn, 128, 2), True, True)
    else:
        for bm, bn, st, w in itertools.product((64, 128), (128, 256), (3, 4), (4, 8)):
            if bm * bn > 128 * 128 and w == 4 or bm * bn < 128 * 128 and w == 8:
                continue
            yield tc.ProjCfg(bm, bn, 64, 8, w, tc._stages(st, bm, bn, 64, 2), True)
        yield tc.ProjCfg(128, 128, 64, 8, 8, 3, False)
        yield tc.ProjCfg(128, 128, 128, 8, 8, 3, True)
        if t <= 512:  # the wave-quantised middle: narrower tiles
            for bm, bn, st in ((128, 64, 4), (64, 64, 4), (64, 128, 4), (64, 128, 3)):
                yield tc.ProjCfg(bm, bn, 64, 8, 4, st, True, bm == 64 and bn == 128)
        for bm, bn, st in itertools.product((64, 128), (128, 256), (3, 4)):
            yield tc.ProjCfg(bm, bn, 64, 8, 8 if bm * bn >= 128 * 128 else 4,
                             tc._stages(st, bm, bn, 64, 2), True, True)


def ctx_grid(t, d):
    if t <= 64:
        bm = max(16, triton_next_pow2(t))
        for bk, st, tma in itertools.product((64, 128), (3, 4, 5), (True, False)):
            yield tc.CtxCfg(bm, bk, 8, 4, tc._stages(st, bm, d, bk, 2), tma)
    else:  # split: kv_proj's GEMM then the epilogue alone (bm rows a program); one fused ref
        for bm, w in itertools.product((16, 32, 64), (2, 4)):
            yield tc.CtxCfg(bm, 64, 8, w, 1, split=True)
        yield tc.CtxCfg(128 if d <= 128 else 64, 64, 8, 8, 4)


def triton_next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)
            ).item()


def _time(fn, t):
    return time_fn(fn, graph=True, warmup_ms=5, rep_ms=40, calls=4 if t >= 4096 else 16)["us"]


def sweep_proj(name, h, n, floors, out):
    w = torch.randn(n, h, device="cuda", dtype=BF16) * h ** -0.5
    for t in TS:
        x = torch.randn(t, h, device="cuda", dtype=BF16)
        want = F.linear(x, w)
        lin = _time(lambda: F.linear(x, w), t)
        fl = floor_us(floors, bytes_moved=2 * (t * h + n * h + t * n), flops=2 * t * h * n)
        dflt = tc.proj_config(t, n, h)
        rows = []
        for cfg in dict.fromkeys(list(proj_grid(t)) + [dflt]):
            o = torch.empty(t, n, device="cuda", dtype=BF16)
            try:
                tc.launch_proj(x, w, None, o, cfg)
                torch.cuda.synchronize()
                e = _err(o, want)
                if e > 2e-2:
                    rows.append((float("inf"), cfg, f"WRONG (rel err {e:.2e})"))
                    continue
                us = _time(lambda: tc.launch_proj(x, w, None, o, cfg), t)
                rows.append((us, cfg, ""))
            except Exception as ex:  # noqa: BLE001 - e.g. out of shared memory
                rows.append((float("inf"), cfg, f"failed: {type(ex).__name__}: {str(ex)[:80]}"))
        rows.sort(key=lambda r: r[0])
        d_us = next(r[0] for r in rows if r[1] == dflt)
        print(f"\n{name} kv_proj T={t} H={h} N={n}: F.linear {lin:.1f} us, floor {fl:.1f} us, "
              f"default {dflt} {d_us:.1f} us ({d_us / lin:.2f}x cuBLAS)", file=out)
        for us, cfg, note in rows[:6] + [r for r in rows if r[2].startswith("WRONG")][:3]:
            print(f"   {us:8.1f} us  {us / lin:5.2f}x cuBLAS  {us / fl:5.2f}x floor  {cfg} {note}",
                  file=out)
        out.flush()


def sweep_ctx(name, h, n_layers, hkv, d, floors, out):
    n = n_layers * 2 * hkv * d
    w = torch.randn(n, h, device="cuda", dtype=BF16) * h ** -0.5
    kw = (1 + 0.1 * torch.randn(n_layers, d, device="cuda")).to(BF16)
    cs = make_cos_sin_cache(32768, d, device="cuda")
    for t in TS:
        nb = t // 16 + 2
        x = torch.randn(t, h, device="cuda", dtype=BF16)
        pos = torch.arange(t, device="cuda") + 100
        slots = torch.randperm(nb * 16, device="cuda")[:t]
        kb = torch.zeros(n_layers, nb, 16, hkv, d, device="cuda", dtype=BF16)
        vb = torch.zeros_like(kb)
        kc, vc = list(kb.unbind(0)), list(vb.unbind(0))
        lin = _time(lambda: F.linear(x, w), t)
        fl = floor_us(floors, bytes_moved=2 * (t * h + n * h + t * n), flops=2 * t * h * n)
        kr, vr = torch.zeros_like(kb), torch.zeros_like(vb)
        with dflash_ops.use_backend("torch", ops=["context_kv_"]):
            torch.ops.dflash.context_kv_(x, w, None, kw, pos, cs, slots, list(kr.unbind(0)),
                                         list(vr.unbind(0)), 1e-6, True, None)
        dflt = tc.context_config(t, d)
        rows = []
        for cfg in dict.fromkeys(list(ctx_grid(t, d)) + [dflt]):
            def call(cfg=cfg):
                tc.context_kv_(x, w, None, kw, pos, cs, slots, kc, vc, 1e-6, True, None, cfg=cfg)
            try:
                kb.zero_()
                vb.zero_()
                call()
                torch.cuda.synchronize()
                e = max(_err(kb, kr), _err(vb, vr))
                if e > 3e-2:
                    rows.append((float("inf"), cfg, f"WRONG (rel err {e:.2e})"))
                    continue
                rows.append((_time(call, t), cfg, ""))
            except Exception as ex:  # noqa: BLE001
                rows.append((float("inf"), cfg, f"failed: {type(ex).__name__}: {str(ex)[:80]}"))
        rows.sort(key=lambda r: r[0])
        d_us = next(r[0] for r in rows if r[1] == dflt)
        print(f"\n{name} context_kv_ T={t}: F.linear {lin:.1f} us, floor {fl:.1f} us, default "
              f"{dflt} {d_us:.1f} us ({d_us / lin:.2f}x)", file=out)
        for us, cfg, note in rows[:6] + [r for r in rows if r[2]][:3]:
            print(f"   {us:8.1f} us  {us / lin:5.2f}x F.linear  {us / fl:5.2f}x floor  {cfg} {note}",
                  file=out)
        out.flush()


def main():
    global TS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proj-only", action="store_true")
    ap.add_argument("--ctx-only", action="store_true")
    ap.add_argument("--models", default="Qwen3-8B,gpt-oss-20b")
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    a = ap.parse_args()
    TS = tuple(int(v) for v in a.ts.split(","))
    floors = measure_floors()
    print(f"copy {floors['copy_GBps']:.0f} GB/s, GEMM {floors['gemm_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    for m in a.models.split(","):
        h, n_layers, hkv, d = MODELS[m]
        if not a.ctx_only:
            sweep_proj(m, h, n_layers * 2 * hkv * d, floors, sys.stdout)
        if not a.proj_only:
            sweep_ctx(m, h, n_layers, hkv, d, floors, sys.stdout)


if __name__ == "__main__":
    main()
