"""``block_attention`` GPU kernels against the float64 dense SDPA truth
(tests/test_attention_reference.py).

Each GPU backend that has the op is forced in turn. Cases: the interpreter test's grid in
bf16/fp16 (every mask mode, GQA 1/4/8, D 64/128, splits 1/4/auto), D 256, a long request
(4096 + 3 keys) next to short ones, a CUDA graph captured with one set of lengths and replayed
with others, and a cache of more than 2^31 elements (64-bit offsets).

The CUDA backend has two kernels (DFLASH_OPS_ATTN_KERNEL picks one): on an H100 / H200 the
sm_90a kernel (TMA + wgmma) takes bf16 / fp16 calls with D 64 / 128 and pages of a power of two
>= 8 keys, the portable one (mma.sync) the rest. The grid is run with each forced; the other
tests run the automatic choice.
"""
from __future__ import annotations

import math

import pytest
import torch

import dflash_ops
from dflash_ops import dispatch
from tests import test_triton_attention_interp as interp
from tests.test_attention_reference import dense_attention, paged_case
from tests.test_reference import F64, assert_rule

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16
BACKENDS = ["triton", "cuda"]


def _need(backend):
    if not dispatch.has_backend("block_attention", backend):
        pytest.skip(f"no {backend} kernel for block_attention (available: "
                    f"{dispatch.available_backends('block_attention')})")


def _check(backend, dtype, seq_lens, q_lens, bs, hkv, ratio, d, causal=False, window=-1,
           use_sinks=False, seed=0, extra_blocks=3):
    torch.manual_seed(seed)
    q, kc, vc, table, sl, qsl = paged_case(seq_lens, q_lens, bs, hkv, hkv * ratio, d, dtype,
                                           extra_blocks=extra_blocks)
    sinks = (torch.randn(hkv * ratio) * 2.0) if use_sinks else None
    scale = 1.0 / math.sqrt(d)
    args = (q, kc, vc, table, sl, qsl, scale, causal, window, sinks)
    truth = dense_attention(*args, cd=F64)
    dev = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.full_like(dev[0], float("nan"))
    with dflash_ops.use_backend(backend, ops=["block_attention_out_"]):
        dflash_ops.block_attention(*dev, out=out)
    what = f"block_attention[{backend}] {dtype} S={seq_lens} gqa={ratio} D={d}"
    assert not torch.isnan(out).any(), f"{what}: NaN"
    assert_rule(out.cpu(), truth, dense_attention(*args, cd=dtype), what)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_triton_grid(dtype):
    _need("triton")
    interp.check_block_attention(DEV, dtypes=(dtype,), splits_list=(1, 4, None))


@pytest.mark.parametrize("dtype", [BF16, FP16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_grid(dtype):
    """The interpreter grid through the CUDA kernel (its own split choice, run once per mode and
    shape; splits_list only repeats the case with a fresh seed)."""
    _need("cuda")
    interp.check_block_attention(DEV, dtypes=(dtype,), splits_list=(1, 2), backend="cuda")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_odd_gqa_grid(backend, dtype):
    """GQA groups that are not a power of two (3, 5, 6; Qwen2.5-14B: 40 / 8 heads)."""
    _need(backend)
    interp.check_block_attention(DEV, dtypes=(dtype,), splits_list=(1, 3),
                                 shapes=interp.ODD_GQA_SHAPES, backend=backend)


# (block_size, GQA ratio, D): pages of one box a tile (64, 128) and several (8, 16), both D
HOPPER_SHAPES = ((8, 4, 128), (16, 1, 64), (16, 8, 128), (64, 4, 128), (128, 4, 64))


def _need_hopper():
    _need("cuda")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the wgmma kernel needs an sm_90 GPU, this is "
                    f"{torch.cuda.get_device_capability()}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_cuda_wgmma_kernel_grid(dtype, monkeypatch):
    """The sm_90a kernel forced (an error if it cannot take a call) over every mask mode, GQA
    1/4/8, D 64/128, pages of 8-128 keys, head-major caches, poisoned outputs."""
    _need_hopper()
    monkeypatch.setenv("DFLASH_OPS_ATTN_KERNEL", "wgmma")
    interp.check_block_attention(DEV, dtypes=(dtype,), splits_list=(1, 2),
                                 shapes=HOPPER_SHAPES, backend="cuda")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_cuda_mma_kernel_grid(dtype, monkeypatch):
    """The portable kernel forced on the shapes the sm_90a kernel would take."""
    _need("cuda")
    monkeypatch.setenv("DFLASH_OPS_ATTN_KERNEL", "mma")
    interp.check_block_attention(DEV, dtypes=(dtype,), splits_list=(1,),
                                 shapes=HOPPER_SHAPES[:3], backend="cuda")


@pytest.mark.parametrize("case", ["one-kv-head", "one-block"])
def test_cuda_wgmma_kernel_size_one_dims(case, monkeypatch):
    """Cache dims of size 1 (TMA strides of 16 bytes stand in for theirs): one KV head (MQA,
    or a tensor-parallel shard), a cache of a single block."""
    _need_hopper()
    monkeypatch.setenv("DFLASH_OPS_ATTN_KERNEL", "wgmma")
    if case == "one-kv-head":
        _check("cuda", BF16, [300, 17, 1], [16, 5, 1], 16, 1, 8, 128, use_sinks=True)
    else:
        _check("cuda", BF16, [13], [4], 16, 2, 4, 64, extra_blocks=0)


def test_cuda_kernel_choice_errors(monkeypatch):
    """DFLASH_OPS_ATTN_KERNEL=wgmma on a call the kernel cannot take, or an unknown value: one
    clear error naming the reason."""
    _need_hopper()
    q = torch.randn(16, 8, 128, device=DEV).to(BF16)
    kc = torch.randn(8, 4, 2, 128, device=DEV).to(BF16)  # block_size 4
    table = torch.arange(8, dtype=torch.int32, device=DEV)[None]
    sl = torch.tensor([30], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    with dflash_ops.use_backend("cuda", ops=["block_attention"]):
        monkeypatch.setenv("DFLASH_OPS_ATTN_KERNEL", "wgmma")
        with pytest.raises(ValueError, match="block_size not a power of two >= 8"):
            dflash_ops.block_attention(q, kc, kc, table, sl, qsl, 0.1)
        with pytest.raises(ValueError, match="q not bf16/fp16"):
            dflash_ops.block_attention(q.float(), kc.float(), kc.float(), table, sl, qsl, 0.1)
        monkeypatch.setenv("DFLASH_OPS_ATTN_KERNEL", "fast")
        with pytest.raises(ValueError, match="must be auto, mma or wgmma, got 'fast'"):
            dflash_ops.block_attention(q, kc, kc, table, sl, qsl, 0.1)
        monkeypatch.setenv("DFLASH_OPS_ATTN_KERNEL", "auto")  # the portable kernel takes it
        assert torch.isfinite(dflash_ops.block_attention(q, kc, kc, table, sl, qsl, 0.1)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["noncausal", "causal", "window"])
def test_head_dim_256(backend, mode):
    _need(backend)
    _check(backend, BF16, [1, 33, 300], [1, 16, 7], 16, 2, 4, 256, causal=mode == "causal",
           window=40 if mode == "window" else -1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_long_request_next_to_short_ones(backend, ratio):
    _need(backend)
    _check(backend, BF16, [4096 + 3, 1, 1000, 17], [16, 1, 16, 9], 16, 2, ratio, 128,
           use_sinks=ratio == 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_with_other_lengths(backend):
    """Capture once (after a warm-up), then replay with new seq_lens / query_start_loc /
    block tables copied into the static inputs: the split choice never reads lengths."""
    _need(backend)
    torch.manual_seed(3)
    bs, hkv, ratio, d, b, m = 16, 2, 4, 128, 3, 80
    nb = b * m + 4
    kc = torch.randn(nb, bs, hkv, d, device=DEV).to(BF16)
    vc = torch.randn(nb, bs, hkv, d, device=DEV).to(BF16)
    tq = 3 * 16
    q = torch.empty(tq, hkv * ratio, d, device=DEV, dtype=BF16)
    table = torch.zeros(b, m, dtype=torch.int32, device=DEV)
    sl = torch.zeros(b, dtype=torch.int32, device=DEV)
    qsl = torch.zeros(b + 1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(d)

    def fill(seq_lens, q_lens):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF16))
        table.copy_(torch.randperm(nb)[:b * m].view(b, m).to(torch.int32))
        sl.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        qsl.copy_(torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32))

    def call():
        dflash_ops.block_attention(q, kc, vc, table, sl, qsl, scale, False, -1, None, out=out)

    with dflash_ops.use_backend(backend, ops=["block_attention_out_"]):
        fill([100, 200, 300], [16, 16, 16])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        for seq_lens, q_lens in (([1280, 16, 700], [16, 1, 9]), ([5, 1000, 1279], [5, 16, 16])):
            fill(seq_lens, q_lens)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            args = [a.cpu() if isinstance(a, torch.Tensor) else a
                    for a in (q, kc, vc, table, sl, qsl, scale, False, -1, None)]
            truth = dense_attention(*args, cd=F64)
            assert not torch.isnan(out).any(), f"replay {seq_lens}: NaN"
            assert_rule(out.cpu(), truth, dense_attention(*args, cd=BF16), f"replay {seq_lens}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_past_32bit_offsets(backend):
    """A [num_blocks, 16, 8, 128] bf16 cache of > 2^31 elements (4.6 GB each for K and V);
    the request's blocks sit at the top of it."""
    _need(backend)
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GB of free GPU memory")
    bs, hkv, d, ratio = 16, 8, 128, 4
    nb = 2**31 // (bs * hkv * d) + 64
    kc = torch.empty(nb, bs, hkv, d, device=DEV, dtype=BF16)
    vc = torch.empty_like(kc)
    seq, ql = 300, 16
    used = -(-seq // bs)
    ids = torch.arange(nb - used, nb, dtype=torch.int32)[torch.randperm(used)]
    kc[ids.long()] = torch.randn(used, bs, hkv, d, device=DEV).to(BF16)
    vc[ids.long()] = torch.randn(used, bs, hkv, d, device=DEV).to(BF16)
    table = ids[None].to(DEV)
    sl = torch.tensor([seq], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, ql], dtype=torch.int32, device=DEV)
    q = torch.randn(ql, hkv * ratio, d, device=DEV).to(BF16)
    scale = 1 / math.sqrt(d)
    with dflash_ops.use_backend(backend, ops=["block_attention"]):
        out = dflash_ops.block_attention(q, kc, vc, table, sl, qsl, scale)
    # the same keys in a small cache
    small_k, small_v = kc[ids.long()].cpu(), vc[ids.long()].cpu()
    small_t = torch.arange(used, dtype=torch.int32)[None]
    args = (q.cpu(), small_k, small_v, small_t, sl.cpu(), qsl.cpu(), scale, False, -1, None)
    del kc, vc
    assert_rule(out.cpu(), dense_attention(*args, cd=F64), dense_attention(*args, cd=BF16),
                "block_attention past 2^31")


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_partials_past_32bit_offsets(backend):
    """32 absolute splits (split_keys 64 over 2048 keys) of a call with Tq 4352, Hq 64, D 256:
    the fp32 partials [32, Tq, Hq, D] hold 2.3e9 elements, so split s >= 8 sits past 2^31 (9.1
    GB). One request owns the first 16 rows; the rest are zeros."""
    _need(backend)
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GB of free GPU memory")
    torch.manual_seed(5)
    tq, hq, hkv, d, bs, m, ql = 4352, 64, 1, 256, 16, 128, 16
    q = torch.randn(tq, hq, d, device=DEV).to(BF16)
    kc = torch.randn(m, bs, hkv, d, device=DEV).to(BF16)
    vc = torch.randn(m, bs, hkv, d, device=DEV).to(BF16)
    table = torch.randperm(m, device=DEV)[None].to(torch.int32)
    sl = torch.tensor([m * bs], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, ql], dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    with dflash_ops.use_backend(backend, ops=["block_attention_out_"]):
        dflash_ops.block_attention(q, kc, vc, table, sl, qsl, scale, True, -1, None, 64,
                                   out=out)
    assert torch.equal(out[ql:], torch.zeros_like(out[ql:])), "rows no request owns"
    args = (q[:ql].cpu(), kc.cpu(), vc.cpu(), table.cpu(), sl.cpu(), qsl.cpu(), scale, True, -1,
            None)
    assert_rule(out[:ql].cpu(), dense_attention(*args, cd=F64), dense_attention(*args, cd=BF16),
                "block_attention split partials past 2^31")
