"""``dflash-ops bench dflash2-step``: one DFlash 2 draft step at Qwen3.8-27B-DFlash2 shapes.

The step (context K/V of a block of newly committed rows + the block forward + LM head + the
candidate selector's walk) of the published config (``QWEN38_27B_DFLASH2``: H 5120, 5 sliding
non-causal layers of window 2048, 32 / 8 heads, D 128, inter 17408, V 248320, block 8; conv
K 2 group 16, selector rank 256 top-k 16), random bf16 weights, under our CUDA graph
(DraftStep), against the same drafter without its convolutions and selector (a DFlash step
of the same shapes: the LM head's argmax instead of the walk) and against the floor.

Cases: B 1 / 8 / 64 x S 1k / 8k and 1 x 131k (with the window the attention reads at most
2048 + 8 keys a row whatever S; the cache still holds S positions). Targets (issue 16): conv +
selector add at most 5% to the DFlash step at batch 1.

floor = max(bytes / copy, FLOPs / GEMM), both measured in this run; bytes = the DFlash step's
(bench.drafter.step_cost with the K/V read cut to the window) + the DFlash 2 extras (the conv
kernel projections and base taps, the selector's hidden projection, the codebook rows the walk
reads, each layer's conv inputs and outputs).
"""
from __future__ import annotations

import copy
import sys
import time

import torch

from .harness import Results, bxs_cases, floor_us, measure_floors, time_fn

# Qwen3.8-27B-DFlash2's config as published (z-lab format; tests/test_models_config.py parses
# it; the non-causal key is is_causal: False).
QWEN38_27B_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False,
    "hidden_size": 5120, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
    "vocab_size": 248320, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048,
    "use_sliding_window": True, "block_size": 8, "num_target_layers": 64, "is_causal": False,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61],
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                      "selector_top_k": 16},
}
CASES = ((1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192), (64, 8192), (1, 131072))
QUICK_CASES = ((1, 1024), (64, 8192), (1, 131072))
VARIANTS = ("dflash2", "dflash (no conv, no selector)")
GRAPH_TOL = 0.02
TITLE = "draft step, Qwen3.8-27B-DFlash2 shapes, bf16, CUDA graph (DraftStep)"
SUMMARY = "summary: us per step (graph replay)"


def dflash_twin(d: dict) -> dict:
    """The same drafter as a DFlash (1) config: no convolutions, no selector."""
    out = copy.deepcopy(d)
    out["architectures"] = ["DFlashDraftModel"]
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        out["dflash_config"].pop(k, None)
    return out


def step_cost2(cfg, batch: int, context: int, itemsize: int = 2) -> dict:
    """bench.drafter.step_cost for this config with the K/V read cut to the window, plus the
    DFlash 2 extras when ``cfg`` has them."""
    from .drafter import kv_row_elems, step_cost
    b = cfg.block_size
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    keys = context if min(windows) < 0 else min(context + b, max(windows) + b)
    cost = step_cost(cfg, batch, keys, new=b, itemsize=itemsize)
    cost["bytes"]["K/V written"] = batch * b * kv_row_elems(cfg) * itemsize
    if cfg.model_type == "dflash2":
        h, k, g = cfg.hidden_size, cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
        rank, top = cfg.selector_rank, cfg.selector_top_k
        rows = batch * b
        extra = {
            "conv weights": cfg.num_layers * 2 * (2 * k * g * h + 2 * k * h),
            "conv rows": cfg.num_layers * 2 * rows * (2 * h + 2 * k * g) * 2,  # prepare+finish
            "selector weights": rank * h,
            "codebook rows": batch * (b - 1) * (top + 1) * rank,
        }
        cost["bytes"].update({n: v * itemsize for n, v in extra.items()})
        cost["flops"]["conv projection"] = 2.0 * cfg.num_layers * 2 * rows * 2 * k * g * h
        cost["flops"]["selector"] = 2.0 * batch * (b - 1) * (rank * h + top * rank)
    cost["total_bytes"] = sum(cost["bytes"].values())
    cost["total_flops"] = sum(cost["flops"].values())
    return cost


class _Recording:
    """Stands in for ``torch.ops.dflash`` in the drafter module while a check graph is captured:
    ``row_topk`` and ``select_candidates`` clone their inputs and outputs as they run, so in a
    captured graph the clones are graph buffers that every replay refreshes with the values
    the graph itself computed."""

    def __init__(self, ops):
        self._ops, self.seen = ops, {}

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def row_topk(self, z, k):
        vals, idx = self._ops.row_topk(z, k)
        self.seen.update(z=z.clone(), top_vals=vals.clone(), top_idx=idx.clone())
        return vals, idx

    def select_candidates(self, unary, cand, hp, anchor, pred, succ, temperature, u):
        path, q = self._ops.select_candidates(unary, cand, hp, anchor, pred, succ,
                                              temperature, u)
        self.seen.update(walk=(unary.clone(), cand.clone(), hp.clone(), anchor.clone()),
                         path=path.clone())
        return path, q


def selector_agreement(seen: dict, selector, logits, want_logits, tol: float) -> tuple:
    """(ok, max |dz|, note) for one replay of a check graph: its logits within ``tol`` x max
    |want| of the eager step's, its top-k exactly ``row_topk_ref`` of its own logits, and its
    path exactly the reference walk over its own walk inputs (the graph's unary scores,
    candidates, hidden projection and anchor). Both sides of each exact check see the same
    numbers, so a near tie of the logits cannot excuse a difference (comparing the graph's
    path with the eager step's would have to: the two differ by rounding, and after one
    different token every later position of a walk differs)."""
    from ..ops.select import row_topk_ref, select_candidates_ref
    pred_cb, succ_cb, _ = selector
    z, w = logits.float(), want_logits.float()
    err = (z - w).abs().max().item()
    limit = tol * w.abs().max().item()
    vals, idx = row_topk_ref(seen["z"], seen["top_idx"].shape[-1])
    top_ok = torch.equal(idx, seen["top_idx"]) and torch.equal(vals, seen["top_vals"])
    unary, cand, hp, anchor = seen["walk"]
    ref_path, _ = select_candidates_ref(unary, cand, hp, anchor, pred_cb, succ_cb, 0.0, None)
    bad = int((ref_path != seen["path"]).any(-1).sum())
    ok = err <= limit and top_ok and bad == 0  # a NaN err fails
    note = (f"max |dz| {err:.3g} (tol {limit:.3g}); top-k {'=' if top_ok else '!='} reference "
            f"on its logits; path != reference walk on its inputs in {bad} of "
            f"{ref_path.shape[0]} requests")
    return ok, err, note


def check_graph(drafter, inp: dict, batch: int) -> tuple:
    """(ok, max |dz|, note): a graph of the step captured with the selector's inputs recorded
    (the capture runs last, so the recording holds the graph's own buffers), replayed once,
    against the eager step (logits) and the reference top-k and walk (``selector_agreement``).
    The timed graph is captured apart, without the recording."""
    from ..models import drafter as drafter_module
    from .drafter import eager_step, graph_step
    want_z = eager_step(drafter, inp)[1].clone()
    rec = _Recording(drafter_module.OPS)
    drafter_module.OPS = rec
    try:
        step, bucket = graph_step(drafter, inp, batch)
    finally:
        drafter_module.OPS = rec._ops
    _, got_z = step.run(bucket)
    torch.cuda.synchronize()
    out = selector_agreement(rec.seen, drafter.selector, got_z, want_z, GRAPH_TOL)
    step.close()  # its scratch slot, for the timed step
    del step, rec
    return out


def _cases(text: str) -> list:
    """``--cases``: comma-separated BxS (B requests x S context tokens), each >= 1."""
    return bxs_cases(text, lambda b, s: None if b >= 1 and s >= 1 else "B >= 1 and S >= 1")


def build_checked(cfg, state, embed, head, batch: int, context: int) -> tuple:
    """((drafter, step, bucket, inp), note) for one variant's graphed step checked against its
    eager step, or (None, why) when the check fails or the build raises."""
    from .drafter import agreement, build_drafter, eager_step, graph_step, step_inputs
    try:
        drafter = build_drafter(cfg, state, embed, head, batch, context, "cuda")
        inp = step_inputs(cfg, batch, context, "cuda", new=cfg.block_size)
        if cfg.model_type == "dflash2":
            ok, _, note = check_graph(drafter, inp, batch)
            step, bucket = graph_step(drafter, inp, batch)
        else:
            want_t, want_z = (x.clone() for x in eager_step(drafter, inp))
            step, bucket = graph_step(drafter, inp, batch)
            got_t, got_z = step.run(bucket)
            ok, _, note = agreement(got_t, got_z, want_t, want_z, GRAPH_TOL)
        if not ok:
            return None, f"WRONG vs eager, not timed: {note}"
        return (drafter, step, bucket, inp), note
    except Exception as e:  # noqa: BLE001 - a broken column is reported
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _rounds(text: str) -> int:
    """``--rounds``: an integer >= 1."""
    import argparse
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--rounds: expected an integer >= 1, got {text!r}")
    return n


def add_options(p) -> None:
    p.add_argument("--cases", type=_cases, default=None, metavar="BxS,...",
                   help="step shapes (B requests x S context tokens, e.g. 1x1024,64x8192); "
                        "default: all (--quick: 1x1024,64x8192,1x131072)")
    p.add_argument("--rounds", type=_rounds, default=3, metavar="N",
                   help="N rounds a case, each building and timing both variants, in "
                        "alternating order; each reports its median round (default 3)")


def round_orders(names, rounds: int) -> list:
    """The order the variants are built and timed in, a list per round: each round starts
    one later than the last (A B, B A, A B, ...), so no variant is always first."""
    names = list(names)
    if not names:
        return [[] for _ in range(rounds)]
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def median_round(ts: list) -> dict:
    """The median of a variant's rounds (each a time_fn dict; the lower middle of an even
    count), with every round's median time in ``"rounds"`` (us, in the order run)."""
    mid = sorted(ts, key=lambda t: t["us"])[(len(ts) - 1) // 2]
    return {**mid, "rounds": [t["us"] for t in ts]}


def run(quick: bool = False, cases=None, rounds: int = 3) -> Results:
    """The suite; ``cases`` [(B, S), ...] replaces the default shapes (results named
    ``dflash2-step-<BxS...>`` then, so a restricted run never overwrites a full one's).
    Each case runs ``rounds`` rounds; a round builds, checks and times both variants in
    ``round_orders``' order; each variant reports its median round."""
    if not torch.cuda.is_available():
        raise RuntimeError("dflash2-step suite: needs a CUDA GPU; nothing was run.")
    from .drafter import random_weights, _free
    from ..models.config import DFlashConfig

    name = "dflash2-step" + ("-quick" if quick else "")
    if cases:
        name = "dflash2-step-" + "-".join(f"{b}x{s}" for b, s in cases)
    res = Results(name, floors=measure_floors(), xlabel="B (requests)")
    timing = dict(warmup_ms=25, rep_ms=150) if quick else dict(warmup_ms=50, rep_ms=400)
    todo = cases or (QUICK_CASES if quick else CASES)
    cfgs = {VARIANTS[0]: DFlashConfig.from_dict(QWEN38_27B_DFLASH2, source="Qwen3.8-27B-DFlash2"),
            VARIANTS[1]: DFlashConfig.from_dict(dflash_twin(QWEN38_27B_DFLASH2),
                                                source="Qwen3.8-27B-DFlash2 without conv")}
    times = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        state2, embed, head = random_weights(cfgs[VARIANTS[0]], "cuda")
        # the twin: the same tensors minus the conv and selector ones
        state1 = {k: v for k, v in state2.items()
                  if "conv" not in k and not k.startswith("candidate_selector")}
        states = {VARIANTS[0]: state2, VARIANTS[1]: state1}
        print(f"[dflash2-step] random weights {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        for b, s in todo:
            label = f"B={b} S={s}"
            costs = {name: step_cost2(cfgs[name], b, s) for name in VARIANTS}
            notes, seen = {name: "" for name in VARIANTS}, {name: [] for name in VARIANTS}
            for order in round_orders(VARIANTS, rounds):
                # a round builds (and checks) the variants in its order, then times them in
                # that order, so neither is always first built or run (session 46 found no
                # effect of either order; the rounds' spread goes into each row's note)
                built = {}
                for name in order:
                    if notes[name].startswith(("WRONG", "failed")):
                        continue
                    got, note = build_checked(cfgs[name], states[name], embed, head, b, s)
                    if got is None or not seen[name]:
                        notes[name] = note
                    if got is not None:
                        built[name] = got
                for name in order:
                    if name in built:
                        step, bucket = built[name][1:3]
                        seen[name].append(time_fn(lambda: step.run(bucket), graph=False,
                                                  **timing))
                print(f"[dflash2-step] {label} round {len(seen[order[0]])}: " + ", ".join(
                    f"{n} {seen[n][-1]['us']:.1f} us" for n in order if n in built),
                    file=sys.stderr, flush=True)
                got = step = bucket = None  # nothing of this round's drafters stays alive
                del built
                _free("cuda")
            for name in VARIANTS:
                t = median_round(seen[name]) if seen[name] else None
                floor = floor_us(res.floors, costs[name]["total_bytes"],
                                 costs[name]["total_flops"])
                note = notes[name]
                if t is not None and len(t["rounds"]) > 1:
                    note = (note + "; " if note else "") + "rounds (us): " + " ".join(
                        f"{u:.1f}" for u in t["rounds"])
                res.add_time(TITLE, label, name, t, bytes_moved=costs[name]["total_bytes"],
                             floor=floor, x=b, note=note)
                times[(b, s, name)] = (t["us"] if t else None, floor)
                print(f"[dflash2-step] {label} {name}: "
                      f"{t['us']:.1f} us" if t else f"[dflash2-step] {label} {name}: {note}",
                      file=sys.stderr, flush=True)
    for b, s in todo:
        (t2, f2), (t1, _) = times[(b, s, VARIANTS[0])], times[(b, s, VARIANTS[1])]
        res.add(SUMMARY, case=f"B={b} S={s}", dflash2=t2, dflash=t1,
                **{"conv + selector add %": 100 * (t2 / t1 - 1) if t1 and t2 else None,
                   "floor (dflash2)": f2, "dflash2 x floor": t2 / f2 if t2 else None})
    res.notes += [
        "one step = the context K/V of 8 newly committed rows a request + the block forward of "
        "[last token, MASK x 7] + LM head on the 7 mask rows + (DFlash 2) top-16 and the "
        "selector walk / (DFlash) argmax; random bf16 weights, target embedding / LM head "
        "random [248320, 5120]",
        "timing: per-call CUDA events around one graph replay (do_bench median, L2 wiped); "
        f"{rounds} rounds a case, each "
        "building and timing both variants, in alternating order; the median round reported",
        "checks before timing: graph vs eager of the same drafter (max |dz| <= 0.02 max |z|; "
        "DFlash: drafts equal outside near ties of the logits; DFlash 2: a check graph records "
        "its own top-k and walk inputs, and its top-k and path must equal the references run "
        "on them exactly); a failing column is not timed",
    ]
    return res
