"""Issue 18's policy grid, simulated (benchmarks/policy_sim.py: the real Policy driven as the
loop drives it, the H200's measured iteration costs, the bench's oracle and order of runs):
the policy within 3% of the better of always drafting and never drafting at every point, over
noise seeds. The policy before session 23's fixes fails it (B 8 x 1k p 0.2: 0.961; B 1 x 8k
p 0.4: 0.83-0.96, as measured on the H200 at those points: 0.961, 0.965)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "policy_sim", Path(__file__).resolve().parent.parent / "benchmarks" / "policy_sim.py")
sim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sim)


@pytest.mark.parametrize("name", sorted(sim.CASES))
def test_policy_within_3_percent_of_the_better_strategy(name):
    worst = {p: min(sim.case(name, seed)[p] for seed in range(15)) for p in sim.P_GRID}
    assert all(v >= 0.97 for v in worst.values()), worst


def test_simulation_reproduces_the_oracle_counts():
    # the prefill commits a request's first token, the iterations the other 127; always
    # drafting commits each request's accepted run + 1 an iteration, as the oracle dictates
    n, context, *costs = sim.CASES["B1x1k"]
    u = sim.oracle_uniforms(n, context)
    rate, counts = sim.run("always", n, context, 0.0, u, costs, sim.PolicyMemory(),
                           sim.random.Random(0), 0.0)
    assert counts == {sim.BLOCK: sim.NEW - 1}  # p 0: one token a block
    assert rate == pytest.approx(sim.NEW / ((sim.NEW - 1) * costs[0] / 1e3))
    _, counts = sim.run("always", n, context, 1.0, u, costs, sim.PolicyMemory(),
                        sim.random.Random(0), 0.0)
    assert counts == {sim.BLOCK: 8}  # every draft right: 16 a block, the last cut to 15
    _, counts = sim.run("never", n, context, 0.0, u, costs, sim.PolicyMemory(),
                        sim.random.Random(0), 0.0)
    assert counts == {1: 32}  # 31 iterations of four steps and a last one of three
