"""The subgraph move (soapsearch/search/subgraph.py): a connected set of ops on one device set,
whole or cut alike; delta simulation equals full simulation under it, and a search using it is
the same with any number of workers."""

import random

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from soapsearch.search.api import Evaluator, search
from soapsearch.search.mcmc import candidate_configs
from soapsearch.search.moves import Space, neighbor_ops
from soapsearch.search.subgraph import MAX_OPS, SubgraphMoves
from strategies import data_parallel, owt
from tests.conftest import traced


def _moves(graph, topo, m=1):
    candidates = candidate_configs(graph, topo.num_devices, m, topo.node_size)
    return SubgraphMoves(graph, topo.num_devices, Space(candidates), neighbor_ops(graph, candidates), topo.node_size)


def test_a_subgraph_move_places_a_connected_set_on_one_device_set():
    graph = traced("alexnet", batch_size=16)
    topo = get_topology("p100-1x4")
    moves, rng = _moves(graph, topo), random.Random(4)
    start = data_parallel(graph, 4)
    sizes = []
    for _ in range(200):
        plan = moves.propose(start, rng)
        if plan is None:
            continue
        changed = [op for op in plan if plan[op] != start[op]]
        placed = {plan[op].devices for op in changed}
        assert len(placed) == 1 and 1 <= len(changed) <= MAX_OPS
        devices = placed.pop()
        for op in changed:  # whole on one device, or cut len(devices) ways on the sample dim
            node = graph[op]
            assert plan[op].parts == len(devices)
            assert len(devices) == 1 or plan[op].degrees[node.sample_dim] == len(devices)
        # connected along producer / consumer edges
        reached, todo = {changed[0]}, [changed[0]]
        while todo:
            op = todo.pop()
            for other in (*graph[op].inputs, *graph.users(op)):
                if other in changed and other not in reached:
                    reached.add(other)
                    todo.append(other)
        assert reached == set(changed)
        sizes.append(len(changed))
    assert len(sizes) > 100 and max(sizes) >= 5  # sets of several ops, not one op each time


def test_delta_equals_full_under_subgraph_moves():
    graph = traced("resnet101", batch_size=16)
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    evaluate, moves, rng = Evaluator(graph, topo, cost), _moves(graph, topo), random.Random(7)
    current, changed = owt(graph, 4), 0
    for _ in range(60):
        proposal = moves.propose(current, rng)
        if proposal is None:
            continue
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(graph, proposal, topo, cost, summary=True)
        assert delta.iteration_time == full.iteration_time
        assert delta.peak_memory_bytes == full.peak_memory_bytes and delta.memory == full.memory
        assert delta.busy_time == full.busy_time and delta.bytes_moved == full.bytes_moved
        if rng.random() < 0.5:
            changed += 1
            current = proposal
    assert changed >= 15


def test_search_with_subgraph_moves_is_the_same_with_1_and_3_workers():
    g = traced("alexnet", "default")
    kw = dict(topology="p100-1x4", budget_s=None, proposals=240, seed=2, chains=3, subgraph_move=0.5)
    one, three = (search(g, workers=w, **kw) for w in (1, 3))
    assert (one.workers, three.workers) == (1, 3)
    assert one.strategy == three.strategy and one.predicted_ms == three.predicted_ms
    assert (one.proposals, one.accepted) == (three.proposals, three.accepted)
    one.strategy.validate(g)
    assert one.predicted_ms <= min(one.baselines.values()) * (1 + 1e-12)
