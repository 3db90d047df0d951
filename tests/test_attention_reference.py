"""``block_attention``'s PyTorch reference against dense SDPA per request (fp64 truth), and the
dense attention, paged cases and mask modes the attention kernel tests share.

Tolerances as in tests/test_reference.py: fp32 tight, bf16/fp16 the 2x rule against fp64.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dflash_ops
from tests.conftest import poison
from tests.test_reference import (F64, LOW_DTYPES, OPS, _id, assert_fp32_close, assert_rule,
                                  rand)


# block_attention -----------------------------------------------------------------------------
def visible_mask(seq_len, q_len, causal, window):
    """[q_len, seq_len] bool: query i sits at position seq_len - q_len + i."""
    qpos = torch.arange(q_len)[:, None] + (seq_len - q_len)
    kpos = torch.arange(seq_len)[None, :]
    m = torch.ones(q_len, seq_len, dtype=torch.bool)
    if causal:
        m &= kpos <= qpos
    if window > 0:
        m &= (qpos - kpos < window) if causal else ((qpos - kpos).abs() < window)
    return m


def dense_attention(q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks, cd):
    """Per request: gather its keys to dense [S, Hkv, D] (keys in out-of-range blocks hidden),
    then SDPA with an explicit boolean mask (no sinks) or softmax over [scores, sink] with the
    sink column dropped (sinks). Computed in dtype ``cd``; queries with no key give zeros."""
    tq, hq, d = q.shape
    nb, bs, hkv, _ = kc.shape
    g = hq // hkv
    out = torch.zeros(tq, hq, d, dtype=cd)
    for b in range(table.shape[0]):
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        ql = q1 - q0
        s = min(max(int(seq_lens[b]), 0), table.shape[1] * bs)
        if ql <= 0 or s == 0:
            continue
        j = torch.arange(s)
        blk = table[b].long()[j // bs]
        present = (blk >= 0) & (blk < nb)
        k = kc[blk.clamp(0, max(nb - 1, 0)), j % bs].to(cd)  # [S, Hkv, D]
        v = vc[blk.clamp(0, max(nb - 1, 0)), j % bs].to(cd)
        mask = visible_mask(s, ql, causal, window) & present[None, :]
        qb = q[q0:q1].to(cd).transpose(0, 1)[None]  # [1, Hq, ql, D]
        kb = k.repeat_interleave(g, dim=1).transpose(0, 1)[None]  # [1, Hq, S, D]
        vb = v.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        if sinks is None:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
            o = torch.where(mask.any(-1)[None, None, :, None], o, torch.zeros_like(o))
        else:
            scores = (qb @ kb.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            sink = sinks.to(cd).view(1, hq, 1, 1).expand(1, hq, ql, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
            o = probs @ vb  # a query with no key: all its mass on the sink -> zeros
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def paged_case(seq_lens, q_lens, bs, hkv, hq, d, dtype, extra_blocks=3):
    """Caches with a random permutation of block ids per request; unused table entries are
    random garbage, including ids outside [0, num_blocks)."""
    n_used = [-(-s // bs) for s in seq_lens]
    m = max(n_used) + 2
    nb = sum(n_used) + extra_blocks
    perm = torch.randperm(nb)
    table = torch.randint(-4, nb + 4, (len(seq_lens), m), dtype=torch.int32)
    off = 0
    for b, u in enumerate(n_used):
        table[b, :u] = perm[off:off + u].to(torch.int32)
        off += u
    kc = rand(nb, bs, hkv, d, dtype=dtype)
    vc = rand(nb, bs, hkv, d, dtype=dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = rand(int(qsl[-1]), hq, d, dtype=dtype)
    return q, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32), qsl


SEQ_LENS = [1, 15, 16, 17, 100]
ATTN_MODES = {  # name: (causal, window, sinks)
    "noncausal": (False, -1, False),
    "causal": (True, -1, False),
    "window_noncausal": (False, 6, False),
    "window_causal": (True, 5, False),
    "sinks": (False, -1, True),
    "sinks_causal_window": (True, 20, True),
}


def _run_attention_case(bs, ratio, d, mode, dtype, hkv=2):
    causal, window, use_sinks = ATTN_MODES[mode]
    q_lens = [1] + [int(torch.randint(1, 9, ()).item()) for _ in SEQ_LENS[1:]]
    q, kc, vc, table, seq_lens, qsl = paged_case(SEQ_LENS, q_lens, bs, hkv, hkv * ratio, d, dtype)
    sinks = (torch.randn(hkv * ratio) * 2.0) if use_sinks else None
    scale = 1.0 / math.sqrt(d)
    out = OPS.block_attention(q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks)
    assert out.shape == q.shape and out.dtype == dtype
    args = (q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks)
    truth = dense_attention(*args, cd=F64)
    if dtype == torch.float32:
        assert_fp32_close(out, truth, f"block_attention {mode}")
    else:
        assert_rule(out, truth, dense_attention(*args, cd=dtype), f"block_attention {mode}")


@pytest.mark.parametrize("mode", list(ATTN_MODES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8], ids=lambda r: f"gqa{r}")
@pytest.mark.parametrize("bs", [4, 16], ids=lambda b: f"bs{b}")
def test_block_attention_fp32_vs_dense_sdpa(bs, ratio, d, mode):
    _run_attention_case(bs, ratio, d, mode, torch.float32)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=_id)
@pytest.mark.parametrize("mode", ["noncausal", "window_causal", "sinks_causal_window"])
@pytest.mark.parametrize("bs,ratio,d", [(16, 4, 128), (4, 8, 64)], ids=str)
def test_block_attention_low_precision_vs_dense_sdpa(dtype, mode, bs, ratio, d):
    _run_attention_case(bs, ratio, d, mode, dtype)


@pytest.mark.parametrize("mode", list(ATTN_MODES))
def test_block_attention_reference_in_row_chunks(mode, monkeypatch):
    """The reference gathers keys per query row in chunks of rows (REF_CHUNK elements): chunks
    of 1, 3 and 7 rows, across request boundaries and rows no request owns, give the dense
    truth."""
    from dflash_ops.ops import attention as A
    causal, window, use_sinks = ATTN_MODES[mode]
    torch.manual_seed(3)
    q_lens = [1] + [int(torch.randint(1, 9, ()).item()) for _ in SEQ_LENS[1:]]
    q, kc, vc, table, seq_lens, qsl = paged_case(SEQ_LENS, q_lens, 4, 2, 8, 64, torch.float32)
    q = torch.cat([q, torch.randn(2, 8, 64)])  # rows past query_start_loc[B]: zeros
    sinks = (torch.randn(8) * 2.0) if use_sinks else None
    args = (q, kc, vc, table, seq_lens, qsl, 0.125, causal, window, sinks)
    truth = dense_attention(*args, cd=F64)
    per_row = table.shape[1] * 4 * 2 * 64
    for rows in (1, 3, 7):
        monkeypatch.setattr(A, "REF_CHUNK", rows * per_row)
        out = A.block_attention_ref(*args)
        assert_fp32_close(out, truth, f"reference in chunks of {rows} rows, {mode}")
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_visible_mask_matches_dflash_package():
    dflash_model = pytest.importorskip("dflash.model")
    for s, ql in ((1, 1), (17, 8), (100, 5)):
        q, k = torch.zeros(1, 1, ql, 4), torch.zeros(1, 1, s, 4)
        for causal in (False, True):
            for window in (-1, 1, 3, 20):
                want = dflash_model._attention_mask(q, k, is_causal=causal,
                                                    sliding_window=window if window > 0 else None)
                assert torch.equal(visible_mask(s, ql, causal, window), want[0, 0])


@pytest.mark.parametrize("use_sinks", [False, True], ids=["nosinks", "sinks"])
def test_block_attention_zero_seq_len_and_bad_block_ids(use_sinks):
    bs, hkv, hq, d, nb = 4, 2, 4, 64, 6
    kc, vc = rand(nb, bs, hkv, d), rand(nb, bs, hkv, d)
    i32 = torch.int32
    # r0: seq 0, no queries; r1: seq 0 with 2 queries (sees nothing -> zeros); r2: 16 keys with
    # blocks 1 and 2 out of range (hidden); r3: every block out of range (zeros);
    # r4: a plain request; r5: seq_len 1000 > max_blocks * block_size = 16 (clamped to 16);
    # then 3 rows past query_start_loc[B] (zeros).
    table = torch.tensor([[0, 1, 2, 3],
                          [4, 5, 0, 1],
                          [2, -1, nb + 7, 3],
                          [-(2**31), nb, 2**31 - 1, -5],
                          [5, 4, -9, 99],
                          [1, 3, 5, 0]], dtype=i32)
    seq_lens = torch.tensor([0, 0, 16, 9, 7, 1000], dtype=i32)
    q_lens = [0, 2, 5, 3, 4, 3]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=i32)
    tq = int(qsl[-1]) + 3
    q = rand(tq, hq, d)
    sinks = torch.randn(hq) if use_sinks else None
    scale = 0.1
    out = OPS.block_attention(q, kc, vc, table, seq_lens, qsl, scale, False, -1, sinks)
    assert torch.isfinite(out).all()
    expected = dense_attention(q, kc, vc, table, seq_lens, qsl, scale, False, -1, sinks, F64)
    assert_fp32_close(out, expected, "bad values")
    assert (out[0:2] == 0).all() and (out[7:10] == 0).all() and (out[-3:] == 0).all()
    assert (out[2:7] != 0).any(dim=-1).all()  # r2 still sees its blocks 0 and 3
    assert (out[10:17] != 0).any(dim=-1).all()  # r4, r5

    out2 = poison(torch.empty_like(q))
    res = dflash_ops.block_attention(q, kc, vc, table, seq_lens, qsl, scale, False, -1, sinks,
                                     out=out2)
    assert res is out2
    assert torch.equal(out2, out), "out= differs from the returned result (or left NaN)"


@pytest.mark.parametrize("case", ["block_table_no_columns", "no_blocks_in_cache"])
def test_block_attention_degenerate_shapes(case):
    # max_blocks = 0: seq_lens clamp to 0 and every query sees no key; num_blocks = 0: every
    # block id is out of range. The docstring makes both zeros; a ValueError from the argument
    # checks would also be acceptable. Crashing inside the computation is not.
    hkv, hq, d = 2, 4, 64
    if case == "block_table_no_columns":
        kc, table = rand(3, 4, hkv, d), torch.zeros(2, 0, dtype=torch.int32)
    else:
        kc, table = rand(0, 4, hkv, d), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    vc = torch.randn_like(kc)
    q = rand(5, hq, d)
    seq_lens = torch.tensor([3, 8], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    try:
        out = OPS.block_attention(q, kc, vc, table, seq_lens, qsl, 0.125, False, -1, None)
    except ValueError as e:
        assert "dflash.block_attention" in str(e)
        return
    assert torch.equal(out, torch.zeros_like(q))
