"""The copy fold (``simulator.fold``) equals the per-device simulation on random megatron T4 P2
plans with random ZeRO-1 and recompute (``random_plan``), GPipe and 1F1B, at 16 and 64
devices: iteration time, busy time per device, peak memory per device and bytes per link kind.

GPT's position table is a weight op on device 0 alone, whose zero-duration steps copy 0's
device 0 runs and its images do not. The plans hold what that takes to stay alike on every
copy: a step's calls and receives wait on what the host runs before the step, the bucket
packs included (``simulator.step_order.before_inside``), and a weight op's steps hold no device
(they do no work), so they delay nothing, with a collective overhead
(``DeviceSpec.collective_overhead``) too."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from simulator.symmetry import find_copies
from strategies.lowering import lower
from tests.conftest import traced
from tests.simulator.test_fold_members_sim import assert_same
from tests.strategies.test_lowering_members import random_plan

CASES = [(2, 16), (0, 16), (8, 16), (2, 64), (4, 64), (5, 64), (6, 64), (12, 64)]
"""(seed, devices): random plans on which a fold without those two rules differs from the
per-device simulation (``benchmarks/fold_exact.py`` prints the gaps), both schedules among them."""


OVERHEAD = [(0, 16), (5, 16), (0, 64), (5, 64)]
"""(seed, devices) simulated with a collective overhead of 20 us per member."""


def _overhead(topo: Topology, seconds: float) -> Topology:
    return Topology(f"{topo.name}-overhead", tuple(dataclasses.replace(d, collective_overhead=seconds)
                                                   for d in topo.devices), topo.links, topo.routes)


@pytest.mark.parametrize("seed,n,overhead", [(s, n, 0.0) for s, n in CASES] + [(s, n, 2e-5) for s, n in OVERHEAD],
                         ids=[f"random-{s}-{n}" for s, n in CASES] + [f"random-{s}-{n}-overhead" for s, n in OVERHEAD])
def test_copy_fold_equals_per_device(seed, n, overhead):
    graph, topo = traced("gpt", "small"), get_topology({16: "a100-2x8", 64: "a100-8x8"}[n])
    if overhead:
        topo = _overhead(topo, overhead)
    plan = random_plan(graph, n, seed)
    copies = find_copies(graph, plan)
    assert copies is not None and copies.count == n // 8
    full = simulate_plan(graph, plan, topo, fold=False)
    folded = simulate_plan(graph, lower(graph, plan, copies=copies), topo, fold=True)
    assert folded.num_tasks < full.num_tasks  # folded on the copies, not fallen back
    assert_same(folded, full)
    assert_same(simulate_plan(graph, plan, topo, fold=True), full)  # the member fold (or its named fallback)


def test_schedules_covered():
    """The cases hold GPipe and 1F1B plans at both sizes."""
    graph = traced("gpt", "small")
    got = {(n, random_plan(graph, n, seed).schedule) for seed, n in CASES}
    assert got == {(16, "gpipe"), (16, "1f1b"), (64, "gpipe"), (64, "1f1b")}
