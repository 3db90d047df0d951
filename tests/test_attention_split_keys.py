"""``block_attention(..., split_keys=N)``: key splits at absolute positions, so that a query row's
result is bit-identical whatever else shares the call (exact mode's batch-invariant attention).

For each mask mode: three requests (seq_lens 300 / 77 / 513, blocks of 16, a shuffled table
with garbage past each request's blocks) with blocks of 16 / 5 / 16 queries. Compared bit for
bit against the full call:
* each request alone (its table row, the same width), its block of queries as in the full call;
* causal modes: every query row as a one-query call at its own position (seq_len = position +
  1: the same visible keys), the verify-vs-decode case of speculative decoding.
The full call is also checked against the torch reference (the tolerance rule); NaN in keys
before every query's window (read by the absolute tiles, zero-filled) must not reach the output. The same checks
with ``split_keys=0`` (splits chosen from the shapes) must find a difference somewhere in the
one-query comparison, so the comparison can fail. CPU: the Triton kernel under the interpreter
(fp32, fp16), bit for bit where the row's place in the kernel's tile is the same (numpy's
matmul, the interpreter's tl.dot, sums a row by its place); GPU: the CUDA and Triton kernels
in bf16 / fp16 / fp32, every row bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import run_interpreted
from tests.test_attention_reference import ATTN_MODES, dense_attention, paged_case
from tests.test_reference import F64, assert_fp32_close, assert_rule

SEQ = [300, 77, 513]
QLEN = [16, 5, 16]


def _call(backend, q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks, split_keys):
    import dflash_ops
    out = torch.full_like(q, float("nan"))
    with dflash_ops.use_backend(backend, ops=["block_attention_out_"]):
        dflash_ops.block_attention(q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks,
                                   out=out, split_keys=split_keys)
    return out


def invariance(device, dtype, backend, mode, split_keys, d=64, hkv=2, ratio=4, seed=0,
               pad_blocks=0, row_split_keys=None):
    """(rows compared, rows that differ) over both comparisons; asserts the full call against
    the reference. ``pad_blocks``: garbage columns appended to the block table (a wider table:
    more splits, up to the 32 allowed). ``row_split_keys``: another split_keys for the
    per-request and per-row calls (the control: other split boundaries)."""
    row_sk = split_keys if row_split_keys is None else row_split_keys
    torch.manual_seed(seed)
    causal, window, use_sinks = ATTN_MODES[mode]
    q, kc, vc, table, seq_lens, qsl = paged_case(SEQ, QLEN, 16, hkv, hkv * ratio, d, dtype)
    if pad_blocks:
        table = torch.cat([table, torch.randint(-4, kc.shape[0] + 4, (len(SEQ), pad_blocks),
                                                dtype=torch.int32)], 1)
    sinks = (torch.randn(hkv * ratio) * 2.0) if use_sinks else None
    scale = 1.0 / math.sqrt(d)
    args = [q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks]
    truth = dense_attention(*args, cd=F64)
    dev = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    q_d, kc_d, vc_d, table_d, _, _ = dev[:6]
    full = _call(backend, *dev, split_keys).cpu()
    what = f"{backend} {dtype} {mode} split_keys={split_keys}"
    if dtype == torch.float32:
        assert_fp32_close(full, truth, what)
    else:
        assert_rule(full, truth, dense_attention(*args, cd=dtype), what)
    i32 = dict(dtype=torch.int32, device=device)
    compared = differ = 0
    for b, (s, n) in enumerate(zip(SEQ, QLEN)):
        r0 = int(qsl[b])
        rows = q_d[r0:r0 + n]
        alone = _call(backend, rows, kc_d, vc_d, table_d[b:b + 1], torch.tensor([s], **i32),
                      torch.tensor([0, n], **i32), scale, causal, window, dev[9],
                      row_sk).cpu()
        compared += n
        differ += int((alone != full[r0:r0 + n]).flatten(1).any(1).sum())
        if not causal:
            continue
        for i in range(n):  # one query at its own position: the same keys when causal
            one = _call(backend, rows[i:i + 1], kc_d, vc_d, table_d[b:b + 1],
                        torch.tensor([s - n + i + 1], **i32), torch.tensor([0, 1], **i32),
                        scale, causal, window, dev[9], row_sk).cpu()
            if device == "cpu" and i > 0:
                # the interpreter's tl.dot is numpy's matmul, whose sums for a row depend on
                # the row's place in the tile (row i of the block vs row 0 of the one-query
                # tile: 1 ulp apart in fp32, seen); counted bit for bit on the GPU, and on the
                # CPU where the places agree (i = 0)
                torch.testing.assert_close(one[0].float(), full[r0 + i].float(), rtol=2e-3,
                                           atol=2e-3)
                continue
            compared += 1
            differ += int(not torch.equal(one[0], full[r0 + i]))
    return compared, differ


def nan_before_window(device, dtype, backend, split_keys=64):
    """Keys no query sees (before every query's window) hold NaN: the split_keys tiles start
    at absolute multiples of the tile width, below the window, and must not let them in."""
    torch.manual_seed(5)
    q, kc, vc, table, seq_lens, qsl = paged_case(SEQ, QLEN, 16, 2, 8, 64, dtype)
    window = 20
    args = [q, kc, vc, table, seq_lens, qsl, 0.125, True, window, None]
    dev = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    clean = _call(backend, *dev, split_keys).cpu()
    kc_d, vc_d = dev[1].clone(), dev[2].clone()
    for b, (s, n) in enumerate(zip(SEQ, QLEN)):
        first_seen = s - n - window + 1  # the first query's window starts here
        for j in range(max(first_seen, 0)):
            blk = int(table[b, j // 16])
            kc_d[blk, j % 16] = float("nan")
            vc_d[blk, j % 16] = float("nan")
    dirty = _call(backend, dev[0], kc_d, vc_d, *dev[3:], split_keys).cpu()
    assert not dirty.isnan().any(), f"{backend} {dtype}: NaN from keys before the window"
    assert torch.equal(dirty, clean), f"{backend} {dtype}: keys before the window changed rows"


MODES = ("noncausal", "causal", "window_causal", "sinks_causal_window")


def check(device, dtypes, backends, split_keys_list=(64, 128)):
    for backend in backends:
        for dtype in dtypes:
            for mode in MODES:
                for sk in split_keys_list:
                    n, bad = invariance(device, dtype, backend, mode, sk)
                    assert bad == 0, f"{backend} {dtype} {mode} split_keys={sk}: {bad} of " \
                                     f"{n} rows differ from the full call"
            # the widest table split_keys 64 allows: 2048 keys, 32 splits (the combine's limit)
            n, bad = invariance(device, dtype, backend, "causal", 64, pad_blocks=128 - 35)
            assert bad == 0, f"{backend} {dtype} 32 splits: {bad} of {n} rows differ"
            nan_before_window(device, dtype, backend)
            # the control: other split boundaries for the single calls (128 keys a split, the
            # full call 64) must part some row from the full call. fp32 only: a different merge
            # order moves the fp32 sums by about an ulp, which bf16 / fp16 outputs mostly round
            # away. (Shape-chosen splits, split_keys 0, are no control on the GPU: for these
            # short requests they chose the same boundaries alone and together.)
            if dtype == torch.float32:
                n, bad = invariance(device, dtype, backend, "causal", 64, row_split_keys=128)
                assert bad > 0, f"{backend} {dtype}: split_keys 64 vs 128 matched on all {n} " \
                                f"rows: the comparison cannot tell"


_SCRIPT = r"""
import torch
import tests.test_attention_split_keys as t
t.check("cpu", (torch.float32, torch.float16), ("triton",), split_keys_list=(64,))
print("interp-ok")
"""


def test_triton_split_keys_rows_are_batch_invariant_under_interpreter():
    run_interpreted(_SCRIPT)


def test_reference_and_validation():
    """The torch reference ignores split_keys; bad values are named errors."""
    import dflash_ops
    torch.manual_seed(1)
    q, kc, vc, table, seq_lens, qsl = paged_case(SEQ, QLEN, 16, 2, 8, 64, torch.float32)
    args = (q, kc, vc, table, seq_lens, qsl, 0.125, True, -1, None)
    assert torch.equal(dflash_ops.block_attention(*args, split_keys=128),
                       dflash_ops.block_attention(*args))
    for bad in (-64, 32, 100):
        with pytest.raises(ValueError, match="split_keys must be 0 or a positive multiple"):
            dflash_ops.block_attention(*args, split_keys=bad)
    with pytest.raises(ValueError, match="at most 32"):  # 2064 keys / 64: 33 splits
        dflash_ops.block_attention(q, kc, vc, torch.zeros(3, 129, dtype=torch.int32),
                                   seq_lens, qsl, 0.125, split_keys=64)
    dflash_ops.block_attention(q, kc, vc, torch.zeros(3, 128, dtype=torch.int32), seq_lens,
                               qsl, 0.125, split_keys=64)  # 2048 keys: 32 splits, allowed


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_split_keys_rows_are_batch_invariant_gpu(backend):
    from dflash_ops import dispatch
    if not dispatch.has_backend("block_attention_out_", backend):
        pytest.fail(f"no {backend} kernel for block_attention_out_")
    # Triton: bf16 and fp32 (fp16 runs bf16's code; its three dtypes' compiles ran past 210 s
    # on the H200)
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if backend == "cuda" else \
        (torch.bfloat16, torch.float32)
    check("cuda", dtypes, (backend,))
