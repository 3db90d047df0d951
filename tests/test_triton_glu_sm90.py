"""``triton.context._kv_proj_kernel`` with the SwiGLU epilogue (GLU), the folded norm's row scale
(RSTD) and the residual add (ADD_NORM) compiled for sm_90 on any machine (no GPU), with the
arguments the JIT specialises at decode shapes (T = 1, one M tile, unit strides): through TMA
descriptors and through pointers. The GLU kernel (two weight tiles of half the N tile a K step
into two accumulators) issues at least the plain kernel's tensor-core instructions and uses an
IEEE division; the folded kernels keep the K loop and store more; the interpreter tests
(tests/test_glu_proj.py) check the values, this checks that the GPU compile exists."""
from __future__ import annotations

import re

import pytest


def _compile(tma: bool, glu: bool = False, rstd: bool = False, add_norm: bool = False,
             pdl: bool = False, persistent: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_ops.triton import context as tc
    fn = tc._kv_proj_kernel
    bn = 32 if glu else 64
    consts = dict(TMA=tma, PERSISTENT=persistent, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=bn,
                  BLOCK_K=128, GROUP_M=8, EVEN_K=True, GLU=glu, LIBDEVICE_EXP=True,
                  ADD_NORM=add_norm, RSTD=rstd, NSSP=128 if rstd else 1, PDL=pdl,
                  T=1, NUM_M=1, x_st_k=1, w_st_k=1, b_st=1)
    ptrs = {"x_ptr": f"tensordesc<bf16[16, 128]>" if tma else "*bf16",
            "w_ptr": f"tensordesc<bf16[{bn}, 128]>" if tma else "*bf16",
            "b_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16",
            "ss_ptr": "*fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = ptrs.get(name, "i32")
        aligned = ("b_ptr", "out_ptr", "res_ptr", "nw_ptr", "ss_ptr", "H", "N", "x_st_m",
                   "w_st_n", "o_st_m") + (() if tma else ("x_ptr", "w_ptr"))
        if name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=4, launch_pdl=pdl))


def _mma(ptx: str) -> int:
    """Tensor-core instructions: wgmma, or mma.sync (what Triton picks for a 16-row tile)."""
    return len(re.findall(r"wgmma\.mma_async|mma\.sync", ptx))


@pytest.mark.parametrize("tma", [True, False])
def test_glu_kernel_compiles_for_sm90(tma):
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    plain = _compile(tma).asm["ptx"]
    glu = _compile(tma, glu=True).asm["ptx"]
    assert _mma(plain) > 0, "the plain GEMM is not on tensor cores"
    # two dots of half the N tile a K step: as many tensor-core instructions as the plain tile
    assert _mma(glu) >= _mma(plain) > 0
    assert "ex2" in glu or "__nv_expf" in glu or "exp" in glu  # libdevice's expf, inlined
    assert re.search(r"div\.rn\.f32", glu), "silu's IEEE division"
    folded = _compile(tma, glu=True, rstd=True, pdl=True).asm["ptx"]
    assert "sqrt" in folded  # the row's rstd
    wait = folded.index("griddepcontrol.wait")
    first = min(i for i in (folded.find(op) for op in ("ld.global", "st.global", "cp.async",
                                                       "cp.async.bulk")) if i >= 0)
    assert wait < first, "a global access before the PDL wait"
    # the next grid may launch once the main loop is over (after its last tensor-core op)
    trig = folded.index("griddepcontrol.launch_dependents")
    mmas = [m.start() for m in re.finditer(r"wgmma\.mma_async|mma\.sync", folded)]
    assert mmas and wait < trig and max(mmas) < trig
    assert "launch_dependents" not in glu
    # the persistent launch (one program an SM walking the tiles) does not trigger
    assert "launch_dependents" not in _compile(tma, glu=True, rstd=True, pdl=True,
                                               persistent=True).asm["ptx"]


@pytest.mark.parametrize("tma", [True, False])
def test_add_norm_epilogue_compiles_for_sm90(tma):
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    plain = _compile(tma).asm["ptx"]
    fold = _compile(tma, add_norm=True).asm["ptx"]
    assert _mma(fold) == _mma(plain)  # the K loop untouched
    assert fold.count("st.global") > plain.count("st.global")  # residual, u, ss
