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

Environment: ``DFLASH_OPS_BENCH_ATTN_CASES`` (comma-separated ``BxS``, S a multiple of 16; e.g.
``1x131072,128x8192``) replaces the shapes of the paged table, ``DFLASH_OPS_BENCH_ATTN_TABLES``
(``paged``, ``masks``) picks tables, ``DFLASH_OPS_BENCH_ATTN_FLEX=0`` drops the Flex columns (the
compiles are most of the run time), ``DFLASH_OPS_BENCH_ATTN_HEAD_MAJOR=0`` drops the layout-test
column (our CUDA kernel on head-major copies of the caches, +4.3 GB at (128, 8192)). A
restricted run writes ``attention-<...>.md/json/png`` so
it never overwrites a full run's files. ``benchmarks/bench_attention.py --cases --tables
--no-flex`` set them.

Run time on the H200 (measured 2026-11-29: the paged table, 5 shapes, no Flex, ~40 s; the full
run with Flex, warm, 106 s): floors ~5 s; per shape ~1 s of inputs and reference, the Triton JIT of our kernel (a few s per new SPLITS / mode), ~1-3 s of timing per
column (10 columns + the floor; (128, 8192) moves 4.3 GB a call, ~1 ms at the floor, slower
columns up to ~10 ms a call x 32 a graph), and two Flex compiles (Inductor's flex decoding
template), guessed at 15-40 s each in a cold cache: ~1-1.5 minutes a shape. Full run (7 shapes
+ the masks table's 4 modes, each one more Flex compile) ~10-15 minutes cold, ~5 minutes with a
warm Inductor cache; ``--quick`` (4 shapes + masks, shorter timing) ~6-9 minutes cold.
``DFLASH_OPS_BENCH_ATTN_FLEX=0`` cuts about two thirds; under a per-job time limit, run the
tables / shapes in parts (``DFLASH_OPS_BENCH_ATTN_TABLES`` / ``_CASES``). Memory: at most ~15
GB at (128, 8192) (paged K/V 4.3 GB, their contiguous copy 4.3 GB, the transient of the gather,
a 4 GB reference chunk, graph outputs).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from .. import dispatch
from ..ops.attention import block_attention_ref
from .columns import BF16_ULP, Impl, compile_static, forced, measure, msg
from .harness import Results, floor_us, l2_bytes, measure_floors, rotating

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
QLEN = 16  # query tokens a request
BLOCK_SIZE = 16
SCALE = D ** -0.5
CASES = ((1, 1024), (1, 32768), (1, 131072), (8, 4096), (32, 4096), (64, 1024), (128, 8192))
QUICK_CASES = ((1, 1024), (1, 32768), (32, 4096), (128, 8192))
MASK_CASE = (8, 4096)
WINDOW = 1024
MODES = (("non-causal", False, -1), ("causal", True, -1), (f"window {WINDOW}", False, WINDOW),
         (f"causal + window {WINDOW}", True, WINDOW))  # (name, causal, window)
TABLES = ("paged", "masks")
TOL_ULPS = 2  # max |out - ref| <= TOL_ULPS bf16 ulps of max |ref|
REF_BUDGET = 4 << 30  # bytes of one block_attention_ref call (its fp32 per-row K/V gathers)
OP = "block_attention"
BF16 = torch.bfloat16
DEVICE = "cuda"
GRAPH = True


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rnd(*shape):
    return torch.randn(*shape, dtype=BF16, device=DEVICE)


# ----------------------------------------------------------------------------- inputs
class Case:
    """One shape: the block table, lengths and query starts shared by its input sets; each set
    ``(q, k_cache, v_cache, q_heads, q_rows, k, v)``: q [B*16, Hq, D], the paged caches
    [num_blocks, 16, Hkv, D], q as [B, Hq, 16, D] and as [B, Hkv, G*16, D] (GQA in q rows), and
    the contiguous K/V [B, Hkv, S, D] gathered from the caches (for SDPA / Flex contiguous)."""

    def __init__(self, b: int, s: int, rotate_bytes=None):
        """``rotate_bytes``: the bytes a call reads from one set; None: one set, else sets
        totalling >= 2x L2 (``harness.rotating``)."""
        self.b, self.s, self.m = b, s, s // BLOCK_SIZE
        self.nb = b * self.m
        self.block_table = torch.randperm(self.nb, device=DEVICE).view(b, self.m).to(torch.int32)
        self.seq_lens = torch.full((b,), s, dtype=torch.int32, device=DEVICE)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=DEVICE) * QLEN
        self.sets = rotating(self._make_set, rotate_bytes) if rotate_bytes else [self._make_set()]

    @property
    def kv_bytes(self) -> int:
        return 2 * self.b * self.s * HKV * D * 2

    def bytes_moved(self, keys: int) -> int:
        """K/V of ``keys`` keys a request, q and out, block table, lengths (the floor's bytes)."""
        return (2 * self.b * keys * HKV * D * 2 + 2 * self.b * QLEN * HQ * D * 2
                + self.block_table.numel() * 4 + (2 * self.b + 1) * 4)

    def _make_set(self) -> tuple:
        b, s = self.b, self.s
        q = _rnd(b * QLEN, HQ, D)
        kc, vc = _rnd(self.nb, BLOCK_SIZE, HKV, D), _rnd(self.nb, BLOCK_SIZE, HKV, D)
        bt = self.block_table.long()
        k, v = (c[bt].view(b, s, HKV, D).transpose(1, 2).contiguous() for c in (kc, vc))
        return (q, kc, vc, to_heads(q, b), to_rows(q, b), k, v)


def to_heads(q, b):
    """q [B*16, Hq, D] -> [B, Hq, 16, D] (contiguous)."""
    return q.view(b, QLEN, HQ, D).transpose(1, 2).contiguous()


def from_heads(o):
    """[B, Hq, 16, D] -> [B*16, Hq, D]."""
    return o.transpose(1, 2).reshape(-1, HQ, D)


def to_rows(q, b):
    """q [B*16, Hq, D] -> [B, Hkv, G*16, D]: row g*16 + t is token t of query head kvh*G + g."""
    return q.view(b, QLEN, HKV, G, D).permute(0, 2, 3, 1, 4).reshape(b, HKV, G * QLEN, D)


def from_rows(o):
    """[B, Hkv, G*16, D] -> [B*16, Hq, D] (the inverse of ``to_rows``)."""
    b = o.shape[0]
    return o.view(b, HKV, G, QLEN, D).permute(0, 3, 1, 2, 4).reshape(b * QLEN, HQ, D)


def visible(s: int, causal: bool, window: int) -> torch.Tensor:
    """[16, S] bool: key j visible to query t (position S - 16 + t), the op's rule."""
    pos = torch.arange(s - QLEN, s, device=DEVICE)[:, None]
    j = torch.arange(s, device=DEVICE)[None, :]
    ok = torch.ones(QLEN, s, dtype=torch.bool, device=DEVICE)
    if causal:
        ok &= j <= pos
    if window > 0:
        dist = pos - j
        ok &= (dist < window) if causal else (dist.abs() < window)
    return ok


def reference(case: Case, causal: bool = False, window: int = -1) -> torch.Tensor:
    """``block_attention_ref`` of the first set, every row, a few requests a call (within
    REF_BUDGET); a request too long for one call (non-causal, no window only) in runs of rows,
    each passed as a request of its own (its queries' outputs do not depend on their positions
    then)."""
    q, kc, vc = case.sets[0][:3]
    b, keys = case.b, case.m * BLOCK_SIZE
    rows = max(1, REF_BUDGET // (16 * keys * HKV * D))  # bf16 + fp32 K and V gathers, a copy
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    if rows >= QLEN or causal or window > 0:
        n = max(1, rows // QLEN)
        for r0 in range(0, b, n):
            r1 = min(b, r0 + n)
            t = slice(r0 * QLEN, r1 * QLEN)
            out[t] = block_attention_ref(q[t], kc, vc, case.block_table[r0:r1],
                                         case.seq_lens[r0:r1],
                                         torch.arange(r1 - r0 + 1, **i32) * QLEN, SCALE,
                                         causal, window)
        return out
    for r in range(b):
        for t0 in range(0, QLEN, rows):
            n = min(rows, QLEN - t0)
            t = slice(r * QLEN + t0, r * QLEN + t0 + n)
            out[t] = block_attention_ref(q[t], kc, vc, case.block_table[r:r + 1],
                                         case.seq_lens[r:r + 1], torch.tensor([0, n], **i32),
                                         SCALE)
    return out


def check(got, want) -> tuple:
    """(max abs error, tolerance = TOL_ULPS bf16 ulps of max |want|)."""
    got = got.reshape(want.shape).float()
    err = (got - want.float()).abs().max().item()
    return err, TOL_ULPS * BF16_ULP * want.float().abs().max().item()


# ----------------------------------------------------------------------------- columns
class Col:
    """A column: ``fn(*set)`` (timed), ``unpack(fn's output)`` -> [B*16, Hq, D] (check only),
    ``ctx()`` around both, ``missing`` why it is n/a, ``note`` what this row ran."""

    def __init__(self, name, fn, unpack=None, ctx=contextlib.nullcontext, missing=None,
                 note="", timed_note=None):
        self.name, self.fn, self.unpack, self.ctx = name, fn, unpack or (lambda o: o), ctx
        self.missing, self.note, self.timed_note = missing, note, timed_note


def ours(case: Case, backend: str, causal=False, window=-1) -> Col:
    bt, sl, qsl = case.block_table, case.seq_lens, case.qsl

    def fn(q, kc, vc, *rest):
        return torch.ops.dflash.block_attention.default(q, kc, vc, bt, sl, qsl, SCALE, causal,
                                                        window, None)

    impl = forced(OP, backend, fn, None)
    return Col(f"ours {backend}", fn, ctx=impl.ctx, missing=impl.missing)


def head_major(c: torch.Tensor) -> torch.Tensor:
    """The same cache values stored [blocks, Hkv, 16, D] (each head's 16 rows one 4 KB run),
    viewed as the op's [blocks, 16, Hkv, D] (strided)."""
    return c.transpose(1, 2).contiguous().transpose(1, 2)


def ours_head_major(case: Case, backend: str = "cuda") -> Col:
    """A layout test: our kernel on head-major copies of each set's caches. In the shipped
    layout a 64-key tile of one KV head is 64 runs of 256 bytes, 2 KB apart (the other heads'
    rows in between, read by other CTAs at other times); here it is 4 runs of 4 KB."""
    bt, sl, qsl = case.block_table, case.seq_lens, case.qsl
    copies = {id(st[1]): (head_major(st[1]), head_major(st[2])) for st in case.sets}

    def fn(q, kc, vc, *rest):
        hk, hv = copies[id(kc)]
        return torch.ops.dflash.block_attention.default(q, hk, hv, bt, sl, qsl, SCALE, False, -1,
                                                        None)

    impl = forced(OP, backend, fn, None)
    return Col(f"ours {backend}, head-major cache", fn, ctx=impl.ctx, missing=impl.missing,
               note="layout test: cache stored [blocks, Hkv, 16, D], same values")


def _sdpa_api():
    """(SDPBackend, sdpa_kernel, why missing)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return SDPBackend, sdpa_kernel, None
    except Exception as e:  # noqa: BLE001
        return None, None, f"torch.nn.attention unavailable ({msg(e)})"


SDPA_BACKENDS = (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"),
                 ("efficient", "EFFICIENT_ATTENTION"))


def sdpa(backend: str, layout: str, mask=None, name=None, note="") -> Col:
    """SDPA with only ``backend``; layout ``heads`` (q [B, Hq, 16, D], enable_gqa) or ``rows``
    (GQA in q rows); ``mask``: attn_mask (an additive tensor or a CausalBias) or None."""
    api, ctx_fn, why = _sdpa_api()
    ctx = (lambda: ctx_fn(getattr(api, dict(SDPA_BACKENDS)[backend]))) if api else \
        contextlib.nullcontext
    if layout == "heads":
        def fn(q, kc, vc, qh, qr, k, v):
            return F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=SCALE,
                                                  enable_gqa=True)
        unpack, what = from_heads, "enable_gqa"
    else:
        def fn(q, kc, vc, qh, qr, k, v):
            return F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=SCALE)
        unpack, what = from_rows, "GQA in q rows"
    return Col(name or f"sdpa {backend}, {what}", fn, unpack, ctx, missing=why, note=note)


def _flex_api():
    """(flex_attention compiled, BlockMask, why missing)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        return compile_static(flex_attention), BlockMask, None
    except Exception as e:  # noqa: BLE001
        return None, None, f"FlexAttention unavailable ({msg(e)})"


def _flex_skip():
    if os.environ.get("DFLASH_OPS_BENCH_ATTN_FLEX", "").strip() == "0":
        return "skipped (DFLASH_OPS_BENCH_ATTN_FLEX=0)"
    return None


def paged_block_mask(case: Case, causal=False, window=-1):
    """A BlockMask for q [B, Hq, 16, D] over the whole cache as [1, Hkv, num_blocks*16, D]:
    KV blocks = the cache's 16-key blocks, one Q block (128 >= 16 rows). Request b's blocks
    come from its block-table row, classified with the logical mask ``visible``: every (query,
    key) pair visible -> full (the mask_mod is skipped), some -> partial (mask_mod applied),
    none -> left out (the lists assume every request has S keys, as here). The mask_mod is
    exact by itself: the physical block's owner and rank (its index in the owner's block-table
    row) give the key's logical position."""
    from torch.nn.attention.flex_attention import BlockMask

    b, m, nb, s = case.b, case.m, case.nb, case.s
    vis = visible(s, causal, window).view(QLEN, m, BLOCK_SIZE)
    any_, all_ = vis.any(2).any(0), vis.all(2).all(0)  # [M] per logical block
    bt = case.block_table.long()
    i32 = dict(dtype=torch.int32, device=DEVICE)

    def lists(sel):
        idx = torch.sort(bt[:, sel], dim=1).values  # physical ids, ascending (as create_block_mask)
        full = torch.zeros(b, 1, 1, nb, **i32)  # padded to every KV block (its layout)
        full[..., :idx.shape[1]] = idx.view(b, 1, 1, idx.shape[1]).to(torch.int32)
        return torch.full((b, 1, 1), idx.shape[1], **i32), full

    n_part, part = lists(any_ & ~all_)
    n_full, full = lists(all_)
    owner = torch.full((nb,), -1, **i32)
    rank = torch.zeros(nb, **i32)
    owner[bt.reshape(-1)] = torch.arange(b, **i32).repeat_interleave(m)
    rank[bt.reshape(-1)] = torch.arange(m, **i32).repeat(b)
    qstart = case.seq_lens - QLEN
    seqlen = case.seq_lens

    def mask_mod(bi, h, q_idx, kv_idx):
        p = kv_idx // BLOCK_SIZE
        kpos = rank[p] * BLOCK_SIZE + kv_idx % BLOCK_SIZE
        qpos = qstart[bi] + q_idx
        ok = (owner[p] == bi) & (kpos < seqlen[bi])
        if causal:
            ok = ok & (kpos <= qpos)
        if window > 0:
            ok = ok & (qpos - kpos < window)
            if not causal:
                ok = ok & (kpos - qpos < window)
        return ok

    return BlockMask.from_kv_blocks(n_part, part, n_full, full, BLOCK_SIZE=(128, BLOCK_SIZE),
                                    mask_mod=mask_mod, seq_lengths=(QLEN, nb * BLOCK_SIZE))


def flex_paged(case: Case, causal=False, window=-1, flex=None) -> Col:
    """Compiled flex_attention on the paged cache (``paged_block_mask``); ``flex``: the
    flex_attention to call (default: compiled)."""
    name = "flex paged (compiled; BlockMask from the block table)"
    compiled, _, why = _flex_api()
    why = _flex_skip() or why
    if why:
        return Col(name, None, missing=why)
    flex = flex or compiled
    try:
        bm = paged_block_mask(case, causal, window)
    except Exception as e:  # noqa: BLE001
        return Col(name, None, missing=f"BlockMask failed: {msg(e)}")
    n = case.nb * BLOCK_SIZE

    def fn(q, kc, vc, qh, *rest):
        k = kc.view(1, n, HKV, D).transpose(1, 2)  # [1, Hkv, num_blocks*16, D], a view
        v = vc.view(1, n, HKV, D).transpose(1, 2)
        return flex(qh, k, v, block_mask=bm, scale=SCALE, enable_gqa=True)

    return Col(name, fn, from_heads, timed_note="compile")


def flex_contiguous(flex=None) -> Col:
    name = "flex contiguous (compiled; K/V [B,Hkv,S,D], no mask)"
    compiled, _, why = _flex_api()
    why = _flex_skip() or why
    if why:
        return Col(name, None, missing=why)
    flex = flex or compiled

    def fn(q, kc, vc, qh, qr, k, v):
        return flex(qh, k, v, scale=SCALE, enable_gqa=True)

    return Col(name, fn, from_heads, timed_note="compile")


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


def _paged_cols(case: Case) -> list:
    cols = [ours(case, "triton"), ours(case, "cuda")]
    if os.environ.get("DFLASH_OPS_BENCH_ATTN_HEAD_MAJOR", "1") != "0":
        cols.append(ours_head_major(case))
    for backend, _ in SDPA_BACKENDS:
        cols += [sdpa(backend, "heads"), sdpa(backend, "rows")]
    return cols + [flex_paged(case), flex_contiguous()]


def paged_table(res: Results, cases, timing: dict) -> None:
    title = (f"block_attention non-causal: {QLEN} queries/request, Hq {HQ}, Hkv {HKV}, D {D}, "
             f"paged K/V [blocks,{BLOCK_SIZE},{HKV},{D}] bf16, shuffled blocks")
    for b, s in cases:
        t0 = time.perf_counter()
        probe = 2 * b * s * HKV * D * 2
        case = Case(b, s, rotate_bytes=probe if probe <= 2 * l2_bytes() else None)
        want = reference(case)
        _sync()
        print(f"[attention] B={b} S={s}: {len(case.sets)} input set(s), K/V "
              f"{case.kv_bytes / 1e9:.3g} GB a set; inputs + reference "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        run_table(res, title, f"B={b} S={s}", case, _paged_cols(case), want, timing, keys=s,
                  flops=4.0 * b * QLEN * HQ * s * D, x=b * s)
        del case, want
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def _mask_cols(case: Case, causal: bool, window: int) -> list:
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
    return cols + [flex_paged(case, causal, window)]


def mask_table(res: Results, timing: dict) -> None:
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
        run_table(res, title, name, case, _mask_cols(case, causal, window), want, timing,
                  keys=keys[name], flops=4.0 * b * HQ * D * pairs,
                  progress=f"[attention] masks B={b} S={s}")
        del want
    del case
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- run
def _cases(quick: bool) -> list:
    env = os.environ.get("DFLASH_OPS_BENCH_ATTN_CASES", "").strip()
    if not env:
        return list(QUICK_CASES if quick else CASES)
    out = []
    for item in env.split(","):
        try:
            b, s = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"DFLASH_OPS_BENCH_ATTN_CASES: {item!r} is not BxS "
                             f"(e.g. 8x4096)") from None
        if b < 1 or s < QLEN or s % BLOCK_SIZE:
            raise ValueError(f"DFLASH_OPS_BENCH_ATTN_CASES: {item!r}: need B >= 1 and S a "
                             f"multiple of {BLOCK_SIZE}, >= {QLEN}")
        out.append((b, s))
    return out


def _tables() -> list:
    want = [t.strip() for t in os.environ.get("DFLASH_OPS_BENCH_ATTN_TABLES", "").split(",")
            if t.strip()]
    unknown = [t for t in want if t not in TABLES]
    if unknown:
        raise ValueError(f"DFLASH_OPS_BENCH_ATTN_TABLES: unknown {unknown}; tables are "
                         f"{list(TABLES)}")
    return [t for t in TABLES if t in want] if want else list(TABLES)


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
    "ours triton / cuda: torch.ops.dflash.block_attention with the backend forced",
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


def run(quick: bool = False) -> Results:
    """Measure floors, then the tables; returns the Results (the caller prints and writes)."""
    floors = measure_floors()
    cases, tables = _cases(quick), _tables()
    suffix = ""
    if os.environ.get("DFLASH_OPS_BENCH_ATTN_CASES", "").strip():
        suffix += "-" + "-".join(f"{b}x{s}" for b, s in cases)
    if len(tables) < len(TABLES):
        suffix += "-" + "-".join(tables)
    if os.environ.get("DFLASH_OPS_ATTN_STAGES"):  # the CUDA kernel's pipeline depth (csrc)
        suffix += "-stages" + os.environ["DFLASH_OPS_ATTN_STAGES"]
    res = Results("attention" + suffix, floors=floors, xlabel="B*S (keys over all requests)",
                  meta={"block_attention backends": dispatch.available_backends(OP),
                        "DFLASH_OPS_ATTN_STAGES": os.environ.get("DFLASH_OPS_ATTN_STAGES")})
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    with torch.no_grad():
        if "paged" in tables:
            paged_table(res, cases, timing)
        if "masks" in tables:
            mask_table(res, timing)
    res.notes += NOTES
    return res

