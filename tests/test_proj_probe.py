"""benchmarks/proj_probe.py's own kernels, on CPU, so that a change to the library's GEMM pieces
(``context._slice_acc``, ``_tile_ids``) or to the probe cannot break it unseen until a GPU call
(device time is scarce): under the Triton interpreter against torch (the read-only sum, the
tile-load sum a (tile, slice) program, the split-K main loop's per-slice partials, trailing and
empty slices included; fp16, since tl.dot on bf16 is wrong in the interpreter), and compiled
for sm_90: the tile-load loop pipelined as deep as asked (one TMA load in the loop plus
STAGES - 1 in its prologue; unpipelined it would time a latency-bound loop, not the loads)."""
from __future__ import annotations

import re

import pytest

from tests.conftest import run_interpreted

_SCRIPT = r"""
import sys
import torch, triton
sys.path.insert(0, "benchmarks")
import proj_probe as pp
from triton.tools.tensor_descriptor import TensorDescriptor

def desc(t, box):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box)

torch.manual_seed(0)
m, bm = 5, 16
for n, h, bn, bk, split in ((96, 640, 32, 128, 3), (64, 384, 16, 128, 4), (96, 512, 32, 64, 2)):
    w = torch.randn(n, h, dtype=torch.float16)
    x = torch.randn(m, h, dtype=torch.float16)
    ks = triton.cdiv(triton.cdiv(h, split), bk) * bk
    nn = triton.cdiv(n, bn)
    bounds = [(s * ks, min(s * ks + ks, h)) for s in range(split)]
    red = torch.full((nn * split,), float("nan"))
    pp._tile_read_kernel[(nn, split)](desc(w, [bn, bk]), red, h, ks, BLOCK_N=bn, BLOCK_K=bk,
                                      STAGES=3)
    ref = torch.stack([torch.stack([w[j * bn:(j + 1) * bn, lo:hi].float().sum()
                                    for lo, hi in bounds]) for j in range(nn)]).reshape(-1)
    assert torch.allclose(red, ref, atol=1e-2, rtol=1e-4), (n, h, bn, bk, split, red, ref)
    part = torch.full((split, bm, nn * bn), float("nan"))
    pp._loop_only_kernel[(nn, split)](desc(x, [bm, bk]), desc(w, [bn, bk]), part, m, n, h, ks, 1,
                                      nn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
    refp = torch.stack([x[:, lo:hi].float() @ w[:, lo:hi].float().t() for lo, hi in bounds])
    assert torch.allclose(part[:, :m, :n], refp, atol=1e-2, rtol=1e-3), (n, h, bn, bk, split)
    assert torch.isnan(part[:, m:]).all()  # rows past T never written
flat = torch.randn(3000, dtype=torch.float16)
out = torch.empty(3)
pp._read_kernel[(3,)](flat, out, 3000, CHUNK=1024, BLOCK=256)
ref = torch.stack([flat[i * 1024:(i + 1) * 1024].float().sum() for i in range(3)])
assert torch.allclose(out, ref, atol=1e-2), (out, ref)
print("interp-ok")
"""


def test_probe_kernels_interpreted():
    run_interpreted(_SCRIPT)


def _compile(fn, consts, ptrs, stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, "i32")) for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={}),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=stages))


@pytest.mark.parametrize("stages", [3, 4])
def test_probe_kernels_compile_for_sm90(stages):
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import proj_probe as pp
    tma = re.compile(r"cp\.async\.bulk\.tensor")
    k = _compile(pp._tile_read_kernel, dict(BLOCK_N=32, BLOCK_K=128, STAGES=stages),
                 {"w_desc": "tensordesc<bf16[32, 128]>", "out_ptr": "*fp32"}, stages)
    assert len(tma.findall(k.asm["ptx"])) == stages, "the tile-load loop is not pipelined"
    k = _compile(pp._loop_only_kernel, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8),
                 {"x_desc": "tensordesc<bf16[16, 128]>", "w_desc": "tensordesc<bf16[32, 128]>",
                  "part_ptr": "*fp32"}, stages)
    ptx = k.asm["ptx"]
    assert "atom." not in ptx  # no counter: the main loop alone
    assert len(tma.findall(ptx)) == 2 * stages  # x and w boxes, pipelined
