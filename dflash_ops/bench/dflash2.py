"""``dflash-ops bench dflash2``: DFlash 2's two ops at Qwen3.8-27B-DFlash2 shapes (bf16).

* ``grouped_dyn_conv`` on x [T, 5120], K 2, group size 16 (G 320), the dynamic taps a strided
  half of the [T, 2, 2, 320] projection, blocks of 8 rows: our kernels (Triton, CUDA) vs the
  ``dflash`` package's convolution run eagerly (its per-tap bf16 products) vs the floor (x,
  dynamic and y once, over this run's copy bandwidth), T 64 .. 16384 (batch x 8 rows).
* ``conv_add_rms_norm`` (the convolution after a sublayer, the residual add and the next
  RMSNorm in one kernel; the drafter runs it twice a layer) on the same shapes, T 8 .. 4096:
  our kernels (Triton, CUDA) vs the two kernels it replaces (``grouped_dyn_conv`` then
  ``fused_add_rms_norm_``, default backends) vs the floor (x, dynamic, the residual read and
  written, the output); and ``fused_add_rms_norm_`` alone (Triton, CUDA; no conv, checked
  against its own reference): the add + norm a DFlash layer runs in the op's place.
* ``select_candidates``: R requests x 7 rows, k 16, rank 256, V 248320 codebooks (the gathered
  rows are the bytes: R * 7 * (k + 1) * rank * 2 + unary/hidden): our kernels (Triton, CUDA)
  vs the walk as eager torch (the reference), R 1 .. 64.

Timing: CUDA-graph replays (``time_fn(graph=True)``), inputs rotating over > 2x L2.
"""
from __future__ import annotations

import torch

from .. import dispatch
from .columns import Impl, forced, measure
from .harness import Results, floor_us, measure_floors, rotating, time_fn

H, K, GS, BLOCK = 5120, 2, 16, 8
DEVICE = "cuda"  # (the CPU tests set "cpu")
CONV_T = (64, 512, 4096, 16384)
QUICK_CONV_T = (512, 4096)
NORM_T = (8, 64, 512, 4096)
SEL_R = (1, 8, 64)
QUICK_SEL_R = (1, 64)


def _row(res: Results, table: str, case: str, impl: Impl, sets, timing: dict, *,
         exact: bool = False, **row) -> None:
    """One column's row: ``columns.measure`` checks it against its reference on fresh copies of
    the first set (2 bf16 ulps of max |ref|; ``exact``: bit for bit), then times it, graph
    replays over ``sets``; a column that fails its check is not timed ("WRONG")."""
    t, note, err = measure(impl, sets, sets[0], timing, graph=True, exact=exact)
    res.add_time(table, case, impl.name, t, note=note, err=err, **row)


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
        fl = floor_us(res.floors, moved)
        ref = lambda x, d, b: grouped_dyn_conv_ref(x, d, b, GS, BLOCK)  # noqa: E731
        impls = [forced("grouped_dyn_conv", be,
                        lambda x, d, b: grouped_dyn_conv(x, d, b, GS, BLOCK), ref,
                        f"ours ({be})")
                 for be in ("triton", "cuda") if dispatch.has_backend("grouped_dyn_conv", be)]
        if ref_fn is not None:
            impls.append(Impl("dflash eager", lambda x, d, b: ref_fn(x, d, b).view(-1, H), ref))
        for impl in impls:
            _row(res, table, str(t), impl, sets, timing, bytes_moved=moved, floor=fl, x=t)


def _conv_norm(res: Results, ts, timing) -> None:
    from dflash_ops.ops.conv import conv_add_rms_norm, conv_add_rms_norm_ref, grouped_dyn_conv
    from dflash_ops.ops.norm import _fused_add_rms_norm_ref, fused_add_rms_norm_
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
        fl = floor_us(res.floors, moved)

        def ref(x, r, d, b):
            out = torch.empty_like(x)
            conv_add_rms_norm_ref(x, r, d, b, GS, BLOCK, w, 1e-6, out=out)
            return out

        def unfused(x, r, d, b):
            c = grouped_dyn_conv(x, d, b, GS, BLOCK)
            fused_add_rms_norm_(c, r, w, 1e-6)
            return c
        impls = [forced("conv_add_rms_norm_", be,
                        lambda x, r, d, b: conv_add_rms_norm(x, r, d, b, GS, BLOCK, w, 1e-6),
                        ref, f"ours ({be})")
                 for be in ("triton", "cuda") if dispatch.has_backend("conv_add_rms_norm_", be)]
        impls.append(Impl("conv + fused_add_rms_norm_", unfused, ref))

        def add_norm_ref(x, r, d, b):
            x, r = x.clone(), r.clone()
            _fused_add_rms_norm_ref(x, r, w, 1e-6)
            return x

        def add_norm(x, r, d, b):
            fused_add_rms_norm_(x, r, w, 1e-6)
            return x
        # what the op costs over the add + norm a DFlash layer runs in its place (no conv;
        # its own reference): the DFlash twin of the draft step runs this one
        impls += [forced("fused_add_rms_norm_", be, add_norm, add_norm_ref,
                         f"fused_add_rms_norm_ alone, no conv ({be})")
                  for be in ("triton", "cuda") if dispatch.has_backend("fused_add_rms_norm_", be)]
        for impl in impls:  # measure checks on copies: the timed calls add into the residuals
            _row(res, table, str(t), impl, sets, timing, bytes_moved=moved, floor=fl, x=t)


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
        # checked bit for bit on the path (the picked candidates)
        impls = [forced("select_candidates", be,
                        lambda *a: select_candidates(*a, pred, succ, 0.0)[0],
                        lambda *a: select_candidates_ref(*a, pred, succ, 0.0)[0], f"ours ({be})")
                 for be in ("triton", "cuda") if dispatch.has_backend("select_candidates", be)]
        for impl in impls:
            _row(res, table, str(r), impl, sets, timing, exact=True, bytes_moved=moved,
                 floor=fl, x=r)
        res.add_time(table, str(r), "torch walk", time_fn(
            lambda *a: select_candidates_ref(*a, pred, succ, 0.0), rotate=sets, graph=True,
            **timing), bytes_moved=moved, floor=fl, x=r)
        # the top-k before the walk: ours (row_topk) vs torch.topk on the bf16 logits
        zb = r * j * v * 2
        zsets = rotating(lambda r=r: (torch.randn(r * j, v, dtype=bf16, device=dev),), zb)
        ztable = f"top-{k} of the logits [R*{j}, {v}] bf16 (before the walk)"
        impls = [forced("row_topk", be, lambda z: row_topk(z, k)[1],
                        lambda z: row_topk_ref(z, k)[1], f"ours row_topk ({be})")
                 for be in ("triton", "cuda") if dispatch.has_backend("row_topk", be)]
        for impl in impls:  # checked bit for bit on the ids
            _row(res, ztable, str(r), impl, zsets, timing, exact=True, bytes_moved=zb,
                 floor=floor_us(res.floors, zb), x=r)
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
        "checks before timing (columns.measure, on copies of the first input set): the conv "
        "columns (ours, the dflash package's per-tap bf16 rounding, the unfused pair) within 2 "
        "bf16 ulps of the torch reference's max (fp32 math, one rounding), err = max abs "
        "difference; the selector's path and row_topk's ids bit for bit, err = elements that "
        "differ; a column that fails says WRONG and is not timed",
        "inputs rotate over sets whose input bytes (not the outputs) total >= 2x L2",
    ]
    return res
