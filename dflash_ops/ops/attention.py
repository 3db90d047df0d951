"""``block_attention``: a block of query tokens per request over a paged KV cache.

Request b owns queries ``q[query_start_loc[b]:query_start_loc[b+1]]``; they are the last
``q_len_b`` positions of its sequence of ``seq_lens[b]`` keys (the block's own K/V already in
the cache), so query i sits at position ``seq_lens[b] - q_len_b + i``. Key j of request b lives
in block ``block_table[b, j // block_size]``, row ``j % block_size``.

* non-causal: every query sees keys ``[0, seq_len)``; causal: keys ``<=`` its own position;
* ``window > 0``: only keys with ``pos - j < window`` (causal) or ``|pos - j| < window``
  (non-causal); ``window <= 0``: no window;
* ``sinks[Hq]`` (fp32): a per-head logit added to the softmax denominator only;
* GQA: query head h reads KV head ``h // (Hq // Hkv)``;
* ``split_keys`` (a multiple of 64; 0: the kernels choose the split from the shapes): the keys
  are split for parallelism at absolute positions that are multiples of it, the partial results
  merged in split order, so a query row's result is bit-identical whatever else shares the call
  (other requests, the other queries of its block, 1 query or 16) for the same ``block_table``
  width: the batch-invariant attention of exact mode. It launches ceil(max_blocks * block_size /
  split_keys) splits (at most 32) and is ignored by the torch reference; the fp32 partial
  results take splits x Tq x Hq x (D + 1) x 4 bytes.

Device values are bounds-checked: a block id outside ``[0, num_blocks)`` hides its keys,
``seq_lens`` is clamped to ``max_blocks * block_size``, a query that sees no key gets zeros, and
rows past ``query_start_loc[B]`` are zeros. ``DFLASH_OPS_DEBUG=1`` raises on such values. Cache
rows no query may see (past seq_len, unreferenced blocks) never reach the output, NaN or not.
``seq_lens``, ``query_start_loc`` and ``sinks`` must be contiguous, ``block_table`` must have
unit column stride (the Triton kernel indexes them so).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from . import _checks as C
from ._samples import META, Maker, rnd, set_, strided_last, to
from .rope import HEAD_DIMS

__all__ = ["block_attention"]

_OP = "block_attention"


MAX_SPLITS = 32  # split_keys: the CUDA combine merges one split a lane of one warp
REF_CHUNK = 1 << 26  # the reference's gathered key elements a chunk of query rows


def _check_attn(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                causal=False, window=-1, sinks=None, split_keys=0, out=None, op=_OP):
    C.tensor(op, "q", q, rank=3, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    tq, hq, d = q.shape
    C.head_dim(op, "q", d, HEAD_DIMS)
    dev = q.device
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.tensor(op, name, c, rank=4, device=dev, last_contiguous=True)
        C.same_dtype(op, name, c, "q", q)
        if c.shape[3] != d:
            C.fail(op, f"{name} must be [num_blocks, block_size, Hkv, D={d}], got {list(c.shape)}")
    if v_cache.shape != k_cache.shape:
        C.fail(op, f"v_cache must have the shape of k_cache {list(k_cache.shape)}, got "
                   f"{list(v_cache.shape)}")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv != 0:
        C.fail(op, f"q's {hq} heads must be a multiple of the caches' Hkv = {hkv}")
    # The Triton kernel indexes seq_lens, query_start_loc and sinks as flat arrays and a
    # block_table row with unit column stride (any row stride).
    C.tensor(op, "block_table", block_table, rank=2, dtype=torch.int32, device=dev)
    if block_table.shape[0] > 0 and block_table.shape[1] > 1 and block_table.stride(1) != 1:
        C.fail(op, f"block_table must be contiguous in its columns (unit column stride), got "
                   f"shape {list(block_table.shape)} strides {list(block_table.stride())}")
    b = block_table.shape[0]
    C.tensor(op, "seq_lens", seq_lens, shape=(b,), dtype=torch.int32, device=dev,
             contiguous=True)
    C.tensor(op, "query_start_loc", query_start_loc, shape=(b + 1,), dtype=torch.int32,
             device=dev, contiguous=True)
    if not (0 < scale < float("inf")):
        C.fail(op, f"scale must be finite and > 0, got {scale}")
    if sinks is not None:
        C.tensor(op, "sinks", sinks, shape=(hq,), dtype=torch.float32, device=dev,
                 contiguous=True)
    if not isinstance(split_keys, int) or split_keys < 0 or split_keys % 64:
        C.fail(op, f"split_keys must be 0 or a positive multiple of 64, got {split_keys}")
    keys = block_table.shape[1] * k_cache.shape[1]
    if split_keys and -(-keys // split_keys) > MAX_SPLITS:
        C.fail(op, f"split_keys = {split_keys} splits max_blocks * block_size = {keys} keys "
                   f"{-(-keys // split_keys)} ways (at most {MAX_SPLITS})")
    if out is not None:
        C.tensor(op, "out", out, shape=tuple(q.shape), device=dev, last_contiguous=True)
        C.same_dtype(op, "out", out, "q", q)


def _debug_attn(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *rest, op=_OP,
                **unused):
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    cap = block_table.shape[1] * bs
    if bool((seq_lens < 0).any() or (seq_lens > cap).any()):
        C.fail(op, f"seq_lens must lie in [0, max_blocks * block_size = {cap}], got "
                   f"{seq_lens.tolist()}")
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or bool((q_lens < 0).any()) or int(qsl[-1]) != q.shape[0]:
        C.fail(op, f"query_start_loc must rise from 0 to Tq = {q.shape[0]}, got {qsl.tolist()}")
    if bool((q_lens > seq_lens.long()).any()):
        C.fail(op, "each request's query length must be <= its seq_len")
    n_used = (seq_lens.long() + bs - 1) // bs
    used = torch.arange(block_table.shape[1], device=q.device)[None, :] < n_used[:, None]
    ids = block_table.long()[used]
    if bool(((ids < 0) | (ids >= nb)).any()):
        C.fail(op, f"block_table holds block ids outside [0, {nb}) within seq_lens")


def block_attention_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                        causal=False, window=-1, sinks=None, split_keys=0):
    tq, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    b, m = block_table.shape
    dev = q.device
    if tq == 0 or b == 0 or m == 0 or nb == 0 or bs == 0:  # no key anywhere: zeros
        return torch.zeros_like(q)
    t = torch.arange(tq, device=dev)
    qsl = query_start_loc.long()
    req = torch.searchsorted(qsl[1:], t, right=True)  # request of each query row
    row_ok = (req < b) & (t >= qsl[0])
    req = req.clamp(max=b - 1)
    seq = seq_lens.long().clamp(0, m * bs)[req]
    q_len = (qsl[req + 1] - qsl[req])
    pos = seq - q_len + (t - qsl[req])  # [Tq]
    # The keys are gathered per query row ([rows, S, Hkv, D] in fp32, twice): rows in chunks of
    # ~2^26 gathered elements, so a long prefill (the CPU demo's) stays within memory.
    step = max(1, REF_CHUNK // (m * bs * hkv * d))
    if tq > step:
        out = torch.empty_like(q)
        for c in range(0, tq, step):
            sl = slice(c, c + step)
            out[sl] = _ref_rows(q[sl], k_cache, v_cache, block_table, req[sl], row_ok[sl],
                                seq[sl], pos[sl], scale, causal, window, sinks)
        return out
    return _ref_rows(q, k_cache, v_cache, block_table, req, row_ok, seq, pos, scale, causal,
                     window, sinks)


def _ref_rows(q, k_cache, v_cache, block_table, req, row_ok, seq, pos, scale, causal, window,
              sinks):
    """block_attention_ref's rows q [rows, Hq, D]: their request, whether a request owns them,
    their request's key count and their positions given per row."""
    tq, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    m = block_table.shape[1]
    dev = q.device
    j = torch.arange(m * bs, device=dev)
    blk = block_table.long()[req][:, j // bs]  # [Tq, S]
    key_ok = (j[None, :] < seq[:, None]) & (blk >= 0) & (blk < nb) & row_ok[:, None]
    if causal:
        key_ok &= j[None, :] <= pos[:, None]
    if window > 0:
        dist = pos[:, None] - j[None, :]
        key_ok &= (dist < window) if causal else (dist.abs() < window)
    blk = blk.clamp(0, nb - 1)
    # Select before multiplying: a key no query may see reads as 0, so NaN / inf in cache rows
    # past seq_len or in blocks the table does not reference never reaches the output.
    ok4 = key_ok[:, :, None, None]
    k = torch.where(ok4, k_cache[blk, j % bs].float(), 0.0)  # [Tq, S, Hkv, D]
    v = torch.where(ok4, v_cache[blk, j % bs].float(), 0.0)
    g = hq // hkv
    qf = q.float().view(tq, hkv, g, d)
    s = torch.einsum("tkgd,tjkd->tkgj", qf, k) * scale
    s = s.masked_fill(~key_ok[:, None, None, :], float("-inf"))
    mx = s.amax(-1)  # [Tq, Hkv, g]
    if sinks is not None:
        sk = sinks.float().view(1, hkv, g)
        mx = torch.maximum(mx, sk)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx[..., None])
    denom = p.sum(-1)
    if sinks is not None:
        denom = denom + torch.where(key_ok.any(-1)[:, None, None], torch.exp(sk - mx),
                                    torch.zeros_like(mx))
    o = torch.einsum("tkgj,tjkd->tkgd", p, v)
    o = torch.where(denom[..., None] > 0, o / denom.clamp_min(1e-30)[..., None],
                    torch.zeros_like(o))
    return o.reshape(tq, hq, d).to(q.dtype)


def _ref_out(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal=False,
             window=-1, sinks=None, split_keys=0, *, out):
    # The dispatcher drops trailing arguments equal to their schema default: keep defaults here.
    out.copy_(block_attention_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                  scale, causal, window, sinks))


_ARGS = ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
         "Tensor query_start_loc, float scale, bool causal=False, int window=-1, "
         "Tensor? sinks=None, int split_keys=0")

# Default cuda: 1.5-1.8x faster than the Triton kernel at every benchmarked shape (Hq 32, Hkv 8,
# D 128, 16 queries a request, bf16, graph replay): B x S 1 x 1024 14.7 vs 25.8 us, 1 x 131072
# 200 vs 321 us, 32 x 4096 203 vs 302 us, 128 x 8192 1517 vs 2272 us.
dispatch.define_op(
    f"block_attention({_ARGS}) -> Tensor",
    validate=_check_attn, reference=block_attention_ref,
    fake=lambda q, *a, **k: torch.empty_like(q, memory_format=torch.contiguous_format),
    default="cuda", debug_check=_debug_attn)

# Default cuda: the kernels of block_attention, writing into ``out``.
dispatch.define_op(
    f"block_attention_out_({_ARGS}, *, Tensor(a!) out) -> ()",
    validate=lambda *a, **k: _check_attn(*a, **k, op="block_attention_out_"),
    reference=_ref_out, fake=lambda *a, **k: None, default="cuda",
    debug_check=lambda *a, **k: _debug_attn(*a, op="block_attention_out_"))


def block_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                    causal: bool = False, window: int = -1, sinks: Optional[torch.Tensor] = None,
                    split_keys: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of each request's query block over its paged K/V; writes ``out`` if given."""
    if out is None:
        return torch.ops.dflash.block_attention.default(
            q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, window,
            sinks, split_keys)
    torch.ops.dflash.block_attention_out_.default(
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, window,
        sinks, split_keys, out=out)
    return out


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order: three
    requests of 3 / 1 / 4 queries over 7 / 3 / 12 keys, block size 4, 3 blocks each."""
    def attn(causal, window, with_sinks, seed, hq=4, hkv=2, shuffled=True):
        m = Maker(seed, device, dtype)
        d, nb = 64, 10
        table = torch.randperm(nb, generator=m.g)[:9].view(3, 3) if shuffled \
            else torch.arange(9).view(3, 3)
        return dict(q=m.rnd(8, hq, d), k_cache=m.rnd(nb, 4, hkv, d), v_cache=m.rnd(nb, 4, hkv, d),
                    block_table=table.to(torch.int32).to(m.device),
                    seq_lens=m.ints([7, 3, 12], torch.int32),
                    query_start_loc=m.ints([0, 3, 4, 8], torch.int32), scale=d ** -0.5,
                    causal=causal, window=window,
                    sinks=m.rnd(hq, dtype=torch.float32) if with_sinks else None)

    def with_out(kw):
        return dict(kw, out=torch.zeros_like(kw["q"]))

    return {
        _OP: {"causal-sinks": attn(True, -1, True, 21, shuffled=False),
              "noncausal": attn(False, -1, False, 22),
              "causal-split-keys-64": dict(attn(True, -1, False, 27), split_keys=64),
              "causal-window-sinks": attn(True, 3, True, 23),
              "gqa4-noncausal-window": attn(False, 2, False, 24, hq=8)},
        "block_attention_out_": {
            "causal-sinks": with_out(attn(True, -1, True, 21, shuffled=False)),
            "noncausal-sinks": with_out(attn(False, -1, True, 25)),
            # causal/window/sinks at their schema defaults: the dispatcher drops such args
            "all-defaults": with_out(attn(False, -1, False, 26))},
    }


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]: each mutation
    breaks one argument of the op's first sample case (see ``_samples``); the ``out_`` variant
    gets every case of the plain op plus its own on ``out``."""
    I32, I64, BF16 = torch.int32, torch.int64, torch.bfloat16
    attn = [
        ("q-rank2", set_(q=rnd(8, 64)), "q"),
        ("q-int", to("q", dtype=I32), "q"),
        ("q-head_dim-96", set_(q=rnd(8, 4, 96), k_cache=rnd(10, 4, 2, 96),
                               v_cache=rnd(10, 4, 2, 96)), "q"),
        ("q-last-stride", set_(q=strided_last(8, 4, 64)), "q"),
        ("k_cache-bf16", to("k_cache", dtype=BF16), "k_cache"),
        ("k_cache-D", set_(k_cache=rnd(10, 4, 2, 32)), "k_cache"),
        ("k_cache-rank3", set_(k_cache=rnd(40, 2, 64)), "k_cache"),
        ("k_cache-last-stride", set_(k_cache=strided_last(10, 4, 2, 64)), "k_cache"),
        ("k_cache-meta", to("k_cache", device=META), "k_cache"),
        ("v_cache-Hkv", set_(v_cache=rnd(10, 4, 1, 64)), "v_cache"),
        ("v_cache-num_blocks", set_(v_cache=rnd(12, 4, 2, 64)), "v_cache"),
        ("v_cache-bf16", to("v_cache", dtype=BF16), "v_cache"),
        ("Hq-not-multiple-of-Hkv", set_(q=rnd(8, 4, 64), k_cache=rnd(10, 4, 3, 64),
                                        v_cache=rnd(10, 4, 3, 64)), "q"),
        ("block_table-int64", to("block_table", dtype=I64), "block_table"),
        ("block_table-rank1", set_(block_table=lambda kw: kw["block_table"].flatten()),
         "block_table"),
        ("block_table-meta", to("block_table", device=META), "block_table"),
        ("seq_lens-len-B+1", set_(seq_lens=torch.tensor([7, 3, 12, 1], dtype=I32)), "seq_lens"),
        ("seq_lens-len-B-1", set_(seq_lens=torch.tensor([7, 3], dtype=I32)), "seq_lens"),
        ("seq_lens-int64", to("seq_lens", dtype=I64), "seq_lens"),
        ("seq_lens-meta", to("seq_lens", device=META), "seq_lens"),
        ("query_start_loc-len-B", set_(query_start_loc=torch.tensor([0, 3, 4], dtype=I32)),
         "query_start_loc"),
        ("query_start_loc-len-B+2",
         set_(query_start_loc=torch.tensor([0, 3, 4, 8, 8], dtype=I32)), "query_start_loc"),
        ("query_start_loc-int64", to("query_start_loc", dtype=I64), "query_start_loc"),
        ("query_start_loc-meta", to("query_start_loc", device=META), "query_start_loc"),
        ("scale-zero", set_(scale=0.0), "scale"),
        ("scale-negative", set_(scale=-0.125), "scale"),
        ("scale-inf", set_(scale=float("inf")), "scale"),
        ("scale-nan", set_(scale=float("nan")), "scale"),
        ("sinks-shape", set_(sinks=torch.randn(2)), "sinks"),
        ("sinks-bf16", to("sinks", dtype=BF16), "sinks"),
        ("sinks-meta", to("sinks", device=META), "sinks"),
        ("split_keys-negative", set_(split_keys=-64), "split_keys"),
        ("split_keys-not-multiple-of-64", set_(split_keys=96), "split_keys"),
    ]
    return {_OP: attn, "block_attention_out_": attn + [
        ("out-shape", set_(out=torch.zeros(8, 4, 32)), "out"),
        ("out-rank2", set_(out=torch.zeros(8, 256)), "out"),
        ("out-bf16", to("out", dtype=BF16), "out"),
        ("out-last-stride", set_(out=strided_last(8, 4, 64)), "out"),
        ("out-meta", to("out", device=META), "out"),
    ]}
