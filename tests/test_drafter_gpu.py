"""The drafter on the GPU in bf16 (and fp32) with each GPU backend forced for every op that has
it, against the ``dflash`` package's model in fp32 on CPU (tests/test_drafter_parity.py's
protocol: several steps, context appended between steps)."""
from __future__ import annotations

import pytest
import torch

import dflash_ops
from dflash_ops import dispatch
from tests import test_drafter_parity as par

pytestmark = pytest.mark.gpu


def _close_bf16(got, want, step):
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 0.03 * scale, f"step {step}: max err {err:.3g} > 3% of {scale:.3g}"
    top2 = want.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 0.05 * scale  # rows without a near tie
    assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure]), f"step {step}: drafts"


def _ops_with(backend):
    return [op for op in dispatch.ops() if dispatch.has_backend(op, backend)]


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("variant", ["noncausal", "sliding", "speculators"])
def test_drafter_gpu_parity(backend, dtype, variant, tmp_path):
    ops = _ops_with(backend)
    if not ops:
        pytest.skip(f"no {backend} kernels")
    cfg = (par._cfg_dict(("sliding_attention", "full_attention"), sliding_window=5)
           if variant == "sliding" else par._cfg_dict())
    fmt = "speculators" if variant == "speculators" else "zlab"
    if dtype == torch.float32:
        def compare(got, want, step):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3,
                                       msg=lambda m: f"step {step}: {m}")
    else:
        compare = _close_bf16
    with dflash_ops.use_backend(backend, ops=ops):
        par._run(cfg, fmt, tmp_path, seed=3, device="cuda", dtype=dtype, compare=compare)
