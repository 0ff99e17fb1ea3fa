"""The memory model's dropped-output points patched from the last plan's (``simulator.memory_walks
._drop_positions``) equal ``strategies.drops.drop_positions`` found afresh, on a walk of
one-op proposals that changes devices, degrees and, now and then, recompute flags."""

import random

from simulator import memory_walks
from simulator.presets import get_topology
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.drops import drop_positions
from tests.conftest import traced


def gpt_walk():
    """gpt (batch 16) on p100-2x2's 4 devices: the graph, each op's candidate configs, the ops
    with more than one, and op -> its position in graph order."""
    graph = traced("gpt", batch_size=16)
    candidates = candidate_configs(graph, 4, 1, get_topology("p100-2x2").node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    return graph, candidates, ops, {node.name: i for i, node in enumerate(graph)}


def test_patched_drop_positions_equal_fresh_ones_on_a_walk(monkeypatch):
    graph, candidates, ops, position = gpt_walk()
    patched = []
    real = memory_walks.drop_positions

    def counted(g, s, p, only=None):
        if only is not None:
            patched.append(len(only))
        return real(g, s, p, only)

    monkeypatch.setattr(memory_walks, "drop_positions", counted)
    rng = random.Random(3)
    current = data_parallel(graph, 4)
    dropping = 0
    for step in range(120):
        op = rng.choice(ops)
        recompute = step >= 80 and rng.random() < 0.3  # the last third toggles recompute too
        proposal = current.replace(op, rng.choice(candidates[op]).with_memory(recompute=recompute))
        got = memory_walks._drop_positions(graph, proposal, position)
        want = drop_positions(graph, proposal, position)
        assert got == want, (step, op, proposal[op].show())
        dropping += len(want)
        if rng.random() < 0.5:
            current = proposal
    assert dropping > 120  # every plan has transient outputs (the walk checks entries, not empty dicts)
    assert len(patched) > 60 and sorted(patched)[len(patched) // 2] < len(graph) // 8  # most patched a few entries
