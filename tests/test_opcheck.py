"""``torch.library.opcheck`` on every ``torch.ops.dflash.*`` op, plus a torch.compile smoke test.

opcheck runs test_schema (the op writes only what its schema marks ``(a!)``), the autograd
registration check, the fake kernel against the real one, and AOT dispatch with dynamic shapes.
The cases are the op families' sample tables (``dflash_ops.ops.samples``), small so the whole
file runs in seconds on CPU; the same cases run on CUDA tensors under ``@pytest.mark.gpu``.
``test_every_registered_op_is_opchecked`` fails when an op has no sample case.
"""
from __future__ import annotations

import pytest
import torch

import dflash_ops  # noqa: F401  (defines torch.ops.dflash.*)
from dflash_ops import dispatch
from dflash_ops.ops import samples
from dflash_ops.ops.rope import make_cos_sin_cache

EPS = 1e-6

# fp32 for every case; bf16 too (everything here is small).
DTYPES = [torch.float32, torch.bfloat16]
CASES = [(op, case) for op, cases in samples("cpu", torch.float32).items() for case in cases]


def _params(marks=()):
    return [pytest.param(op, case, dtype, id=f"{op}-{case}-{str(dtype).replace('torch.', '')}",
                         marks=list(marks))
            for op, case in CASES for dtype in DTYPES]


def opcheck(op, case, dtype, device):
    """torch.library.opcheck of ``op`` on its sample ``case`` made on ``device`` in ``dtype``."""
    info = dispatch.ops()[op]
    args, kwargs = info.call_args(samples(device, dtype)[op][case])
    # bf16 reference math in fp32 then rounded: the fake/real comparison is exact, but opcheck's
    # aot_dispatch test re-runs the op, so allow rounding-level differences.
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.library.opcheck(getattr(torch.ops.dflash, op).default, args, kwargs, **tol)


@pytest.mark.parametrize("op, case, dtype", _params())
def test_opcheck_cpu(op, case, dtype):
    opcheck(op, case, dtype, "cpu")


@pytest.mark.parametrize("op, case, dtype", _params([pytest.mark.gpu]))
def test_opcheck_cuda(op, case, dtype):
    opcheck(op, case, dtype, "cuda")


def test_every_registered_op_is_opchecked():
    covered = {op for op, _ in CASES}
    registered = set(dispatch.ops())
    missing = registered - covered
    assert not missing, f"ops registered but without sample cases: {sorted(missing)}"
    stale = covered - registered
    assert not stale, f"sample cases for ops that are not registered: {sorted(stale)}"
    for op in registered:
        assert hasattr(torch.ops.dflash, op), f"torch.ops.dflash.{op} missing"


def test_samples_are_deterministic():
    """Every consumer rebuilds the table and expects the same values each time."""
    a, b = samples("cpu", torch.float32), samples("cpu", torch.float32)
    for op, cases in a.items():
        for case, kw in cases.items():
            for name, v in kw.items():
                for x, y in zip(v if isinstance(v, list) else [v],
                                b[op][case][name] if isinstance(v, list) else [b[op][case][name]]):
                    if isinstance(x, torch.Tensor):
                        assert torch.equal(x, y) and x.stride() == y.stride(), (op, case, name)
                    else:
                        assert x == y, (op, case, name)


# --------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): rms_norm -> qk_norm_rope_ -> store_kv_ -> block_attention
# --------------------------------------------------------------------------------------------
def _draft_layer(hidden, norm_w, w_qkv, q_w, k_w, positions, cache, slots, k_caches, v_caches,
                 block_table, seq_lens, qsl, hq, hkv, d):
    """One drafter attention step on our ops: norm, QKV GEMM, per-head norm + RoPE, cache
    write, block attention over the caches."""
    t = hidden.shape[0]
    h = torch.ops.dflash.rms_norm(hidden, norm_w, EPS)
    qkv = (h @ w_qkv.t()).view(t, hq + 2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    torch.ops.dflash.qk_norm_rope_(q, k, q_w, k_w, positions, cache, EPS, True)
    torch.ops.dflash.store_kv_(k.unsqueeze(1), v.unsqueeze(1), k_caches, v_caches, slots)
    o = torch.ops.dflash.block_attention(q, k_caches[0], v_caches[0], block_table, seq_lens, qsl,
                                         d ** -0.5, True, -1, None)
    return o.reshape(t, hq * d) + hidden[:, : hq * d], q, k


def _draft_inputs():
    g = torch.Generator().manual_seed(12)
    hq, hkv, d, hidden_size = 2, 1, 64, 160
    nb, bs = 6, 4
    b, blk = 2, 4  # two requests, a block of 4 draft tokens each
    t = b * blk
    ctx = [5, 7]  # context lengths already in the caches
    hidden = torch.randn(t, hidden_size, generator=g)
    norm_w = torch.randn(hidden_size, generator=g)
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden_size, generator=g) * hidden_size ** -0.5
    q_w, k_w = torch.randn(d, generator=g), torch.randn(d, generator=g)
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([c + blk for c in ctx], dtype=torch.int32)
    qsl = torch.tensor([0, blk, 2 * blk], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + blk) for c in ctx])
    req = torch.arange(t) // blk
    slots = block_table.long()[req, positions // bs] * bs + positions % bs
    cache = make_cos_sin_cache(32, d)
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    return (hidden, norm_w, w_qkv, q_w, k_w, positions, cache, slots, [k_cache], [v_cache],
            block_table, seq_lens, qsl, hq, hkv, d)


def _clone_inputs(inputs):
    return tuple([x.clone() for x in a] if isinstance(a, list) else
                 (a.clone() if isinstance(a, torch.Tensor) else a) for a in inputs)


@pytest.mark.parametrize("backend", [
    "aot_eager",  # functionalization of the (a!) ops, fast
    pytest.param("inductor", marks=pytest.mark.slow),  # ~20 s of C++ compilation on 2 CPU cores
])
def test_torch_compile_fullgraph_draft_layer(backend):
    torch._dynamo.reset()
    eager_in = _draft_inputs()
    comp_in = _clone_inputs(eager_in)
    out_e, q_e, k_e = _draft_layer(*eager_in)
    compiled = torch.compile(_draft_layer, fullgraph=True, backend=backend, dynamic=False)
    out_c, q_c, k_c = compiled(*comp_in)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(q_c, q_e)
    torch.testing.assert_close(k_c, k_e)
    # the in-place cache write must survive functionalization
    torch.testing.assert_close(comp_in[8][0], eager_in[8][0])
    torch.testing.assert_close(comp_in[9][0], eager_in[9][0])
    # and the caches really were written (the draft block's slots changed)
    fresh = _draft_inputs()
    assert not torch.equal(comp_in[8][0], fresh[8][0])
