"""``dflash-ops bench dflash2``: DFlash 2's two ops at Qwen3.8-27B-DFlash2 shapes (bf16).

* ``grouped_dyn_conv`` on x [T, 5120], K 2, group size 16 (G 320), the dynamic taps a strided
  half of the [T, 2, 2, 320] projection, blocks of 8 rows: our kernels (Triton, CUDA) vs the
  ``dflash`` package's convolution run eagerly (its per-tap bf16 products) vs the floor (x,
  dynamic and y once, over this run's copy bandwidth), T 64 .. 16384 (batch x 8 rows).
* ``conv_add_rms_norm`` (the convolution after a sublayer, the residual add and the next
  RMSNorm in one kernel; the drafter runs it twice a layer) on the same shapes, T 8 .. 4096:
  our kernels (Triton, CUDA) vs the two kernels it replaces (``grouped_dyn_conv`` then
  ``fused_add_rms_norm_``, default backends) vs the floor (x, dynamic, the residual read and
  written, the output).
* ``select_candidates``: R requests x 7 rows, k 16, rank 256, V 248320 codebooks (the gathered
  rows are the bytes: R * 7 * (k + 1) * rank * 2 + unary/hidden): our kernels (Triton, CUDA)
  vs the walk as eager torch (the reference), R 1 .. 64.

Timing: CUDA-graph replays (``time_fn(graph=True)``), inputs rotating over > 2x L2.
"""
from __future__ import annotations

import torch

from .. import dispatch
from .columns import BF16_ULP
from .harness import Results, floor_us, measure_floors, rotating, time_fn

H, K, GS, BLOCK = 5120, 2, 16, 8
DEVICE = "cuda"  # (the CPU tests set "cpu")
TOL_ULPS, REF_TOL_ULPS = 2, 4  # ours / a column that rounds otherwise (per tap, or the conv
#                                rounded to bf16 before the norm), in bf16 ulps of max |want|


def _timed(res: Results, table: str, case: str, name: str, ok: bool, note: str, fn, sets,
           timing: dict, **row) -> None:
    """A column's row: timed only where its check passed (``ok``), else "WRONG, not timed"."""
    t = time_fn(fn, rotate=sets, graph=True, **timing) if ok else None
    res.add_time(table, case, name, t, note=note if ok else f"WRONG, not timed: {note}", **row)


def _within(got: torch.Tensor, want: torch.Tensor, ulps: int) -> tuple:
    """(ok, max abs error, note): max |got - want| <= ulps bf16 ulps of max |want|."""
    err = (got.float() - want).abs().max().item()
    tol = ulps * BF16_ULP * want.abs().max().item()
    return err <= tol, err, f"max err {err:.3g} (tol {tol:.3g})"
CONV_T = (64, 512, 4096, 16384)
QUICK_CONV_T = (512, 4096)
NORM_T = (8, 64, 512, 4096)
SEL_R = (1, 8, 64)
QUICK_SEL_R = (1, 64)


def _conv(res: Results, ts, timing) -> None:
    from dflash_ops.ops.conv import grouped_dyn_conv, grouped_dyn_conv_ref
    g = H // GS
    dev, bf16 = DEVICE, torch.bfloat16
    ref_fn = None
    try:
        import dflash.model as dm

        def ref_fn(x, dyn, base):
            r = x.shape[0] // BLOCK
            return dm._grouped_dynamic_convolve(x.view(r, BLOCK, H), dyn.reshape(r, BLOCK, -1),
                                                base, GS)
    except ImportError:
        res.notes.append("dflash package not installed: no reference column")
    table = f"grouped_dyn_conv x[T,{H}] bf16, K {K}, group {GS}, blocks of {BLOCK}"
    for t in ts:
        def make(t=t):
            x = torch.randn(t, H, dtype=bf16, device=dev)
            dyn = torch.randn(t, 2, K, g, dtype=bf16, device=dev)[:, 0]
            return x, dyn, torch.randn(K, H, dtype=bf16, device=dev)
        read = t * H * 2 + t * K * g * 2 + K * H * 2  # x, dynamic (a strided half), base
        moved = read + t * H * 2  # and y
        sets = rotating(make, read)
        x, dyn, base = sets[0]
        fl = floor_us(res.floors, moved)
        want = grouped_dyn_conv_ref(x, dyn, base, GS, BLOCK).float()
        row = dict(bytes_moved=moved, floor=fl, x=t)
        for backend in ("triton", "cuda"):
            if not dispatch.has_backend("grouped_dyn_conv", backend):
                continue
            with dispatch.use_backend(backend, ops=("grouped_dyn_conv",)):
                ok, err, note = _within(grouped_dyn_conv(x, dyn, base, GS, BLOCK), want,
                                        TOL_ULPS)
                _timed(res, table, str(t), f"ours ({backend})", ok, note,
                       lambda x, d, b: grouped_dyn_conv(x, d, b, GS, BLOCK), sets, timing,
                       err=err, **row)
        if ref_fn is not None:
            ok, err, note = _within(ref_fn(x, dyn, base).reshape(want.shape), want, REF_TOL_ULPS)
            _timed(res, table, str(t), "dflash eager", ok, note, ref_fn, sets, timing, err=err,
                   **row)


def _conv_norm(res: Results, ts, timing) -> None:
    from dflash_ops.ops.conv import conv_add_rms_norm, conv_add_rms_norm_ref, grouped_dyn_conv
    from dflash_ops.ops.norm import fused_add_rms_norm_
    g = H // GS
    dev, bf16 = DEVICE, torch.bfloat16
    table = f"conv_add_rms_norm x[T,{H}] bf16, K {K}, group {GS}, blocks of {BLOCK}"
    w = 1 + 0.1 * torch.randn(H, dtype=bf16, device=dev)
    for t in ts:
        def make(t=t):
            return (torch.randn(t, H, dtype=bf16, device=dev),
                    torch.randn(t, H, dtype=bf16, device=dev),
                    torch.randn(t, 2, K, g, dtype=bf16, device=dev)[:, 0],
                    torch.randn(K, H, dtype=bf16, device=dev))
        read = t * H * 2 * 2 + t * K * g * 2 + K * H * 2  # x, residual, dynamic half, base
        moved = read + t * H * 2 * 2 + H * 2  # and the residual written, out, w
        sets = rotating(make, read)
        x, r, dyn, base = sets[0]
        r0 = r.clone()  # the timed calls add into the sets' residuals: check on a copy first
        fl = floor_us(res.floors, moved)
        want = torch.empty_like(x)
        conv_add_rms_norm_ref(x, r0.clone(), dyn, base, GS, BLOCK, w, 1e-6, out=want)
        want = want.float()
        for backend in ("triton", "cuda"):
            if not dispatch.has_backend("conv_add_rms_norm_", backend):
                continue
            with dispatch.use_backend(backend, ops=("conv_add_rms_norm_",)):
                got = conv_add_rms_norm(x, r0.clone(), dyn, base, GS, BLOCK, w, 1e-6)
                ok, err, note = _within(got, want, TOL_ULPS)
                _timed(res, table, str(t), f"ours ({backend})", ok, note,
                       lambda x, r, d, b: conv_add_rms_norm(x, r, d, b, GS, BLOCK, w, 1e-6),
                       sets, timing, err=err, bytes_moved=moved, floor=fl, x=t)

        def unfused(x, r, d, b):
            c = grouped_dyn_conv(x, d, b, GS, BLOCK)
            fused_add_rms_norm_(c, r, w, 1e-6)
            return c
        ok, err, note = _within(unfused(x, r0.clone(), dyn, base), want, REF_TOL_ULPS)
        _timed(res, table, str(t), "conv + fused_add_rms_norm_", ok, note, unfused, sets,
               timing, err=err, bytes_moved=moved, floor=fl, x=t)


def _select(res: Results, rs, timing) -> None:
    from dflash_ops.ops.select import (row_topk, row_topk_ref, select_candidates,
                                       select_candidates_ref)
    dev, bf16 = DEVICE, torch.bfloat16
    v, k, rank, j = 248320, 16, 256, 7
    pred = torch.randn(v, rank, dtype=bf16, device=dev)
    succ = torch.randn(v, rank, dtype=bf16, device=dev)
    table = f"select_candidates J {j}, k {k}, rank {rank}, V {v} (greedy)"
    for r in rs:
        def make(r=r):
            return (torch.randn(r, j, k, dtype=bf16, device=dev),
                    torch.randint(0, v, (r, j, k), device=dev),
                    torch.randn(r, j, rank, dtype=bf16, device=dev),
                    torch.randint(0, v, (r,), device=dev))
        moved = r * j * ((k + 1) * rank * 2 + k * 10 + rank * 2)
        sets = rotating(make, r * j * (k * 10 + rank * 2))
        fl = floor_us(res.floors, moved)
        args = sets[0]
        want = select_candidates_ref(*args, pred, succ, 0.0)[0]
        for backend in ("triton", "cuda"):
            if not dispatch.has_backend("select_candidates", backend):
                continue
            with dispatch.use_backend(backend, ops=("select_candidates",)):
                same = torch.equal(select_candidates(*args, pred, succ, 0.0)[0], want)
                _timed(res, table, str(r), f"ours ({backend})", same,
                       "the reference's path" if same else "a path other than the reference's",
                       lambda *a: select_candidates(*a, pred, succ, 0.0), sets, timing,
                       bytes_moved=moved, floor=fl, x=r, same_path=same)
        res.add_time(table, str(r), "torch walk", time_fn(
            lambda *a: select_candidates_ref(*a, pred, succ, 0.0), rotate=sets, graph=True,
            **timing), bytes_moved=moved, floor=fl, x=r)
        # the top-k before the walk: ours (row_topk) vs torch.topk on the bf16 logits
        zb = r * j * v * 2
        zsets = rotating(lambda r=r: (torch.randn(r * j, v, dtype=bf16, device=dev),), zb)
        ztable = f"top-{k} of the logits [R*{j}, {v}] bf16 (before the walk)"
        z0 = zsets[0][0]
        for backend in ("triton", "cuda"):
            if not dispatch.has_backend("row_topk", backend):
                continue
            with dispatch.use_backend(backend, ops=("row_topk",)):
                same = torch.equal(row_topk(z0, k)[1], row_topk_ref(z0, k)[1])
                _timed(res, ztable, str(r), f"ours row_topk ({backend})", same,
                       "the reference's ids" if same else "ids other than the reference's",
                       lambda z: row_topk(z, k), zsets, timing, bytes_moved=zb,
                       floor=floor_us(res.floors, zb), x=r, same_ids=same)
        res.add_time(ztable, str(r), "torch.topk", time_fn(
            lambda z: torch.topk(z, k, dim=-1), rotate=zsets, graph=True, **timing),
            bytes_moved=zb, floor=floor_us(res.floors, zb), x=r)


def run(quick: bool = False) -> Results:
    import dflash_ops  # noqa: F401 - defines the ops, loads the CUDA extension

    res = Results("dflash2", floors=measure_floors())
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    with torch.no_grad():
        _conv(res, QUICK_CONV_T if quick else CONV_T, timing)
        _conv_norm(res, NORM_T, timing)
        _select(res, QUICK_SEL_R if quick else SEL_R, timing)
    res.notes += [
        "timing: median per call of CUDA-graph replays; inputs rotate over sets totalling >= 2x "
        "L2; floor = bytes read + written / this run's copy bandwidth",
        "err: max abs difference of a conv column from the torch reference (fp32 math, one "
        "rounding) on the timed inputs; timed only within 2 bf16 ulps of the output's max "
        "(ours) or 4 (the dflash eager column, which rounds each tap's products in bf16, and "
        "the unfused pair, which rounds the conv before the norm); the selector and top-k "
        "columns only with the reference's path / ids; a column that fails says WRONG, not "
        "timed",
        "inputs rotate over sets whose input bytes (not the outputs) total >= 2x L2",
    ]
    return res
