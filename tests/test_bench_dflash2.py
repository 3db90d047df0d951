"""``dflash-ops bench dflash2`` on the CPU: a column whose check fails is not timed (it was timed
whatever its error), and the input sets rotate over their input bytes."""
from __future__ import annotations

import pytest
import torch

from dflash_ops.bench import dflash2 as b2
from dflash_ops.bench.harness import Results

pytest.importorskip("triton")


@pytest.fixture
def cpu_suite(monkeypatch):
    timed = []
    monkeypatch.setattr(b2, "DEVICE", "cpu")
    from dflash_ops.bench import columns
    monkeypatch.setattr(columns, "time_fn", lambda fn, **kw: (timed.append(fn),
                                                              {"us": 10.0, "mode": "graph"})[1])
    monkeypatch.setattr(b2, "rotating", lambda make, nbytes: [make()])
    monkeypatch.setattr(b2.dispatch, "has_backend", lambda op, be: be == "triton")
    return timed, Results("dflash2-test", floors={"copy_GBps": 3000.0})


@pytest.mark.parametrize("off", [0.0, 1.0])
def test_a_conv_column_is_timed_only_when_right(cpu_suite, monkeypatch, off):
    from dflash_ops.ops import conv
    timed, res = cpu_suite
    monkeypatch.setattr(conv, "grouped_dyn_conv",
                        lambda x, d, b, gs, blk: conv.grouped_dyn_conv_ref(x, d, b, gs, blk) + off)
    b2._conv(res, (16,), {})
    row = next(r for r in res.rows if r["impl"] == "ours (triton)")
    if off:
        assert row["us"] is None and row["note"].startswith("WRONG") and "not timed" in \
            row["note"], row
    else:
        assert row["us"] == 10.0 and row["err"] == 0.0, row


def test_the_sets_rotate_over_input_bytes(monkeypatch):
    seen = []
    monkeypatch.setattr(b2, "DEVICE", "cpu")
    from dflash_ops.bench import columns
    monkeypatch.setattr(columns, "time_fn", lambda fn, **kw: {"us": 1.0, "mode": "graph"})
    monkeypatch.setattr(b2.dispatch, "has_backend", lambda op, be: False)
    monkeypatch.setattr(b2, "rotating", lambda make, nbytes: (seen.append(nbytes), [make()])[1])
    b2._conv(Results("t", floors={"copy_GBps": 1.0}), (16,), {})
    g = b2.H // b2.GS
    assert seen == [16 * b2.H * 2 + 16 * b2.K * g * 2 + b2.K * b2.H * 2]


def test_the_unfused_pair_is_checked_then_timed(cpu_suite, monkeypatch):
    """conv_add_rms_norm's table on the CPU (torch kernels): the unfused pair passes its check
    (2 bf16 ulps of max |ref|) on copies of the inputs, then is timed."""
    timed, res = cpu_suite
    monkeypatch.setattr(b2.dispatch, "has_backend", lambda op, be: False)
    b2._conv_norm(res, (16,), {})
    row, = [r for r in res.rows if r["table"].startswith("conv_add_rms_norm")]
    assert row["impl"] == "conv + fused_add_rms_norm_" and row["us"] == 10.0, row
    assert not row["note"].startswith("WRONG") and len(timed) == 1, row


@pytest.mark.parametrize("off", [0.0, 1.0])
def test_the_add_norm_alone_column_has_its_own_check(cpu_suite, monkeypatch, off):
    """The twin's add + norm (no conv) column is checked against the add + norm reference, not
    the conv op's: right, it is timed; off by one, it is WRONG and not timed."""
    from dflash_ops.ops import norm
    timed, res = cpu_suite

    def shifted(x, r, w, eps):  # the op as its reference (no backend needed), shifted by off
        norm._fused_add_rms_norm_ref(x, r, w, eps)
        x.add_(off)
    monkeypatch.setattr(norm, "fused_add_rms_norm_", shifted)
    b2._conv_norm(res, (16,), {})
    row, = [r for r in res.rows if r["impl"] == "fused_add_rms_norm_ alone, no conv (triton)"]
    if off:
        assert row["us"] is None and row["note"].startswith("WRONG"), row
    else:
        assert row["us"] == 10.0 and not row["note"].startswith("WRONG"), row
