"""bench.dflash2_step's configs and floor (the timing needs a GPU: gpu_check.sh dflash2)."""
from __future__ import annotations

from dflash_ops.bench.dflash2_step import QWEN38_27B_DFLASH2, dflash_twin, step_cost2
from dflash_ops.bench.drafter import kv_row_elems
from dflash_ops.models.config import DFlashConfig


def cfgs():
    return (DFlashConfig.from_dict(QWEN38_27B_DFLASH2),
            DFlashConfig.from_dict(dflash_twin(QWEN38_27B_DFLASH2)))


def test_twin_lacks_only_conv_and_selector():
    two, one = cfgs()
    assert two.model_type == "dflash2" and one.model_type == "dflash"
    same = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "block_size", "mask_token_id", "rope_theta",
            "target_layer_ids")
    assert all(getattr(two, n) == getattr(one, n) for n in same)
    assert all(one.layer_window(i) == 2048 and not one.layer_causal(i) for i in range(5))
    assert "conv_kernel_size" in QWEN38_27B_DFLASH2["dflash_config"]  # the twin copied


def test_floor_reads_the_window_not_the_context():
    two, one = cfgs()
    kv = lambda c, s: step_cost2(c, 1, s)["bytes"]["K/V read"]  # noqa: E731
    assert kv(one, 131072) == kv(one, 8192) == 1 * (2048 + 8) * kv_row_elems(one) * 2
    assert kv(one, 1024) == (1024 + 8) * kv_row_elems(one) * 2
    # DFlash 2 adds its conv / selector bytes and FLOPs, nothing else changes
    c2, c1 = step_cost2(two, 8, 8192), step_cost2(one, 8, 8192)
    extra = set(c2["bytes"]) - set(c1["bytes"])
    assert extra == {"conv weights", "conv rows", "selector weights", "codebook rows"}
    assert all(c2["bytes"][k] == c1["bytes"][k] for k in c1["bytes"])
    assert c2["total_bytes"] > c1["total_bytes"] and c2["total_flops"] > c1["total_flops"]


def test_suite_is_registered():
    from dflash_ops.bench import SUITES
    assert SUITES["dflash2-step"][0] == "dflash_ops.bench.dflash2_step"
