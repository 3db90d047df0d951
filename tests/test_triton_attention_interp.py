"""The Triton ``block_attention`` kernels on CPU under TRITON_INTERPRET=1 against the float64 dense
SDPA truth of tests/test_attention_reference.py (fp32: close to it; fp16: the 2x rule, at most 2x
the error of the dense computation done in fp16).

Cases: every mask mode of ATTN_MODES (non-causal, causal, windows both ways, sinks), GQA 1/4/8
(and 3/5/6, groups that are not a power of two: Qwen2.5-14B's 40 / 8 heads), D 64/128, block sizes 4/16, requests with seq_len 1/15/16/17/100 and per-request query lengths,
shuffled block tables with garbage ids past each request's blocks; every fourth case with the
caches stored head-major (a strided view); the key range split 1, 3 and
the automatic choice (the combine kernel); output rows no request owns (zeros); outputs poisoned
with NaN first. fp16/fp32 only (tl.dot on bf16 is wrong in the interpreter).

Each test runs its checks in a subprocess (TRITON_INTERPRET must be set before triton is imported).
``check_block_attention`` takes a device so a GPU test can reuse it.
"""
import math

import pytest
import torch

from tests.conftest import run_interpreted

from tests.test_attention_reference import (ATTN_MODES, SEQ_LENS, dense_attention,
                                            paged_case)
from tests.test_reference import F64, assert_fp32_close, assert_rule

INTERP_DTYPES = (torch.float16, torch.float32)


def _poisoned_like(q):
    return torch.full_like(q, float("nan"))


def run_case(device, dtype, bs, ratio, d, mode, splits, gen_seed, hkv=2, extra_rows=0,
             backend="triton", head_major=False):
    """backend "triton" calls the Triton kernel with ``splits``; another name goes through the
    dispatcher with that backend forced (its own split choice; ``splits`` is ignored).
    head_major: the caches hold the same values stored [num_blocks, Hkv, block_size, D] and
    are passed as the [num_blocks, block_size, Hkv, D] view."""
    torch.manual_seed(gen_seed)
    causal, window, use_sinks = ATTN_MODES[mode]
    q_lens = [1] + [int(torch.randint(1, 9, ()).item()) for _ in SEQ_LENS[1:]]
    q, kc, vc, table, seq_lens, qsl = paged_case(SEQ_LENS, q_lens, bs, hkv, hkv * ratio, d, dtype)
    if extra_rows:  # rows past query_start_loc[B]: no request owns them -> zeros
        q = torch.cat([q, torch.randn(extra_rows, *q.shape[1:]).to(dtype)])
    sinks = (torch.randn(hkv * ratio) * 2.0) if use_sinks else None
    scale = 1.0 / math.sqrt(d)
    args = (q, kc, vc, table, seq_lens, qsl, scale, causal, window, sinks)
    truth = dense_attention(*args, cd=F64)
    dev_args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    if head_major:
        for i in (1, 2):
            dev_args[i] = dev_args[i].transpose(1, 2).contiguous().transpose(1, 2)
    out = _poisoned_like(dev_args[0])
    if backend == "triton":
        from dflash_ops.triton import attention as ta
        ta.block_attention_out_(*dev_args, out=out, splits=splits)
    else:
        import dflash_ops
        with dflash_ops.use_backend(backend, ops=["block_attention_out_"]):
            dflash_ops.block_attention(*dev_args, out=out)
    out = out.cpu()
    what = (f"block_attention[{backend}] {mode} {dtype} bs={bs} gqa={ratio} D={d} "
            f"splits={splits}{' head-major' if head_major else ''}")
    assert not torch.isnan(out).any(), f"{what}: NaN (a row was not written)"
    if extra_rows:
        assert torch.equal(out[-extra_rows:], torch.zeros_like(out[-extra_rows:])), \
            f"{what}: rows past query_start_loc[B] not zero"
        out, truth = out[:-extra_rows], truth[:-extra_rows]
        args = (q[:-extra_rows],) + args[1:]
    if dtype == torch.float32:
        assert_fp32_close(out, truth, what)
    else:
        assert_rule(out, truth, dense_attention(*args, cd=dtype), what)


def check_block_attention(device, dtypes=INTERP_DTYPES, splits_list=(1, 3, None),
                          shapes=((4, 1, 64), (16, 4, 64), (4, 8, 128)), backend="triton"):
    seed = 0
    for dtype in dtypes:
        for bs, ratio, d in shapes:
            for mode in ATTN_MODES:
                for splits in splits_list:
                    seed += 1
                    run_case(device, dtype, bs, ratio, d, mode, splits, seed,
                             extra_rows=2 if seed % 3 == 0 else 0, backend=backend,
                             head_major=seed % 4 == 1)


_SCRIPT = r"""
import sys, torch, dflash_ops
import tests.test_triton_attention_interp as t
dtypes = {"fp16": (torch.float16,), "fp32": (torch.float32,)}[sys.argv[1]]
t.check_block_attention("cpu", dtypes=dtypes)
print("interp-ok")
"""


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_triton_block_attention_interpreter_cpu(dtype):
    run_interpreted(_SCRIPT, dtype, timeout=900)


# GQA groups that are not a power of two: the kernel pads the group to the next power of two and
# masks the padding rows (their query loads, stores and sink loads)
ODD_GQA_SHAPES = ((4, 3, 64), (16, 5, 64), (4, 6, 128))

_SCRIPT_ODD = r"""
import torch, dflash_ops
import tests.test_triton_attention_interp as t
t.check_block_attention("cpu", dtypes=(torch.float32,), splits_list=(1, 3),
                        shapes=t.ODD_GQA_SHAPES)
print("interp-ok")
"""


def test_triton_block_attention_odd_gqa_interpreter_cpu():
    run_interpreted(_SCRIPT_ODD, timeout=900)
