"""The compiled event loop (simulator/_events.c) gives the Python loop's start and end times,
bit for bit, on random walks of plans over the zoo, hand-made link contention and a cycle."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.engine import run_events
from simulator.native import library
from simulator.presets import get_topology
from simulator.tasks import TaskGraph, TaskKind, build_tasks
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel, owt
from strategies.lowering import lower
from tests.conftest import traced

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the Python loop runs")


@pytest.mark.parametrize("name,topology,microbatches,schedule", [
    ("resnet101", "p100-2x2", 1, "gpipe"), ("gpt", "k80-2x4", 2, "1f1b"), ("nmt", "p100-4x4", 1, "gpipe"),
    ("rnntc", "p100-2x2", 4, "gpipe"), ("alexnet", "a100-1x8", 2, "1f1b")])
def test_native_loop_equals_python_loop(name, topology, microbatches, schedule):
    graph = traced(name, batch_size=16)
    topo = get_topology(topology)
    n = topo.num_devices
    cost = get_cost_model("analytical")
    candidates = candidate_configs(graph, n, microbatches, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    rng = random.Random(7)
    plan = (data_parallel(graph, n) if rng.random() < 0.5 else owt(graph, n)).with_microbatches(microbatches, schedule)
    for _ in range(40):  # a walk: each plan changes several ops of the one before
        for op in rng.sample(ops, min(4, len(ops))):
            plan = plan.replace(op, rng.choice(candidates[op]))
        tg = build_tasks(lower(graph, plan), topo, cost)
        assert run_events(tg) == run_events(tg, native=False), (name, plan)


def _graph(edges):
    tg = TaskGraph(num_devices=2, num_links=4)
    for duration, res in [(10.0, (3,)), (3.0, (2, 3)), (4.0, (2, 5)), (1.0, (0,)), (2.0, (1,))]:
        tg.add("t", TaskKind.TRANSFER, duration, res, 0)
    for a, b in edges:
        tg.edge(a, b)
    return tg


def test_native_loop_backfills_links_and_names_a_cycle():
    # test_engine's first case: t2 takes A's NIC out while t1 waits for B's NIC in
    assert run_events(_graph([(3, 1), (4, 2)])) == ([0.0, 10.0, 2.0, 0.0, 0.0], [10.0, 13.0, 6.0, 1.0, 2.0])
    with pytest.raises(RuntimeError, match="cycle"):
        run_events(_graph([(3, 1), (4, 2), (2, 4)]))
