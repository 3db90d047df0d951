"""Inputs and columns of the attention suite (``bench.attention``).

``Case``: one (B, S) shape, its paged caches (each request's blocks shuffled through the cache)
and, per input set, q in the op's layout and in SDPA's two GQA layouts plus the contiguous K/V
gathered from the cache. ``reference``: ``block_attention_ref`` of every output row, a few
requests a call. ``Col``: one column (our op with a backend forced, SDPA with one backend,
FlexAttention paged or contiguous); see ``bench.attention`` for what each column runs.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from ..ops.attention import block_attention_ref
from .columns import BF16_ULP, compile_static, forced, msg
from .harness import rotating

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
QLEN = 16  # query tokens a request (bench attention --qlen sets it for a run: query_length)
BLOCK_SIZE = 16
SCALE = D ** -0.5
TOL_ULPS = 2  # max |out - ref| <= TOL_ULPS bf16 ulps of max |ref|
REF_BUDGET = 4 << 30  # bytes of one block_attention_ref call (its fp32 per-row K/V gathers)
OP = "block_attention"
BF16 = torch.bfloat16
DEVICE = "cuda"


@contextlib.contextmanager
def query_length(n: int):
    """QLEN = ``n`` inside, in this module and in ``bench.attention`` (which imported it)."""
    from . import attention as suite
    old = QLEN
    globals()["QLEN"] = suite.QLEN = n
    try:
        yield
    finally:
        globals()["QLEN"] = suite.QLEN = old


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
    """[QLEN, S] bool: key j visible to query t (position S - QLEN + t), the op's rule."""
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
    table, seq_lens = case.block_table, case.seq_lens
    if window > 0:  # only the window's keys: drop whole blocks before the first query's window
        # (the rule depends on position differences only, so shifting every position by the
        # dropped keys leaves each output as it was)
        drop = max(0, case.s - QLEN - window + 1) // BLOCK_SIZE
        table, seq_lens = table[:, drop:], seq_lens - drop * BLOCK_SIZE
        keys -= drop * BLOCK_SIZE
    rows = max(1, REF_BUDGET // (16 * keys * HKV * D))  # bf16 + fp32 K and V gathers, a copy
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    if rows >= QLEN or causal or window > 0:
        n = max(1, rows // QLEN)
        for r0 in range(0, b, n):
            r1 = min(b, r0 + n)
            t = slice(r0 * QLEN, r1 * QLEN)
            out[t] = block_attention_ref(q[t], kc, vc, table[r0:r1], seq_lens[r0:r1],
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


@contextlib.contextmanager
def attn_kernel(name):
    """DFLASH_OPS_ATTN_KERNEL = ``name`` inside (the CUDA backend's kernel choice); None: as
    it is."""
    old = os.environ.get("DFLASH_OPS_ATTN_KERNEL")
    if name is not None:
        os.environ["DFLASH_OPS_ATTN_KERNEL"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DFLASH_OPS_ATTN_KERNEL", None)
        else:
            os.environ["DFLASH_OPS_ATTN_KERNEL"] = old


def head_major_kv(kc, vc):
    """The caches' values in vLLM's newest layout, [num_blocks, Hkv, block_size, 2*D] with K
    and V side by side, returned as the op's [num_blocks, block_size, Hkv, D] strided views."""
    nb, bs, hkv, d = kc.shape
    kv = torch.empty(nb, hkv, bs, 2 * d, dtype=kc.dtype, device=kc.device)
    kv[..., :d] = kc.transpose(1, 2)
    kv[..., d:] = vc.transpose(1, 2)
    return kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)


def ours(case: Case, backend: str, causal=False, window=-1, kernel=None,
         head_major=False, splits=None) -> Col:
    """Our op with ``backend`` forced; ``kernel``: the CUDA kernel (DFLASH_OPS_ATTN_KERNEL:
    mma, wgmma); ``head_major``: on copies of the caches in vLLM's K|V side-by-side layout
    (made here, one per input set); ``splits``: ask for that many key splits (split_keys =
    S / splits rounded up to 64 keys; None: the kernels' own choice)."""
    per = -(-case.s // splits) if splits else 0  # keys a split, then whole 64-key tiles
    split_keys = -(-per // 64) * 64
    bt, sl, qsl = case.block_table, case.seq_lens, case.qsl
    views = {}
    if head_major:
        for st in case.sets:
            views[st[1].data_ptr()] = head_major_kv(st[1], st[2])

    def fn(q, kc, vc, *rest):
        if head_major:
            kc, vc = views[kc.data_ptr()]
        return torch.ops.dflash.block_attention.default(q, kc, vc, bt, sl, qsl, SCALE, causal,
                                                        window, None, split_keys)

    impl = forced(OP, backend, fn, None)

    @contextlib.contextmanager
    def ctx():
        with impl.ctx(), attn_kernel(kernel):
            yield

    name = f"ours {backend}" + (f" {kernel}" if kernel else "") + \
        (" head-major K|V" if head_major else "") + \
        (f" splits {splits}" if splits is not None else "")
    return Col(name, fn, ctx=ctx, missing=impl.missing)


def ours_triton_config(case: Case, block_n: int, num_stages: int, num_warps: int,
                       splits=None) -> Col:
    """The Triton kernel with one launch configuration (K/V tile, pipeline stages, warps, key
    splits: None = its own choice from the shapes), called directly: the configs table of
    bench attention."""
    bt, sl, qsl = case.block_table, case.seq_lens, case.qsl

    def fn(q, kc, vc, *rest):
        from ..triton.attention import block_attention
        return block_attention(q, kc, vc, bt, sl, qsl, SCALE, False, -1, None, block_n=block_n,
                               num_stages=num_stages, num_warps=num_warps, splits=splits)

    name = f"triton BN {block_n} stages {num_stages} warps {num_warps}"
    return Col(name + (f" splits {splits}" if splits else ""), fn)


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


def _flex(skip=None):
    """(compiled flex_attention or None, why it is n/a): ``skip``, a reason to leave Flex out."""
    if skip:
        return None, skip
    try:
        from torch.nn.attention.flex_attention import flex_attention
        return compile_static(flex_attention), None
    except Exception as e:  # noqa: BLE001
        return None, f"FlexAttention unavailable ({msg(e)})"


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


def flex_paged(case: Case, causal=False, window=-1, skip=None) -> Col:
    """Compiled flex_attention on the paged cache (``paged_block_mask``); ``skip``: why the
    column is left out (n/a), None: it runs."""
    name = "flex paged (compiled; BlockMask from the block table)"
    flex, why = _flex(skip)
    if why:
        return Col(name, None, missing=why)
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


def flex_contiguous(skip=None) -> Col:
    """Compiled flex_attention on the contiguous K/V, no mask; ``skip`` as ``flex_paged``."""
    name = "flex contiguous (compiled; K/V [B,Hkv,S,D], no mask)"
    flex, why = _flex(skip)
    if why:
        return Col(name, None, missing=why)

    def fn(q, kc, vc, qh, qr, k, v):
        return flex(qh, k, v, scale=SCALE, enable_gqa=True)

    return Col(name, fn, from_heads, timed_note="compile")
