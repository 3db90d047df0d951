"""Where "never drafting" loses to plain decoding: the loop's decode iteration
(``policy_blocks=(1,)``) against plain graphed decode, at batch and context.

    python benchmarks/never_probe.py [--cases 32x1024,8x8192,1x1024] [--steps 4,8,16]
        [--new 128] [--no-profile]

Session 34 measured never 1.5-2.8% below plain decode (H100, bench policy at p 0: 32 x 1k 3991
vs 4108 tok/s, 8 x 8k 875 vs 891, 32 x 8k 1703 vs 1729), ~0.1-0.3 ms a token step. A decode
iteration runs ``steps_per_read`` graphed steps (``speculator.step.DECODE_STEPS``), adds their
rows to the drafter's context (eager launches) and reads its flags once (the GPU idles while
the host takes the next decision). For each case this prints plain decode's tokens a second
(its own prefill left out) and never's at each ``--steps`` value (median of 3 runs, the
prefill and the capture left out), then, unless ``--no-profile``, one never run at the first
``--steps`` value under torch.profiler: the GPU's busy time (the union of kernel intervals),
its gaps over 20 us (count, total, median: about one an iteration is the host read), and the
kernels by total time (the drafter's context add among them). Qwen3-8B target (counter weights:
every strategy commits the same tokens) and Qwen3-8B-DFlash-b16 drafter, random bf16; the
prefills under bench.policy's fast_prefill. Needs CUDA.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

REPEATS = 3


def steps_per_read(k: int) -> None:
    """DecodeIteration's default tokens between host reads (the loop builds it with the default)."""
    from dflash_ops.speculator.step import DecodeIteration
    DecodeIteration.__init__.__kwdefaults__["steps_per_read"] = k


def gaps(prof, min_us: float = 20.0) -> dict:
    """Busy time (union of the kernels' intervals) and the idle gaps over ``min_us`` between
    them, from a torch.profiler run's device events."""
    iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    if not iv:
        return {}
    merged = [list(iv[0])]
    for s, e in iv[1:]:
        if s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    holes = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    big = [h for h in holes if h > min_us]
    return dict(window_us=merged[-1][1] - merged[0][0], busy_us=sum(e - s for s, e in merged),
                gaps=len(big), gap_us=sum(big),
                gap_median_us=statistics.median(big) if big else 0.0)


def kernels(prof, rows: int = 14) -> list:
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
           and e.self_device_time_total > 0]
    evs.sort(key=lambda e: -e.self_device_time_total)
    return [(e.self_device_time_total, e.count, e.key[:100]) for e in evs[:rows]]


def case(target, drafter, batch: int, context: int, steps: list, n_new: int,
         profile: bool) -> None:
    from dflash_ops.bench import e2e
    from dflash_ops.bench.policy import _loop_rate, case_cache, fast_prefill, plain_rates
    from dflash_ops.speculator.step import DECODE_STEPS

    max_len, blocks = case_cache(batch, context, n_new)
    e2e.install_caches(target, drafter, batch + 1, blocks, max_len, fill=False)
    g = torch.Generator().manual_seed(0)
    vocab = min(target.cfg.vocab_size, drafter.cfg.mask_token_id)
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    label = f"B={batch} S={context}"
    try:
        with fast_prefill(target):
            out, plain = plain_rates(target, prompts, n_new, REPEATS)
            plain_rate = statistics.median(plain)
            print(f"{label}: plain decode {plain_rate:.1f} tok/s "
                  f"({' / '.join(f'{r:.1f}' for r in plain)})", flush=True)
            for k in steps:
                steps_per_read(k)
                _loop_rate(target, drafter, prompts, n_new, policy_blocks=(1,))  # warm-up
                runs = [_loop_rate(target, drafter, prompts, n_new, policy_blocks=(1,))
                        for _ in range(REPEATS)]
                rate = statistics.median(r[1] for r in runs)
                st = runs[0][2]
                same = "same tokens" if runs[0][0] == out else "TOKENS DIFFER from plain"
                print(f"{label}: never, {k} steps a read: {rate:.1f} tok/s "
                      f"({100 * (rate / plain_rate - 1):+.1f}% vs plain; "
                      f"{st.iterations} iterations, {st.host_syncs} host reads; {same})",
                      flush=True)
            if profile:
                from torch.profiler import ProfilerActivity
                steps_per_read(steps[0])
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[ProfilerActivity.CPU,
                                                        ProfilerActivity.CUDA]) as prof:
                    _, rate, st, _ = _loop_rate(target, drafter, prompts, n_new,
                                                policy_blocks=(1,))
                gp = gaps(prof)
                it = max(1, st.iterations)
                print(f"{label}: profiled never run ({steps[0]} steps a read, {rate:.1f} tok/s "
                      f"under the profiler): kernels' window {gp.get('window_us', 0) / 1e3:.2f} "
                      f"ms, busy {gp.get('busy_us', 0) / 1e3:.2f} ms, {gp.get('gaps', 0)} gaps > "
                      f"20 us for {st.iterations} iterations: {gp.get('gap_us', 0) / 1e3:.2f} "
                      f"ms ({gp.get('gap_us', 0) / it:.0f} us an iteration, median gap "
                      f"{gp.get('gap_median_us', 0):.0f} us)", flush=True)
                for us, n, name in kernels(prof):
                    print(f"  {us / it:9.1f} us/iteration {n / it:6.1f} calls/iteration  {name}")
    finally:
        steps_per_read(DECODE_STEPS)  # the loop's own again
        e2e.release_caches(target, drafter)


def main() -> None:
    from dflash_ops.bench import e2e
    from dflash_ops.bench.policy import counter_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="32x1024,8x8192,1x1024")
    ap.add_argument("--steps", default="4,8,16")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    cases = e2e.parse_cases(a.cases, "--cases")
    steps = [int(x) for x in a.steps.split(",")]
    if not steps or min(steps) < 1:
        raise SystemExit(f"never_probe: --steps: expected positive integers, got {a.steps!r}")
    if not torch.cuda.is_available():
        raise SystemExit("never_probe: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    dcfg = e2e.qwen3_8b_dflash_config()
    target, drafter = e2e.build_models(
        e2e.qwen3_8b_target_config(), dcfg,
        edit_target=lambda st: counter_target(st, successor_of=dcfg.mask_token_id))
    for b, s in cases:
        case(target, drafter, b, s, steps, a.new, not a.no_profile)


if __name__ == "__main__":
    main()
