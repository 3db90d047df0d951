"""Triton ``block_attention``: each request's query block over its paged K/V, split along the keys.

One program per (request b, KV head, split s). Its tile is all query tokens of the request (in
chunks of BLOCK_Q) times the GQA group G padded to a power of two GP (BLOCK_Q * GP rows: row r is
token r // GP, query head kvh * G + r % GP, masked where r % GP >= G), so each request's K/V is
read once per KV head and split. The program walks its
share of the request's visible key range in BLOCK_N-key tiles (block table lookups per key, any
cache strides), with an online softmax in the log2 domain (fp32 scores and accumulator).

The key range [lo, hi) of a query chunk comes from the device values: [0, seq_len), cut to
``<= last position`` when causal and to the window around the chunk's positions; split s takes
the s-th of SPLITS equal BLOCK_N-aligned pieces of it (empty pieces exit after marking their
partial results empty). SPLITS is chosen on the host from the SM count, B * Hkv and the cache
shape (max_blocks * block_size), never from seq_lens, so one launch replays in a CUDA graph for
any lengths. With ``split_keys`` > 0 split s takes the absolute keys [s * split_keys,
(s + 1) * split_keys) of the range instead, its tiles at absolute multiples of BLOCK_N (the
first one may start before the range: its keys are masked), and SPLITS = ceil(max_blocks *
block_size / split_keys): a row then meets the same keys in the same tiles and splits whatever
query chunk it is in (a fully masked tile leaves its sums exactly as they were), so its result
does not depend on the rest of the call.

SPLITS == 1: the program normalises and writes ``out``. Else it writes its normalised partial
output (fp32) and log-sum-exp per row, and a combine kernel (one program per (request, KV
head)) merges the splits: lse = logsumexp_s(lse_s), o = sum_s exp(lse_s - lse) o_s.
Attention sinks (per-head logits in the denominator only) are applied at the end, as
o *= 1 / (1 + exp(sink - lse)) for rows that see at least one key (rows that see none are 0).
Rows of q outside [query_start_loc[0], query_start_loc[B]) are zeroed by the first and the last
request's programs. query_start_loc may hold anything (past Tq, negative, 2^31 - 1): a
request's rows are cut to [0, Tq) and positions and windows are computed in int64, as in the
reference; seq_lens are clamped to [0, max_blocks * block_size].

Tested under TRITON_INTERPRET=1 on CPU (fp16/fp32) and on the GPU
(tests/test_block_attention_gpu.py). Measured 1.5-1.8x slower than the CUDA kernel
(benchmarks/results/attention-*-paged.md), which is the default on CUDA.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import dispatch
from ._pdl import pdl_kwargs

LOG2E = 1.4426950408889634
MAX_SPLITS = 32


@triton.jit
def _dot(a, b):
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _zero_rows(out_ptr, t_lo, t_hi, kvh, o_st_t, o_st_h, G: tl.constexpr, GP: tl.constexpr,
               D: tl.constexpr, BLOCK_Q: tl.constexpr):
    # out[t, kvh*G:(kvh+1)*G, :] = 0 for t in [t_lo, t_hi)
    r = tl.arange(0, BLOCK_Q * GP)
    d = tl.arange(0, D)
    hh = kvh * G + r % GP
    for t0 in range(t_lo, t_hi, BLOCK_Q):
        t = t0 + r // GP
        ptr = out_ptr + t.to(tl.int64)[:, None] * o_st_t + (hh * o_st_h)[:, None] + d[None, :]
        zero = tl.zeros((BLOCK_Q * GP, D), dtype=out_ptr.dtype.element_ty)
        tl.store(ptr, zero, mask=((t < t_hi) & (r % GP < G))[:, None])


@triton.jit
def _query_rows(qsl_ptr, b, Tq):
    """Request b's query rows, int64: (q0, qlen, tb, te) with q0 = query_start_loc[b], qlen =
    max(query_start_loc[b + 1] - q0, 0) (its positions are seq_len - qlen + i) and [tb, te) the
    request tokens i whose row q0 + i lies in [0, Tq): query_start_loc may hold anything."""
    q0 = tl.load(qsl_ptr + b).to(tl.int64)
    q1 = tl.load(qsl_ptr + b + 1).to(tl.int64)
    qlen = tl.maximum(q1 - q0, 0)
    tb = tl.maximum(-q0, 0)
    te = tl.minimum(qlen, Tq - q0)
    return q0, qlen, tb, te


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, qsl_ptr, sink_ptr, out_ptr, op_ptr,
                 lse_ptr, Tq, B, HKV, M, NB, BS, scale2, window, split_keys,
                 q_st_t, q_st_h, k_st_b, k_st_r, k_st_h, v_st_b, v_st_r, v_st_h, bt_st,
                 o_st_t, o_st_h, op_st_s, op_st_t, op_st_h, lse_st_s, lse_st_t,
                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_SINKS: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    q0, qlen, tb, te = _query_rows(qsl_ptr, b, Tq)
    seq = tl.minimum(tl.maximum(tl.load(sl_ptr + b), 0), M * BS)
    s64 = s.to(tl.int64)  # s * the partials' split stride may pass 2^31

    r = tl.arange(0, BLOCK_M)
    tok = (r // GP).to(tl.int64)  # qt may pass 2^31 (a huge query_start_loc)
    hh = kvh * G + r % GP
    head_ok = r % GP < G  # GP - G padding rows of a group that is not a power of two
    d = tl.arange(0, D)
    jn = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * bt_st
    for qt in range(tb, te, BLOCK_Q):
        row_ok = (qt + tok < te) & head_ok
        t = q0 + qt + tok
        q = tl.load(q_ptr + t[:, None] * q_st_t + (hh * q_st_h)[:, None] + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        # Positions in int64 (query_start_loc may hold anything); each row's visible keys
        # [klo, khi] and the chunk's key range [lo, hi) clamped into [0, seq] before int32.
        pos = seq - qlen + qt + tok
        klo = pos * 0
        khi = pos * 0 + seq - 1
        first = seq - qlen + qt  # positions of this chunk's first and last tokens
        last = seq - qlen + tl.minimum(qt + BLOCK_Q, te) - 1
        lo = first * 0
        hi = first * 0 + seq
        if CAUSAL:
            khi = tl.minimum(khi, pos)
            hi = tl.minimum(hi, last + 1)
        if window > 0:
            klo = tl.maximum(klo, pos - window + 1)
            lo = tl.maximum(lo, first - window + 1)
            if not CAUSAL:
                khi = tl.minimum(khi, pos + window - 1)
                hi = tl.minimum(hi, last + window)
        klo = tl.minimum(klo, seq).to(tl.int32)
        khi = tl.maximum(khi, -1).to(tl.int32)
        lo = tl.minimum(lo, seq).to(tl.int32)
        hi = tl.maximum(hi, 0).to(tl.int32)
        span = tl.maximum(hi - lo, 0)
        chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
        start = lo + s * chunk
        end = tl.minimum(hi, start + chunk)
        if split_keys > 0:  # absolute splits and tiles (batch-invariant)
            start = tl.maximum(s * split_keys, lo // BLOCK_N * BLOCK_N)
            end = tl.minimum(hi, (s + 1) * split_keys)

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        # the block table one tile ahead (loop-carried), so the K / V loads of a tile depend
        # on no load of their own iteration and the pipeliner can keep NUM_STAGES - 1 tiles in
        # flight (with the table read inside the loop it kept one)
        blk_next = tl.load(bt_row + (start + jn) // BS, mask=start + jn < end, other=-1)
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            j = n0 + jn
            jm = (j < end) & (j >= lo)  # below lo: a split_keys tile's lead, seen by no row
            blk = blk_next
            ahead = j + BLOCK_N
            blk_next = tl.load(bt_row + ahead // BS, mask=ahead < end, other=-1)
            ok = jm & (blk >= 0) & (blk < NB)
            blk64 = tl.where(ok, blk, 0).to(tl.int64)
            row = (j % BS).to(tl.int64)
            koff = blk64 * k_st_b + row * k_st_r + kvh * k_st_h
            voff = blk64 * v_st_b + row * v_st_r + kvh * v_st_h
            k = tl.load(k_ptr + koff[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + voff[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            sc = _dot(q, tl.trans(k)) * scale2
            vis = ok[None, :] & row_ok[:, None]
            if CAUSAL:
                vis = vis & (j[None, :] >= klo[:, None]) & (j[None, :] <= khi[:, None])
            elif window > 0:
                vis = vis & (j[None, :] >= klo[:, None]) & (j[None, :] <= khi[:, None])
            sc = tl.where(vis, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
            m_i = m_new

        seen = l_i > 0
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        if SPLITS == 1:
            if HAS_SINKS:
                sink2 = tl.load(sink_ptr + hh, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                o = o * (1.0 / (1.0 + tl.exp2(sink2 - tl.where(seen, lse2, 0.0))))[:, None]
            optr = out_ptr + t[:, None] * o_st_t + (hh * o_st_h)[:, None] + d[None, :]
            tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            pptr = (op_ptr + s64 * op_st_s + t[:, None] * op_st_t
                    + (hh * op_st_h)[:, None] + d[None, :])
            wrote = row_ok & ((start + tok * 0) < end)  # an empty split writes only its lse
            tl.store(pptr, o, mask=wrote[:, None])
            tl.store(lse_ptr + s64 * lse_st_s + t * lse_st_t + hh, lse2, mask=row_ok)

    if s == 0:  # rows no request owns: zeros
        if b == 0:
            _zero_rows(out_ptr, 0, tl.minimum(tl.maximum(q0, 0), Tq), kvh, o_st_t, o_st_h, G, GP,
                       D, BLOCK_Q)
        if b == B - 1:
            q_end = tl.load(qsl_ptr + b + 1).to(tl.int64)
            _zero_rows(out_ptr, tl.minimum(tl.maximum(q_end, 0), Tq), Tq, kvh, o_st_t, o_st_h,
                       G, GP, D, BLOCK_Q)


@triton.jit
def _combine_kernel(qsl_ptr, sink_ptr, out_ptr, op_ptr, lse_ptr, Tq, HKV, o_st_t, o_st_h, op_st_s,
                    op_st_t, op_st_h, lse_st_s, lse_st_t, G: tl.constexpr, GP: tl.constexpr,
                    D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch (_pdl.py): the prior grid ends first
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    q0, qlen, tb, te = _query_rows(qsl_ptr, b, Tq)
    r = tl.arange(0, BLOCK_M)
    hh = kvh * G + r % GP
    d = tl.arange(0, D)
    tok = (r // GP).to(tl.int64)
    head_ok = r % GP < G
    z64 = tl.zeros((), dtype=tl.int64)  # split offsets in int64: s * the split stride may pass 2^31
    for qt in range(tb, te, BLOCK_Q):
        row_ok = (qt + tok < te) & head_ok
        t = q0 + qt + tok
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        for s in range(SPLITS):
            m = tl.maximum(m, tl.load(lse_ptr + (s + z64) * lse_st_s + t * lse_st_t + hh, mask=row_ok,
                                      other=float("-inf")))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        den = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for s in range(SPLITS):
            lse = tl.load(lse_ptr + (s + z64) * lse_st_s + t * lse_st_t + hh, mask=row_ok,
                          other=float("-inf"))
            w = tl.exp2(lse - m_safe)  # 0 for an empty split
            part = tl.load(op_ptr + (s + z64) * op_st_s + t[:, None] * op_st_t + (hh * op_st_h)[:, None]
                           + d[None, :], mask=(row_ok & (lse > float("-inf")))[:, None],
                           other=0.0)
            acc += w[:, None] * part
            den += w
        seen = den > 0
        o = tl.where(seen[:, None], acc / tl.where(seen, den, 1.0)[:, None], 0.0)
        if HAS_SINKS:
            lse_tot = m_safe + tl.log2(tl.where(seen, den, 1.0))
            sink2 = tl.load(sink_ptr + hh, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            o = o * (1.0 / (1.0 + tl.exp2(sink2 - lse_tot)))[:, None]
        tl.store(out_ptr + t[:, None] * o_st_t + (hh * o_st_h)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(b: int, hkv: int, max_keys: int, device: torch.device) -> int:
    """Splits of the key range so that B * Hkv * splits fills the GPU about twice, from shapes
    only (max_keys = max_blocks * block_size bounds every seq_len): at least 256 keys a split."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    want = triton.cdiv(2 * sms, max(1, b * hkv))
    return int(max(1, min(MAX_SPLITS, want, triton.cdiv(max_keys, 256))))


def _block_q(g: int, d: int) -> int:
    # rows = BLOCK_Q * G: 64..128 rows a tile (16 tokens x GQA 4 for Qwen3); at least 16 rows
    rows = 128 if d <= 128 else 64
    return max(1, min(16, rows // g)) if g <= rows else 1


def block_attention_out_(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                         causal=False, window=-1, sinks=None, split_keys=0, *, out, splits=None,
                         block_n=None, num_stages=None, num_warps=None) -> None:
    tq, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    b, m = block_table.shape
    if tq == 0 or hq == 0:
        return
    if b == 0:
        out.zero_()
        return
    g = hq // hkv
    gp = triton.next_power_of_2(g)  # a tile's rows are BLOCK_Q * gp (padding rows masked)
    block_q = _block_q(gp, d)
    while block_q * gp < 16:  # tl.dot needs >= 16 rows
        block_q *= 2
    if split_keys:
        n_split = triton.cdiv(m * bs, split_keys)
    else:
        n_split = splits or choose_splits(b, hkv, m * bs, q.device)
    block_n = block_n or (64 if d <= 128 else 32)
    if q.dtype == torch.float32:
        block_n = min(block_n, 32)
    if n_split > 1:
        part = torch.empty((n_split, tq, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((n_split, tq, hq), dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    sink = sinks if sinks is not None else q
    _attn_kernel[(b * hkv, n_split)](
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, sink, out, part, lse,
        tq, b, hkv, m, nb, bs, float(scale) * LOG2E, window, split_keys,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        G=g, GP=gp, D=d, BLOCK_Q=block_q, BLOCK_N=block_n, SPLITS=n_split, CAUSAL=bool(causal),
        HAS_SINKS=sinks is not None, NUM_STAGES=num_stages or 2, num_warps=num_warps or 4,
        num_stages=2, **pdl_kwargs(q.device))
    if n_split > 1:
        _combine_kernel[(b * hkv,)](
            query_start_loc, sink, out, part, lse, tq, hkv, out.stride(0), out.stride(1),
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            G=g, GP=gp, D=d, BLOCK_Q=block_q, SPLITS=n_split, HAS_SINKS=sinks is not None,
            num_warps=4, **pdl_kwargs(q.device))


def block_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                    causal=False, window=-1, sinks=None, split_keys=0, **kw):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_attention_out_(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                         causal, window, sinks, split_keys, out=out, **kw)
    return out


dispatch.register_backend("block_attention", "triton", block_attention)
dispatch.register_backend("block_attention_out_", "triton", block_attention_out_)
