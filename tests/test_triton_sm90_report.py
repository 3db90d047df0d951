"""benchmarks/triton_sm90_report.py: the Triton block-attention kernel compiled for sm_90 on
any machine (no GPU): Hopper tensor cores, and its K/V stages taking effect."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_attention_kernel_uses_wgmma_and_its_stages():
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import triton_sm90_report as rep
    finally:
        sys.path.pop(0)
    two, three = rep.compile_attention(64, 2, 4), rep.compile_attention(64, 3, 4)
    assert two["wgmma"] > 0 and two["mma.sync"] == 0 and two["cp.async"] > 0, two
    # a third K/V stage of 64 keys x 128 x 2 (K and V) x 2 bytes: 32 KB more shared memory
    # (with the block table read inside the loop the stages did not take effect)
    assert three["shared_bytes"] - two["shared_bytes"] == 32 * 1024, (two, three)


def test_attention_kernel_waits_for_its_prior_grid_when_launched_as_a_dependent():
    """PDL (triton/_pdl.py): with PDL set the kernel waits for the prior grid
    (griddepcontrol.wait); without it, no wait."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import triton_sm90_report as rep
    finally:
        sys.path.pop(0)
    assert rep.compile_attention(64, 2, 4, pdl=True)["griddepcontrol.wait"] >= 1
    assert rep.compile_attention(64, 2, 4)["griddepcontrol.wait"] == 0


@pytest.mark.parametrize("combine", [False, True], ids=["attn", "combine"])
def test_attention_kernels_compile_for_a_group_that_is_not_a_power_of_two(combine):
    """GQA 5 (Hq 40 / Hkv 8): the tile pads the group to 8 rows a token and masks the padding;
    both kernels compile for sm_90 (the split offsets in int64), the attention on wgmma."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import triton_sm90_report as rep
    finally:
        sys.path.pop(0)
    r = rep.compile_attention(64, 2, 4, g=5, combine=combine)
    if not combine:
        assert r["wgmma"] > 0 and r["mma.sync"] == 0, r
