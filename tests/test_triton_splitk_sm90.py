"""The split-K skinny GEMM (``triton.context._proj_splitk_kernel``) compiled for sm_90 on any
machine (no GPU), with the arguments the JIT specialises at decode shapes (T = 1, one M tile,
one N tile, unit strides: ints equal to 1 become constexprs, which the interpreter never
does: ``NUM_M.to(...)`` compiled in the interpreter and failed here), through TMA descriptors
and through pointers; the tile counter's atomic is acq_rel at GPU scope after a barrier. The
serial launch (exact mode at many tiles) compiles too, with no atomics, its slice sum a
separate add after each slice's dot chain (not folded into the dots' accumulator, which
would change the bits against the parallel launch), and its loads pipelined."""
from __future__ import annotations

import re

import pytest

# (TMA, the JIT's specialisations of a one-row call)
CASES = [(True, False), (True, True), (False, False), (False, True)]


def _compile(tma: bool, ones: bool, serial: bool = False, pdl: bool = False,
             add_norm: bool = False, prefetch: int = 0):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_ops.triton import context as tc
    fn = tc._proj_splitk_kernel
    consts = dict(SPLIT=4, SERIAL=serial, TMA=tma, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=32,
                  BLOCK_K=128, GROUP_M=8, ADD_NORM=add_norm, PREFETCH=prefetch, PDL=pdl)
    if ones:
        consts.update(T=1, NUM_M=1, NUM_N=1, x_st_k=1, w_st_k=1, b_st=1)
    ptrs = {"x_ptr": "tensordesc<bf16[16, 128]>" if tma else "*bf16",
            "w_ptr": "tensordesc<bf16[32, 128]>" if tma else "*bf16",
            "wp_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
            "cnt_ptr": "*i32",
            "res_ptr": "*bf16", "nw_ptr": "*bf16", "ss_ptr": "*fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "i32")
        aligned = ("wp_ptr", "b_ptr", "out_ptr", "part_ptr", "cnt_ptr", "res_ptr", "nw_ptr",
                   "ss_ptr", "H", "KS", "x_st_m", "w_st_n", "o_st_m") + \
            (() if tma else ("x_ptr", "w_ptr"))  # JIT: 16-byte aligned
        if name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=4, launch_pdl=pdl))
    return k


@pytest.mark.parametrize("tma,ones", CASES)
def test_splitk_kernel_compiles_for_sm90(tma, ones):
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile(tma, ones).asm["ptx"]
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx), "counter atomic not acq_rel.gpu"
    assert "bar.sync" in ptx or "barrier.sync" in ptx
    assert re.search(r"atom\.global\.(gpu\.)?(relaxed\.)?(gpu\.)?exch", ptx), "no counter reset"


@pytest.mark.parametrize("tma", [True, False])
def test_splitk_add_norm_compiles_for_sm90(tma):
    """o_proj's split-K launch with the folded norm's epilogue (ADD_NORM: the residual read,
    added and written back, u and the tile's sum of squares stored) by the tile's last
    program only: the loads and stores of res / u / ss sit after the counter's atomic."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile(tma, True, add_norm=True).asm["ptx"]
    plain = _compile(tma, True).asm["ptx"]
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    assert ptx.count("st.global") > plain.count("st.global")  # residual, u and ss stored
    assert ptx.rfind("ld.global") > atom  # the residual read after the counter


@pytest.mark.parametrize("tma", [True, False])
def test_serial_splitk_compiles_for_sm90(tma):
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    k = _compile(tma, True, serial=True)
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    assert "atom." not in ptx, "the serial launch touches the counters"
    # the slice loop carries the fp32 total; a dot-chain result is added to it once a slice
    loops = re.findall(r"%(\w+) = scf\.for ", ttgir)
    assert "total" in loops, loops
    assert re.search(r"%total\w* = arith\.addf %total\w*, ", ttgir), "slice sum not a plain add"
    if not tma:  # cp.async ring (the pointer path's pipelining)
        assert "async_copy_global_to_local" in ttgir


def test_splitk_kernel_as_a_programmatic_dependent():
    """PDL (triton/_pdl.py): the wait for the prior grid comes before the kernel's first
    global load, store or atomic; none without PDL."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile(False, True, pdl=True).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    first = min(i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.global",
                                                     "cp.async")) if i >= 0)
    assert wait < first, "a global access before the wait"
    assert "griddepcontrol" not in _compile(False, True).asm["ptx"]


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_splitk_kernel_prefetches_its_weight_before_the_wait(serial, tma):
    """PREFETCH (PDL launches): the program's weight slice is prefetched into L2, a line at a
    time, before the wait for the prior grid (the weight never comes from that grid), and
    nothing else is read, written or copied before the wait; no prefetch with PREFETCH 0."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile(tma, True, serial=serial, pdl=True, prefetch=2).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    pre = [m.start() for m in re.finditer(r"prefetch\.global\.L2", ptx)]
    assert pre and max(pre) < wait, "no prefetch before the wait"
    rest = re.sub(r"prefetch\.global\.L2", "", ptx[:wait])
    assert not re.search(r"ld\.global|st\.global|atom\.global|cp\.async", rest), \
        "a global access other than the prefetch before the wait"
    assert "prefetch" not in _compile(tma, True, serial=serial, pdl=True).asm["ptx"]


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_splitk_kernel_triggers_its_dependents_after_its_main_loop(serial, tma):
    """PDL: griddepcontrol.launch_dependents after the wait and after the K loop's last
    tensor-core instruction (the next grid launches while this one stores; it still waits
    for this whole grid to complete); none without PDL."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile(tma, True, serial=serial, pdl=True).asm["ptx"]
    trig = ptx.index("griddepcontrol.launch_dependents")
    assert ptx.index("griddepcontrol.wait") < trig
    mmas = [m.start() for m in re.finditer(r"wgmma\.mma_async|mma\.sync", ptx)]
    assert mmas, "no tensor-core instruction"
    assert max(mmas) < trig, "the trigger before the main loop's end"
    assert "launch_dependents" not in _compile(tma, True, serial=serial).asm["ptx"]
