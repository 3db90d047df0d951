"""Attention suite: ``block_attention`` (16 query tokens a request over a paged KV cache), our
backends against PyTorch SDPA (each backend separately), FlexAttention and the bytes floor.

Shapes: Hq 32, Hkv 8 (GQA 4), D 128, 16 query tokens a request (the last 16 positions of its
sequence), bf16, scale D**-0.5. (B requests, S keys each): (1, 1024), (1, 32768), (1, 131072),
(8, 4096), (32, 4096), (64, 1024), (128, 8192); ``--quick``: (1, 1024), (1, 32768), (32, 4096),
(128, 8192). K and V caches [num_blocks, 16, Hkv, D] (block_size 16, num_blocks = B * S/16, every
block used), the block table a random permutation of all blocks (each request's blocks shuffled
through the cache), seq_lens = S, query_start_loc = 16 b. Inputs randn (q, K, V).

Tables:
* ``paged`` (non-causal; the rows of one shape per block), columns:
  - ``ours triton`` / ``ours cuda``: ``torch.ops.dflash.block_attention`` with that backend forced
    (``columns.forced``); n/a with the reason when the backend lacks the op.
  - ``sdpa <flash|cudnn|efficient> ...``: ``F.scaled_dot_product_attention`` under
    ``sdpa_kernel(<that backend>)`` only, on contiguous K/V [B, Hkv, S, D] gathered from the cache
    before timing (the gather is not timed: SDPA's best case, a cache it cannot read), no mask.
    Two GQA layouts each: ``enable_gqa`` (q [B, Hq, 16, D]; torch documents GQA for flash and
    math only) and ``GQA in q rows`` (the 4 query heads of a KV head stacked as 64 query rows,
    q [B, Hkv, 4*16, D]: exact for non-causal attention without a mask, reads K/V once per KV
    head and fills a 64-row tile, so every backend can run it; the output is unstacked for the
    check, outside the timed call). ``repeat_interleave`` of K/V (4x the bytes) is not run: the
    q-rows layout dominates it. A backend that refuses a layout is n/a with its error and the
    first reasons torch warns.
  - ``flex paged``: ``flex_attention`` under ``torch.compile`` (default mode, dynamic=False, one
    compile per shape) on the cache itself: K/V viewed as [1, Hkv, num_blocks*16, D] (stride
    views, batch broadcast over the B requests of q [B, Hq, 16, D], enable_gqa), and a BlockMask
    built directly from the block table (``BlockMask.from_kv_blocks``, KV block = the cache's
    16-key block, one Q block): request b's "full" blocks are its own physical blocks, so the
    kernel walks exactly its blocks and never evaluates the mask_mod (which is still exact:
    owner table [num_blocks] + rank of the block in its request, used for partial blocks, i.e.
    by the masked modes). The cost of paging in Flex is the 16-key KV tile this forces (flex
    needs BLOCK_N | KV block size), not masking. Its note gives the compile + first-call time.
  - ``flex contiguous``: compiled ``flex_attention`` on the contiguous K/V of the SDPA columns,
    no block mask (Flex's own best case).
  - ``floor`` = bytes / copy bandwidth of this run (``measure_floors``): bytes = K and V of every
    key once, 2 * B * S * Hkv * D * 2, + q and out, 2 * B * 16 * Hq * D * 2, + the block table,
    B * S/16 * 4, + seq_lens and query_start_loc. The floor row's note gives FLOPs
    (4 * B * 16 * Hq * S * D) over the bf16 GEMM rate: about 0.4x the bytes floor, so these
    shapes are bandwidth-bound for a kernel whose tiles are full (64-row GQA-packed tiles).
* ``dflash2`` (asked for by name), the paged cases with DFlash 2's attention: 8 queries a request
  (its block), a sliding window of 2048 non-causal (Qwen3.8-27B-DFlash2); ours triton / cuda /
  cuda mma only; the floor counts the keys some query sees (about 2055 a request); the reference
  drops the blocks before the window (positions shifted alike: the same outputs).
* ``masks``, one shape (B 8, S 4096), rows per mode: non-causal, causal, window 1024
  (non-causal: |pos - j| < 1024), causal + window 1024; columns ours triton / cuda (the op's
  ``causal`` / ``window``), sdpa flash (non-causal: GQA in q rows; causal:
  ``causal_lower_right(16, S)`` with enable_gqa, since SDPA's ``is_causal`` aligns the mask
  top-left: with 16 queries over S keys query i would see keys 0..i, not 0..S-16+i; windows:
  n/a, SDPA's flash takes no mask and has no window), sdpa efficient / cudnn (GQA in q rows with
  an explicit additive bf16 mask [1, 1, 64, S] (0 / -inf, the 16-row pattern once per stacked
  head), which they read for every key: they pay all S keys), flex paged (the BlockMask from the
  block table, blocks classified full / partial from the mode's logical mask, the mask_mod
  evaluated in partial blocks), and the floor of the visible keys only (the union over a
  request's 16 queries: window 1024 -> 1039 keys).

Checks, before timing, on the benchmark's own inputs (the first input set): every output row of
every request against ``block_attention_ref`` (fp32 math, rounded to bf16), run a few requests
at a time within ~4 GB (it gathers K/V per query row as fp32: ~16 KB per row and key); where a
single request does not fit (S >= 32768) and the mode is non-causal without window, a run of
rows of one request is passed as a request of its own (same keys, same output: without causal
or window a query's output does not depend on its position). A column is timed only if
max |out - ref| <= 2 bf16 ulps of max |ref| (no floor at 1.0: outputs shrink like S**-0.5 with
random inputs); ``err`` is that max error. Blind spot: with random inputs attention is nearly
uniform, so a kernel dropping a few of 131072 keys stays within tolerance; layout, head, GQA,
split-combine and scale errors do not (the GPU tests cover the edge cases).

Timing: CUDA-graph replay (``harness.time_fn(graph=True)``, >= 32 calls a graph, per-call
median), events where capture fails (said in the note). Inputs rotate over sets totalling >= 2x
L2 only where one set's K/V is below that (B=1 S=1024; the masks table, whose window modes
read ~35 MB); larger K/V stream from HBM anyway and use one set.

Options (``dflash-ops bench attention ...`` or ``benchmarks/bench_attention.py``): ``--cases``
(comma-separated ``BxS``, S a multiple of 16; e.g. ``1x131072,128x8192``) replaces the shapes of
the paged table, ``--tables`` (``paged``, ``masks``, ``configs``: the Triton kernel's launch
configurations on the paged cases, only when named) picks tables, ``--no-flex`` drops the Flex
columns (the compiles are most of the run time). A restricted run (``--cases`` or ``--tables``)
writes ``attention-<cases>-<tables>.md/json/png``, so it never overwrites a full run's files.

Run time on the H200: the paged table, 5 shapes, no Flex, ~40 s; the full run with Flex and a
warm Inductor cache ~2 minutes. Per shape ~1 s of inputs and reference, the Triton JIT of our
kernel (a few s per new split count / mode), ~1-3 s of timing per column ((128, 8192) moves 4.3
GB a call, ~1 ms at the floor, slower columns up to ~10 ms a call x 32 a graph), and two Flex
compiles (Inductor's flex decoding template), 15-40 s each in a cold cache. Full run cold ~10-15
minutes, ``--quick`` (4 shapes + masks, shorter timing) ~6-9 minutes cold; ``--no-flex`` cuts
about two thirds; under a per-job time limit, run the tables / shapes in parts. Memory: at most
~15 GB at (128, 8192) (paged K/V 4.3 GB, their contiguous copy 4.3 GB, the transient of the
gather, a 4 GB reference chunk, graph outputs).
"""
from __future__ import annotations

import sys
import time
import warnings

import torch

from .. import dispatch
from .attention_columns import (BF16, BLOCK_SIZE, D, DEVICE, G, HKV, HQ, OP, QLEN, SDPA_BACKENDS,
                                TOL_ULPS, Case, Col, check, flex_contiguous, flex_paged, ours,
                                ours_triton_config, query_length,
                                reference, sdpa, visible)
from .columns import BF16_ULP, Impl, measure, msg
from .harness import Results, bxs_cases, floor_us, l2_bytes, measure_floors, name_list

CASES = ((1, 1024), (1, 32768), (1, 131072), (8, 4096), (32, 4096), (64, 1024), (128, 8192))
QUICK_CASES = ((1, 1024), (1, 32768), (32, 4096), (128, 8192))
MASK_CASE = (8, 4096)
WINDOW = 1024
MODES = (("non-causal", False, -1), ("causal", True, -1), (f"window {WINDOW}", False, WINDOW),
         (f"causal + window {WINDOW}", True, WINDOW))  # (name, causal, window)
TABLES = ("paged", "masks", "configs", "dflash2", "splits")
# the splits table: the CUDA kernel at fixed key-split counts (split_keys = S / n, whole tiles)
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)
# the dflash2 table: DFlash 2's attention (Qwen3.8-27B-DFlash2: block 8, sliding window 2048,
# non-causal) on the paged cases
DFLASH2_QLEN, DFLASH2_WINDOW = 8, 2048
# the configs table: the Triton kernel's launch configurations (K/V tile, pipeline stages of
# K/V tiles, warps[, key splits]) on the paged cases, beside ours cuda; 2 stages of 64 keys,
# 4 warps, splits from the shapes is the default (measured 2026-11-29); the others fit the
# H200's 227 KB of shared memory at D 128; fixed splits 1 / 16 probe the short-context cost
TRITON_CONFIGS = ((64, 2, 4), (64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4), (64, 3, 8),
                  (128, 2, 8), (64, 3, 4, 1), (64, 3, 4, 16))
GRAPH = True


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- measuring
def _failure(e: BaseException, caught) -> str:
    """``failed: <error>`` plus the first reasons torch warned (SDPA warns a header "<backend>
    kernel not used because:", then one warning a reason)."""
    why = []
    for w in caught:
        line = (str(w.message).strip().splitlines() or [""])[0][:120]
        if issubclass(w.category, UserWarning) and line and not line.endswith("because:") \
                and line not in why:
            why.append(line)
    return "; ".join([f"failed: {msg(e)}", *why[:3]])


def run_col(col: Col, case: Case, want, timing: dict) -> tuple:
    """(time_fn dict or None, note, err): one call on the first set checked against ``want``,
    then timed over the sets (``columns.measure``: graph replay, events if capture fails)."""
    if col.missing:
        return None, col.missing, None
    note = col.note
    with col.ctx(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t0 = time.perf_counter()
            got = col.unpack(col.fn(*case.sets[0]))
            _sync()
            first_s = time.perf_counter() - t0
            err, tol = check(got, want)
            del got
        except Exception as e:  # noqa: BLE001 - a broken column is reported, not fatal
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            return None, "; ".join(x for x in (note, _failure(e, caught)) if x), None
    if not err <= tol:
        return None, "; ".join(x for x in (note, f"WRONG: max abs err {err:.3g} > tol "
                                                 f"{tol:.3g}; not timed") if x), err
    if col.timed_note == "compile":
        note = "; ".join(x for x in (note, f"compile + first call {first_s:.1f} s") if x)
    tm, how, _ = measure(Impl(col.name, col.fn, None, col.ctx), case.sets, (), timing,
                         graph=GRAPH)
    return tm, "; ".join(x for x in (note, how) if x), err


def run_table(res: Results, title: str, label: str, case: Case, cols, want, timing: dict, *,
              keys: int, flops: float, x=None, progress: str = "[attention]") -> None:
    """Rows of one case (``label``): every column checked and timed, then the floor row."""
    moved = case.bytes_moved(keys)
    floor = floor_us(res.floors, moved)
    for col in cols:
        tm, note, err = run_col(col, case, want, timing)
        res.add_time(title, label, col.name, tm, bytes_moved=moved, floor=floor, err=err,
                     note=note, x=x)
        us = f"{tm['us']:.2f} us ({tm['mode']})" if tm else "n/a"
        print(f"{progress} {label} {col.name}: {us} {note}", file=sys.stderr, flush=True)
    t_flop = flops / (res.floors["gemm_TFLOPs"] * 1e6) if res.floors.get("gemm_TFLOPs") else None
    tol = TOL_ULPS * BF16_ULP * want.float().abs().max().item()
    fl = f"FLOPs {flops:.3g} at the GEMM rate: {t_flop:.1f} us; " if t_flop else ""
    res.add_time(title, label, "floor", {"us": floor, "mode": "bytes/copy"}, bytes_moved=moved,
                 floor=floor, x=x, note=f"{fl}check tol {tol:.2g}")


def _paged_cols(case: Case, flex_skip) -> list:
    cols = [ours(case, "triton"), ours(case, "cuda"), ours(case, "cuda", kernel="mma"),
            ours(case, "cuda", head_major=True)]
    for backend, _ in SDPA_BACKENDS:
        cols += [sdpa(backend, "heads"), sdpa(backend, "rows")]
    return cols + [flex_paged(case, skip=flex_skip), flex_contiguous(flex_skip)]


def _case_rows(res: Results, title: str, cases, cols_of, timing: dict,
               progress: str = "[attention]", window: int = -1) -> None:
    """For each (B, S) of ``cases``: the paged inputs and reference, then ``cols_of(case)``'s
    columns checked and timed (``run_table``); ``window`` (non-causal): the floor and FLOPs
    count the visible keys only."""
    for b, s in cases:
        t0 = time.perf_counter()
        vis = visible(s, False, window)
        keys, pairs = int(vis.any(0).sum()), int(vis.sum())
        probe = 2 * b * keys * HKV * D * 2
        case = Case(b, s, rotate_bytes=probe if probe <= 2 * l2_bytes() else None)
        want = reference(case, False, window)
        _sync()
        print(f"{progress} B={b} S={s}: {len(case.sets)} input set(s), K/V "
              f"{case.kv_bytes / 1e9:.3g} GB a set; inputs + reference "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        run_table(res, title, f"B={b} S={s}", case, cols_of(case), want, timing,
                  keys=keys, flops=4.0 * b * HQ * D * pairs, x=b * s, progress=progress)
        del case, want
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def paged_table(res: Results, cases, timing: dict, flex_skip=None) -> None:
    title = (f"block_attention non-causal: {QLEN} queries/request, Hq {HQ}, Hkv {HKV}, D {D}, "
             f"paged K/V [blocks,{BLOCK_SIZE},{HKV},{D}] bf16, shuffled blocks")
    _case_rows(res, title, cases, lambda case: _paged_cols(case, flex_skip), timing)


def dflash2_table(res: Results, cases, timing: dict) -> None:
    """DFlash 2's drafter attention: DFLASH2_QLEN queries a request, sliding window
    DFLASH2_WINDOW non-causal; ours only (SDPA's flash has no window, and its masked backends
    read every key: the masks table shows them at one shape)."""
    w = DFLASH2_WINDOW
    with query_length(DFLASH2_QLEN):
        title = (f"block_attention DFlash 2: {QLEN} queries/request, window {w} non-causal, Hq "
                 f"{HQ}, Hkv {HKV}, D {D}, paged K/V [blocks,{BLOCK_SIZE},{HKV},{D}] bf16")
        _case_rows(res, title, cases,
                   lambda case: [ours(case, "triton", False, w), ours(case, "cuda", False, w),
                                 ours(case, "cuda", False, w, kernel="mma")],
                   timing, progress="[attention dflash2]", window=w)


def splits_table(res: Results, cases, timing: dict) -> None:
    """The CUDA kernel (its automatic choice, then fixed split counts) on the paged cases: how
    many key splits each shape wants (a split count that gives fewer keys than one 64-key tile
    a split, or more than 32 splits, is left out)."""
    title = (f"block_attention CUDA key splits: {QLEN} queries/request, Hq {HQ}, Hkv {HKV}, "
             f"D {D}, paged K/V bf16 (split_keys = S / splits in whole 64-key tiles)")

    def cols(case):
        ns = [n for n in SPLIT_COUNTS if case.s // n >= 64]
        return [ours(case, "cuda")] + [ours(case, "cuda", splits=n) for n in ns]
    _case_rows(res, title, cases, cols, timing, progress="[attention splits]")


def configs_table(res: Results, cases, timing: dict) -> None:
    title = (f"block_attention Triton launch configurations: {QLEN} queries/request, Hq {HQ}, "
             f"Hkv {HKV}, D {D}, paged K/V bf16 (rows: BN keys a tile, K/V stages, warps)")
    _case_rows(res, title, cases,
               lambda case: [ours(case, "cuda")] + [ours_triton_config(case, *c)
                                                    for c in TRITON_CONFIGS],
               timing, progress="[attention configs]")


def _mask_cols(case: Case, causal: bool, window: int, flex_skip) -> list:
    cols = [ours(case, "triton", causal, window), ours(case, "cuda", causal, window)]
    s = case.s
    if not causal and window <= 0:
        cols += [sdpa(bk, "rows", name=f"sdpa {bk}", note="GQA in q rows, no mask")
                 for bk, _ in SDPA_BACKENDS]
    else:
        if causal and window <= 0:
            try:
                from torch.nn.attention.bias import causal_lower_right
                cols.append(sdpa("flash", "heads", mask=causal_lower_right(QLEN, s),
                                 name="sdpa flash",
                                 note=f"enable_gqa, causal_lower_right({QLEN}, {s})"))
            except Exception as e:  # noqa: BLE001
                cols.append(Col("sdpa flash", None, missing=f"causal_lower_right: {msg(e)}"))
        else:
            cols.append(Col("sdpa flash", None,
                            missing="SDPA's flash backend takes no mask and has no window"))
        vis = visible(s, causal, window).repeat(G, 1)  # row g*16 + t: query t's pattern
        bias = torch.zeros(1, 1, G * QLEN, s, dtype=BF16, device=DEVICE)
        bias.masked_fill_(~vis, float("-inf"))
        for bk in ("efficient", "cudnn"):
            cols.append(sdpa(bk, "rows", mask=bias, name=f"sdpa {bk}",
                             note=f"GQA in q rows, additive bf16 mask [1,1,{G * QLEN},{s}]"))
    return cols + [flex_paged(case, causal, window, flex_skip)]


def mask_table(res: Results, timing: dict, flex_skip=None) -> None:
    b, s = MASK_CASE
    title = (f"block_attention masks, B={b} S={s}: {QLEN} queries at the end of each sequence, "
             f"Hq {HQ}, Hkv {HKV}, D {D}, paged bf16")
    t0 = time.perf_counter()
    keys = {name: int(visible(s, c, w).any(0).sum()) for name, c, w in MODES}
    # rotate by the fewest bytes a mode reads (the windows: ~1039 keys of 4096)
    case = Case(b, s, rotate_bytes=2 * b * min(keys.values()) * HKV * D * 2)
    print(f"[attention] masks B={b} S={s}: {len(case.sets)} input sets, inputs "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    for name, causal, window in MODES:
        want = reference(case, causal, window)
        pairs = int(visible(s, causal, window).sum())
        run_table(res, title, name, case, _mask_cols(case, causal, window, flex_skip), want,
                  timing, keys=keys[name], flops=4.0 * b * HQ * D * pairs,
                  progress=f"[attention] masks B={b} S={s}")
        del want
    del case
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- run
def _cases(text: str) -> list:
    """``--cases``: comma-separated BxS, S a multiple of the block size."""
    return bxs_cases(text, lambda b, s: None if b >= 1 and s >= QLEN and s % BLOCK_SIZE == 0
                     else f"B >= 1 and S a multiple of {BLOCK_SIZE}, >= {QLEN}")


def add_options(p) -> None:
    p.add_argument("--cases", type=_cases, default=None, metavar="BxS,...",
                   help="shapes of the paged table (B requests x S keys, e.g. 1x131072,128x8192)"
                        "; default: all shapes (--quick: fewer)")
    p.add_argument("--tables", type=name_list(TABLES, "tables"), default=None,
                   metavar="T1,T2",
                   help=f"tables to run, of {', '.join(TABLES)} (default paged,masks; "
                        "configs: the Triton kernel's launch configurations on the paged cases; "
                        "dflash2: block 8, window 2048 on the paged cases; splits: the CUDA kernel at "
                        "fixed key-split counts)")
    p.add_argument("--no-flex", dest="flex", action="store_false",
                   help="no FlexAttention columns (their torch.compile calls are most of the "
                        "run time)")


NOTES = [
    "timing: median per call of CUDA-graph replays (>= 32 calls a graph); do_bench events "
    "only where capture fails (said in the note); inputs rotate over sets totalling >= 2x L2 "
    "where one set's K/V is smaller (B=1 S=1024; the masks table), else one set (K/V > 2x L2 "
    "streams from HBM)",
    "inputs: q, K, V randn bf16; caches [num_blocks, 16, 8, 128], num_blocks = B*S/16, the "
    "block table a random permutation of all blocks; seq_lens = S; 16 queries a request, the "
    "last 16 positions of its sequence; scale D**-0.5",
    "check (before timing, first input set): every output row against block_attention_ref "
    "(fp32 math, bf16 out), computed a few requests at a time (long non-causal requests in "
    "runs of rows passed as requests of their own: same keys, same outputs); timed only if "
    "max |out - ref| <= 2 bf16 ulps of max |ref| (tol in the floor row's note); err = that "
    "max error. Catches layout / head / GQA / combine / scale errors, not a few dropped keys "
    "at large S (near-uniform attention on random inputs)",
    "floor = bytes / copy bandwidth of this run; bytes = K and V of the visible keys once "
    "(2*B*keys*Hkv*D*2; keys = S, or the union over a request's queries in the masks table) "
    "+ q and out (2*B*16*Hq*D*2) + block table (B*S/16*4) + lengths; x floor = us / floor; "
    "the floor row's note gives FLOPs (4*B*16*Hq*keys*D, masks: per visible pair) at the "
    "bf16 GEMM rate of this run",
    "ours triton / cuda: torch.ops.dflash.block_attention with the backend forced; cuda: "
    "its automatic kernel choice (the sm_90a TMA + wgmma kernel on an H100 / H200), cuda mma: "
    "the portable mma.sync kernel (DFLASH_OPS_ATTN_KERNEL=mma); head-major K|V: the same "
    "values in vLLM's newest cache layout [blocks, Hkv, 16, 2*D], K and V side by side, "
    "passed as strided views",
    "sdpa <backend>: F.scaled_dot_product_attention under sdpa_kernel(that backend only) on "
    "contiguous K/V [B, Hkv, S, D] gathered from the cache before timing (not timed: SDPA's "
    "best case); 'enable_gqa': q [B, Hq, 16, D] (torch documents GQA for flash and math "
    "only); 'GQA in q rows': q [B, Hkv, 4*16, D], the 4 query heads of a KV head as 64 query "
    "rows (exact without causal masking; K/V read once per KV head; unstacked for the check, "
    "not in the timed call); repeat_interleave (4x the K/V bytes) not run, the q-rows layout "
    "dominates it; n/a rows carry SDPA's error and the first reasons it warned",
    "flex paged: torch.compile(flex_attention) (default mode, dynamic=False, one compile a "
    "shape / mode) on the cache viewed as [1, Hkv, num_blocks*16, D] (K/V batch broadcast over "
    "q [B, Hq, 16, D], enable_gqa) with a BlockMask made from the block table "
    "(BlockMask.from_kv_blocks; KV block = the cache block, 16 keys): each request walks only "
    "its own blocks; non-causal blocks are all 'full', so the mask_mod (owner table + rank of "
    "the block in its request) is not evaluated; partial blocks (causal / window edges) "
    "evaluate it. Paging costs Flex its KV tile: BLOCK_N must divide the 16-key block. flex "
    "contiguous: the same compiled flex_attention on the SDPA columns' contiguous K/V, no "
    "mask. Their notes give compile + first-call seconds",
    "masks table: SDPA's is_causal aligns the causal mask top-left (query i of 16 would see "
    "keys 0..i), so causal rows use causal_lower_right(16, S) (flash, enable_gqa); SDPA has "
    "no window: efficient / cudnn take an explicit additive mask (0 / -inf) on the q-rows "
    "layout and read every key, flash is n/a for windows; window W non-causal = |pos - j| < W "
    "(the op's rule); floor: the visible keys only",
]


def run(quick: bool = False, cases=None, tables=None, flex: bool = True) -> Results:
    """Measure floors, then the tables; returns the Results (the caller prints and writes).
    ``cases``: (B, S) shapes of the paged table (default CASES, QUICK_CASES with ``quick``);
    ``tables``: names of TABLES (default paged and masks); ``flex``: run the FlexAttention
    columns."""
    floors = measure_floors()
    tables = tables or ["paged", "masks"]  # configs: asked for by name
    suffix = "-" + "-".join(f"{b}x{s}" for b, s in cases) if cases else ""
    if set(tables) != {"paged", "masks"}:
        suffix += "-" + "-".join(tables)
    cases = cases or list(QUICK_CASES if quick else CASES)
    flex_skip = None if flex else "skipped (--no-flex)"
    res = Results("attention" + suffix, floors=floors, xlabel="B*S (keys over all requests)",
                  meta={"block_attention backends": dispatch.available_backends(OP),
                        "block_attention default": dispatch.resolve(OP)})
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    with torch.no_grad():
        if "paged" in tables:
            paged_table(res, cases, timing, flex_skip)
        if "masks" in tables:
            mask_table(res, timing, flex_skip)
        if "configs" in tables:
            configs_table(res, cases, timing)
        if "dflash2" in tables:
            dflash2_table(res, cases, timing)
        if "splits" in tables:
            splits_table(res, cases, timing)
    res.notes += NOTES
    return res
