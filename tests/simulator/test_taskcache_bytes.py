"""A TaskCache's known blocks bounded by their bytes (``taskcache.KNOWN_BYTES``): past the bound
every known block is dropped, its count stays true, and each result equals a full simulation."""

import random

from simulator import taskcache
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.taskcache import block_bytes
from simulator.tasks import build_tasks
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.lowering import lower
from tests.conftest import traced
from tests.search.delta_check import assert_delta_equals_full


def _known(cache) -> list:
    return [b for state in cache._states.values() for known in state[1][3] for b in known.values()]


def test_known_blocks_stay_under_their_bytes_and_results_stay_exact(monkeypatch):
    graph, topo, cost = traced("mlp", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    evaluate(data_parallel(graph, 4))
    block = max(block_bytes(b) for b in evaluate._tasks._states[None][1][2])
    monkeypatch.setattr(taskcache, "KNOWN_BYTES", 3 * block)  # about three blocks held
    candidates = candidate_configs(graph, 4, 1, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    rng, current, counts = random.Random(5), data_parallel(graph, 4), []
    for _ in range(40):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]))
        assert_delta_equals_full(evaluate, proposal, ("mlp", op, proposal[op].show()))
        held = _known(evaluate._tasks)
        assert evaluate._tasks.known_bytes == sum(map(block_bytes, held)) <= 3 * block
        counts.append(len(held))
        if rng.random() < 0.5:
            current = proposal
    assert max(counts) >= 2 and any(b < a for a, b in zip(counts, counts[1:]))  # held, then dropped


def test_a_cache_for_one_call_counts_nothing_and_builds_the_same_graph():
    """``build_tasks`` without a cache makes an uncounted one (``block_bytes.Uncounted``): the
    same graph as a counted cache's, which counts its blocks."""
    graph, topo, cost = traced("mlp", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    low = lower(graph, data_parallel(graph, 4))
    counted, alone = taskcache.TaskCache(topo, cost), taskcache.TaskCache(topo, cost, counted=False)
    one, two = build_tasks(low, topo, cost, cache=counted), build_tasks(low, topo, cost, cache=alone)
    assert counted.held.nbytes > 0 and len(counted.held) > 0
    assert alone.held.nbytes == 0 and len(alone.held) == 0
    assert list(one.name) == list(two.name) and list(one.duration) == list(two.duration)
    assert list(build_tasks(low, topo, cost).name) == list(one.name)
