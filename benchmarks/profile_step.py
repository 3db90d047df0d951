"""Where a drafter / verify / decode step spends its GPU time: torch.profiler kernel tables.

    python benchmarks/profile_step.py [--rows 18] [--graph] [--exact]
        [--cases drafter:1x1024,drafter:8x1024,verify:8x1024,decode:1x1024]
    python benchmarks/profile_step.py --graph --cases dflash2:1x1024

Each case builds the Qwen3-8B-shaped models of the drafter / e2e suites (random bf16 weights),
runs the step eagerly (default backends) twice to warm up, then profiles 3 steps and prints the
kernels by self CUDA time (per step) and the step's total. ``--graph`` also profiles the CUDA
graph replay (kernels inside graphs show up where CUPTI reports them). ``--exact``: each
verify / decode case profiled again in exact mode (speculator.exact_mode), for where exact mode's
cost goes. ``dflash2:BxS``: the DFlash 2 draft step at Qwen3.8-27B-DFlash2 shapes and its DFlash
twin (bench dflash2-step's two variants: no convolutions, no selector), one after the other, so
the kernels the conv and selector add sit beside the twin's (``--twin-first``: the twin first).
Needs CUDA.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

STEPS = 3


def table(prof, rows: int, title: str) -> None:
    # kernels only (device events): CPU ops (aten::mm, dflash::...) also carry their kernels'
    # device time and would count it twice
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
           and e.self_device_time_total > 0]
    evs.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in evs) / STEPS
    print(f"\n== {title}: GPU time {total:.1f} us a step (sum of kernel self times)")
    print(f"{'us/step':>9} {'%':>6} {'calls/step':>10}  kernel")
    for e in evs[:rows]:
        us = e.self_device_time_total / STEPS
        print(f"{us:9.1f} {100 * us / total:6.1f} {e.count / STEPS:10.1f}  {e.key[:110]}")


def run_prof(fn, rows: int, title: str) -> None:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    table(prof, rows, title)


def drafter_case(batch: int, context: int, rows: int, graph: bool) -> None:
    from dflash_ops.bench import drafter as bd

    cfg = bd.drafter_config()
    dev = torch.device("cuda")
    state, embed, head = bd.random_weights(cfg, dev)
    d = bd.build_drafter(cfg, state, embed, head, batch, context, dev)
    inp = bd.step_inputs(cfg, batch, context, dev)
    run_prof(lambda: bd.eager_step(d, inp), rows, f"drafter eager B={batch} S={context}")
    if graph:
        step, bucket = bd.graph_step(d, inp, batch)
        run_prof(lambda: step.run(bucket), rows, f"drafter graph B={batch} S={context}")


def dflash2_case(batch: int, context: int, rows: int, graph: bool,
                 twin_first: bool = False) -> None:
    from dflash_ops.bench import drafter as bd
    from dflash_ops.bench import dflash2_step as d2
    from dflash_ops.models.config import DFlashConfig

    dev = torch.device("cuda")
    cfg2 = DFlashConfig.from_dict(d2.QWEN38_27B_DFLASH2, source="Qwen3.8-27B-DFlash2")
    state2, embed, head = bd.random_weights(cfg2, dev)
    twin = DFlashConfig.from_dict(d2.dflash_twin(d2.QWEN38_27B_DFLASH2), source="twin")
    state1 = {k: v for k, v in state2.items()
              if "conv" not in k and not k.startswith("candidate_selector")}
    def one(name, cfg, state):
        d = bd.build_drafter(cfg, state, embed, head, batch, context, dev)
        inp = bd.step_inputs(cfg, batch, context, dev, new=cfg.block_size)
        run_prof(lambda: bd.eager_step(d, inp), rows, f"{name} eager B={batch} S={context}")
        if graph:
            step, bucket = bd.graph_step(d, inp, batch)
            run_prof(lambda: step.run(bucket), rows, f"{name} graph B={batch} S={context}")
            step.close()

    order = [("dflash2", cfg2, state2), ("dflash twin", twin, state1)]
    for name, cfg, state in order[::-1] if twin_first else order:
        one(name, cfg, state)
        bd._free("cuda")


def target_case(kind: str, batch: int, context: int, rows: int, graph: bool, models,
                exact: bool = False) -> None:
    from dflash_ops.bench import e2e
    from dflash_ops.ops.select import argmax_last
    from dflash_ops.speculator import exact_mode

    target, drafter = models
    b = 16 if kind == "verify" else 1
    max_len = context + 32
    per_req = -(-max_len // e2e.KV_BLOCK)
    e2e.install_caches(target, drafter, batch + 1, batch * per_req + 1, max_len)
    for r in range(batch):
        target.add_request(r, max_len)
    dev = target.device
    ra = torch.arange(batch, device=dev)
    st = torch.full((batch,), context, dtype=torch.long, device=dev)
    n = torch.full((batch,), b, dtype=torch.long, device=dev)
    ids = torch.randint(0, 1000, (batch * b,), device=dev)
    taps = drafter.cfg.target_layer_ids

    def fn():  # as the loop's greedy step: the drafter's taps, model-dtype logits, argmax
        logits, _ = target.forward(ids, ra, st, n, taps, fp32_logits=False)
        return argmax_last(logits)
    mode = " exact" if exact else ""
    with exact_mode(target, exact):
        run_prof(fn, rows,
                 f"target {kind}{mode} eager B={batch} S={context} ({b} tokens a request)")
        if graph:
            from dflash_ops import dispatch
            g, _ = dispatch.capture_graph(fn)
            run_prof(g.replay, rows, f"target {kind}{mode} graph B={batch} S={context}")
    e2e.release_caches(target, drafter)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="drafter:1x1024,drafter:8x1024,verify:8x1024,decode:1x1024")
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--exact", action="store_true",
                    help="profile each verify / decode case in exact mode too")
    ap.add_argument("--twin-first", action="store_true",
                    help="dflash2 cases: profile the DFlash twin before the DFlash 2 step (is "
                         "a kernel's difference between them the order they ran in?)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs CUDA")
    models = None
    for case in a.cases.split(","):
        kind, shape = case.split(":")
        batch, context = (int(x) for x in shape.lower().split("x"))
        if kind == "drafter":
            drafter_case(batch, context, a.rows, a.graph)
        elif kind == "dflash2":
            dflash2_case(batch, context, a.rows, a.graph, a.twin_first)
        elif kind in ("verify", "decode"):
            if models is None:
                from dflash_ops.bench import e2e
                models = e2e.build_models(e2e.qwen3_8b_target_config(),
                                          e2e.qwen3_8b_dflash_config())
            for exact in (False, True) if a.exact else (False,):
                target_case(kind, batch, context, a.rows, a.graph, models, exact)
        else:
            sys.exit(f"--cases: kind must be drafter, dflash2, verify or decode, got {kind!r}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
