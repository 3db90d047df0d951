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


def _seen(selector, hidden, z, anchor, k):
    """What a check graph records, made with the reference ops (the op namespace recorded)."""
    import torch
    from dflash_ops.bench.dflash2_step import _Recording

    class RefOps:
        @staticmethod
        def row_topk(z, k):
            from dflash_ops.ops.select import row_topk_ref
            return row_topk_ref(z, k)

        @staticmethod
        def select_candidates(*a):
            from dflash_ops.ops.select import select_candidates_ref
            return select_candidates_ref(*a)

    rec = _Recording(RefOps)
    pred, succ, proj = selector
    r, j, v = z.shape
    unary, cand = rec.row_topk(z.reshape(r * j, v), k)
    path, _ = rec.select_candidates(unary.view(r, j, k), cand.view(r, j, k), hidden @ proj.T,
                                    anchor, pred, succ, 0.0, None)
    assert set(rec.seen) == {"z", "top_vals", "top_idx", "walk", "path"}
    assert rec.seen["path"] is not path and torch.equal(rec.seen["path"], path)  # clones
    return rec.seen


def test_selector_agreement_checks_the_graphs_own_topk_and_walk():
    import torch
    from dflash_ops.bench.dflash2_step import selector_agreement
    selector, hidden, z, anchor, k = _walk_case()
    seen = _seen(selector, hidden, z, anchor, k)
    ok, err, note = selector_agreement(seen, selector, z, z, tol=0.01)
    assert ok and err == 0 and "in 0 of 3 requests" in note
    # a path step that is not the walk's argmax
    bad = dict(seen, path=seen["path"].clone())
    bad["path"][1, 2] = (bad["path"][1, 2] + 1) % 40
    ok, _, note = selector_agreement(bad, selector, z, z, tol=0.01)
    assert not ok and "in 1 of 3 requests" in note
    # a top-k that lost a candidate
    bad = dict(seen, top_idx=seen["top_idx"].clone())
    bad["top_idx"][0, -1] = (bad["top_idx"][0, -1] + 1) % 40
    ok, _, note = selector_agreement(bad, selector, z, z, tol=0.01)
    assert not ok and "top-k != reference" in note
    # logits beyond the tolerance fail however the selector compares
    ok, _, _ = selector_agreement(seen, selector, z + 0.5, z, tol=0.01)
    assert not ok
    ok, _, _ = selector_agreement(seen, selector, z.clone().fill_(float("nan")), z, tol=0.01)
    assert not ok


def test_cases_option_parses_and_names_bad_input():
    import argparse

    import pytest

    from dflash_ops.bench import dflash2_step as ds
    from dflash_ops.bench.harness import _parser

    assert ds._cases("1x1024, 64X8192") == [(1, 1024), (64, 8192)]
    for bad in ("1024", "0x1024", "1x", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxS|need B"):
            ds._cases(bad)
    a = _parser(ds).parse_args(["dflash2-step", "--cases", "8x1024"])
    assert a.cases == [(8, 1024)]


def test_rounds_alternate_and_report_the_median_round():
    from dflash_ops.bench import dflash2_step as ds

    assert ds.round_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert ds.round_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["b", "c", "a"]]
    assert ds.round_orders(["a", "b"], 1) == [["a", "b"]]
    assert ds.round_orders([], 2) == [[], []]
    rounds = [{"us": u, "p20": u - 1, "samples": 10} for u in (5.0, 9.0, 7.0)]
    got = ds.median_round(rounds)
    assert got["us"] == 7.0 and got["p20"] == 6.0 and got["rounds"] == [5.0, 9.0, 7.0]
    # an even count takes the lower middle round, a single round itself
    assert ds.median_round(rounds + [{"us": 1.0}])["us"] == 5.0
    assert ds.median_round(rounds[1:2])["us"] == 9.0


def test_rounds_option_parses_and_names_bad_input():
    import argparse

    import pytest

    from dflash_ops.bench import dflash2_step as ds
    from dflash_ops.bench.harness import _parser

    assert _parser(ds).parse_args(["dflash2-step", "--rounds", "5"]).rounds == 5
    assert _parser(ds).parse_args(["dflash2-step"]).rounds == 3
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 1"):
            ds._rounds(bad)
