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


def _walk_case(seed=0, r=3, j=5, k=4, rank=8, v=40, h=16):
    import torch
    g = torch.Generator().manual_seed(seed)
    selector = (torch.randn(v, rank, generator=g), torch.randn(v, rank, generator=g),
                torch.randn(rank, h, generator=g))
    hidden, z = torch.randn(r, j, h, generator=g), torch.randn(r, j, v, generator=g)
    return selector, hidden, z, torch.randint(0, v, (r,), generator=g), k


def test_walk_margins_follow_the_reference_walk():
    import torch
    from dflash_ops.bench.dflash2_step import walk_margins
    from dflash_ops.ops.select import select_candidates_ref
    (pred, succ, proj), hidden, z, anchor, k = _walk_case()
    unary, cand = torch.topk(z, k, dim=-1)
    path, _ = select_candidates_ref(unary, cand, hidden @ proj.T, anchor, pred, succ, 0.0)
    gap, scale = walk_margins((pred, succ, proj), hidden, z, anchor, path, k)
    assert gap.shape == scale.shape == path.shape
    assert (gap > 0).all() and (scale > 0).all()  # random fp32 scores: no exact ties
    # the walk's first step by hand: its gap is the top-2 difference of the scores
    s0 = unary[:, 0] + torch.einsum("rd,rkd->rk", pred[anchor] * (hidden[:, 0] @ proj.T),
                                    succ[cand[:, 0]])
    top2 = s0.topk(2, -1).values
    torch.testing.assert_close(gap[:, 0], top2[:, 0] - top2[:, 1])


def test_path_agreement_compares_each_path_up_to_its_first_difference():
    import torch
    from dflash_ops.bench.dflash2_step import path_agreement
    want = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    z = torch.ones(2, 4, 10)
    gap = torch.tensor([[1.0, 0.001, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    scale = torch.zeros(2, 4)
    z2 = z.clone()
    z2[0, 1, 0] = 0.01  # the perturbation (max |dz| 0.01) where the first path parts
    ok, err, note = path_agreement(want, z2, want, z, gap, scale, tol=1.0)
    assert ok and "0 of 2 requests part" in note
    # request 0 parts at a near tie (gap 0.001 <= 2 x 0.01) and differs everywhere after it
    parted = torch.tensor([[1, 9, 9, 9], [5, 6, 7, 8]])
    ok, _, note = path_agreement(parted, z2, want, z, gap, scale, tol=1.0)
    assert ok and "1 of 2 requests part, 0 not at a near tie" in note
    # request 1 parts where the reference walk's gap is wide: wrong
    wrong = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 8]])
    ok, _, note = path_agreement(wrong, z2, want, z, gap, scale, tol=1.0)
    assert not ok and "1 not at a near tie" in note
    # logits beyond the tolerance fail however the paths compare
    ok, _, _ = path_agreement(want, z2 + 1.0, want, z + 0.5, gap, scale, tol=0.1)
    assert not ok
