"""One walk of one-op proposals checking delta = full (the search's Evaluator against a
from-scratch simulation), shared by the tests of plan settings the walk keeps."""

from __future__ import annotations

import random

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies.errors import PlanError
from strategies.lowering import lower_reference


def delta_walk(graph, topology: str, start, levels: tuple[int, ...], seed: int, steps: int = 30,
               cost=None, toggle: float = 0.0) -> list:
    """From plan ``start`` (a function of the device count), ``steps`` proposals each setting a
    weighted op's config (half the time a drawn one) and a level drawn from ``levels`` (with
    probability ``toggle`` instead: its recompute flag switched, its config kept), about half
    kept; asserts delta and full simulation agree to the bit on each valid one and returns
    their reference lowerings. ``cost``: the cost model (default the analytical one)."""
    topo = get_topology(topology)
    n, cost = topo.num_devices, get_cost_model("analytical") if cost is None else cost
    evaluate = Evaluator(graph, topo, cost)
    candidates = candidate_configs(graph, n, 1, topo.node_size)
    ops = [op for op in candidates if any(w.trainable for w in graph[op].weights)]
    rng = random.Random(seed)
    current, compared = start(n), []
    for _ in range(steps):
        op = rng.choice(ops)
        if rng.random() < toggle:
            proposal = current.replace(op, current[op].with_memory(recompute=not current[op].recompute))
        else:
            cfg = rng.choice(candidates[op]) if rng.random() < 0.5 else current[op]
            proposal = current.replace(op, cfg.with_memory(zero=rng.choice(levels)))
        try:
            low = lower_reference(graph, proposal)
        except PlanError:
            continue
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(graph, proposal, topo, cost, summary=True)
        assert (delta.iteration_time, delta.peak_memory_bytes, delta.busy_time, delta.num_tasks) == (
            full.iteration_time, full.peak_memory_bytes, full.busy_time, full.num_tasks)
        compared.append(low)
        if rng.random() < 0.5:
            current = proposal
    return compared


def fold_equals_full(graph, plan, topology: str, cost) -> None:
    """Asserts the folded simulation of ``plan`` (fewer tasks) equals the per-device one
    (``test_fold.assert_same``, Adam)."""
    from tests.simulator.test_fold import assert_same

    full, folded = assert_same(graph, plan, get_topology(topology), "adam", cost)
    assert folded.num_tasks < full.num_tasks
