"""The policy grid of issue 18 simulated on the CPU: the real ``Policy`` class driven the way
``speculative_generate`` drives it, with iteration costs measured on the H200 and the bench's
oracle (``bench.policy.OracleDrafter``: one uniform per (slot, position), ``torch.rand`` seeded
1234; a draft at a position is right when its uniform is below p), in the bench's order of
runs (per case: never x 3; per p: the acceptance forgotten, always x 3, a policy warm-up run,
policy x 3; medians). It prints policy / max(always, never) per p, median and minimum over
noise seeds (each iteration's cost times 1 + N(0, noise)).

What it models: the block and decode options' costs (a decode iteration of k < 4 steps costs
the fixed part plus k steps), the loop's rules (a cut decode iteration is not observed,
max_new_tokens caps every count, the batch bucket shrinks as requests finish). What it does
not: host time, graph captures, drift between runs (session 19's measured ratios sit ~1%
under the simulation where policy and always choose alike).

    python benchmarks/policy_sim.py [--seeds 30] [--noise 0.01]

Costs (ms; H200, Qwen3-8B, session 20): B 1 x 1k block 6.6, a 4-step decode iteration 20.7,
a decode step 4.94; B 8 x 1k 8.33 / 22.9 / 5.39; B 1 x 8k 7.23 / 22.5 / 5.37.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from dflash_ops.speculator.policy import Policy, PolicyMemory

P_GRID = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)
NEW = 128        # tokens a request (bench policy's NEW_TOKENS)
STEPS = 4        # decode steps an iteration (speculator.step.DECODE_STEPS)
BLOCK = 16       # the drafting option (Qwen3-8B-DFlash-b16)
CASES = {  # name: (batch, context, block ms, 4-step decode iteration ms, decode step ms)
    "B1x1k": (1, 1024, 6.6, 20.7, 4.94),
    "B8x1k": (8, 1024, 8.33, 22.9, 5.39),
    "B1x8k": (1, 8192, 7.23, 22.5, 5.37),
}


def oracle_uniforms(n: int, context: int, new: int = NEW) -> List[List[float]]:
    g = torch.Generator().manual_seed(1234)
    return torch.rand(n + 1, context + new + 1, generator=g).tolist()


def run(mode: str, n: int, context: int, p: float, u, costs: Tuple[float, float, float],
        mem: PolicyMemory, rng: random.Random, noise: float, new: int = NEW):
    """(tokens a second, {option: iterations}) of one generate call of ``mode`` (never /
    always / policy)."""
    block_ms, dec_ms, step_ms = costs
    blocks = {"never": [1], "always": [BLOCK], "policy": [1, BLOCK]}[mode]
    pol = Policy(blocks, n, memory=mem, decode_tokens=STEPS) if len(blocks) > 1 else None
    lengths, done = [context + 1] * n, [False] * n
    act, bucket, total, counts = None, n, 0.0, {}
    while not all(done):
        now = [r for r in range(n) if not done[r]]
        if now != act:
            act = now
            bucket = min(n, 1 << (len(act) - 1).bit_length())
        left = [new - (lengths[r] - context) for r in act]
        b = pol.choose(act, bucket, max(lengths[r] for r in act), left) if pol else blocks[0]
        full = True
        if b == 1:
            todo = max(1, min(STEPS, max(left)))
            full = max(left) >= STEPS
            kept = [min(todo, m) for m in left]
            ms = dec_ms - (STEPS - todo) * step_ms
        else:
            kept = []
            for r, m in zip(act, left):
                acc, start = 0, lengths[r] - 1
                while acc < b - 1 and u[r][min(start + 1 + acc, len(u[r]) - 1)] < p:
                    acc += 1
                kept.append(min(acc + 1, m))
            ms = block_ms
        ms *= 1.0 + rng.gauss(0.0, noise)
        total += ms
        fin = [lengths[r] + k - context >= new for r, k in zip(act, kept)]
        if pol is not None and full:
            pol.observe(b, bucket, max(lengths[r] for r in act), ms / 1e3, act, kept, fin)
        for r, k, f in zip(act, kept, fin):
            lengths[r] += k
            done[r] = done[r] or f
        counts[b] = counts.get(b, 0) + 1
    return n * new / (total / 1e3), counts


def case(name: str, seed: int = 0, noise: float = 0.01, ps=P_GRID) -> Dict[float, float]:
    """policy / max(always, never) at each p for one noise seed."""
    n, context, *costs = CASES[name]
    u = oracle_uniforms(n, context)
    rng, mem = random.Random(seed), PolicyMemory()

    def med(mode, p):
        return statistics.median(run(mode, n, context, p, u, costs, mem, rng, noise)[0]
                                 for _ in range(3))

    never = med("never", 0.0)
    out = {}
    for p in ps:
        mem.forget_acceptance()
        always = med("always", p)
        run("policy", n, context, p, u, costs, mem, rng, noise)  # the bench's warm-up run
        out[p] = med("policy", p) / max(always, never)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--noise", type=float, default=0.01)
    a = ap.parse_args(argv)
    print(f"policy / max(always, never), median / min over {a.seeds} noise seeds "
          f"(noise {a.noise:.0%} an iteration)")
    print("case    " + "  ".join(f"p {p:<11}" for p in P_GRID))
    for name in CASES:
        res = [case(name, s, a.noise) for s in range(a.seeds)]
        cells = [f"{statistics.median(r[p] for r in res):.3f}/{min(r[p] for r in res):.3f}"
                 for p in P_GRID]
        print(f"{name:<7} " + "  ".join(f"{c:<13}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
