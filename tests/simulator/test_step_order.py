"""The simulator chains each device's steps in the order the executor runs them: for random
plans (every op a random config of ``strategies.config.enumerate_configs`` over 2 to 4
devices) of several tiny zoo models, 1, 2 and 4 micro-batches and both schedules, the order
``build_tasks`` chains (``simulator.tasks.device_steps``) equals
``strategies.schedule.device_order``, and the simulated timeline runs each device's steps one
after another in that order."""

from __future__ import annotations

import dataclasses
import random

import pytest

from simulator.cost import AnalyticalCostModel
from simulator.engine import event_times
from simulator.presets import get_topology
from simulator.tasks import build_tasks, device_steps
from simulator.topology import Topology
from strategies.config import enumerate_configs
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.pieces import check_microbatches
from strategies.schedule import Step, device_order
from strategies.strategy import Strategy
from tests.conftest import traced

MODELS = ("mlp", "alexnet", "gpt", "nmt", "rnntc")
SEEDS = 4


def _with_overheads(topo: Topology) -> Topology:
    """``topo`` with host overheads and sends that hold their senders, so receive and send
    tasks sit in the devices' schedules too."""
    devices = tuple(dataclasses.replace(d, task_overhead=3e-5, message_overhead=2e-5, exchange_overhead=3e-5,
                                        collective_overhead=4e-5) for d in topo.devices)
    links = tuple(dataclasses.replace(k, send_bandwidth=5e9, send_latency=1e-5) for k in topo.links)
    return Topology(topo.name + "+overheads", devices, links, topo.routes)


TOPOLOGY = _with_overheads(get_topology("p100-1x4"))
COST = AnalyticalCostModel()


def _random_plan(graph, rng: random.Random, microbatches: int, schedule: str) -> Strategy:
    n = rng.choice((2, 3, 4))
    return Strategy.of({node.name: rng.choice(list(enumerate_configs(node, n, microbatches))) for node in graph},
                       n, microbatches, schedule)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("microbatches,schedule", [(1, "gpipe"), (2, "gpipe"), (2, "1f1b"), (4, "gpipe"),
                                                   (4, "1f1b")])
def test_simulated_step_order_is_the_executors(name, microbatches, schedule):
    graph = traced(name)
    try:
        check_microbatches(graph, microbatches)
    except PlanError as e:
        pytest.skip(f"{name} mixes samples across {microbatches} micro-batches: {e}")
    rng = random.Random(f"{name}/{microbatches}/{schedule}")
    for _ in range(SEEDS):
        lowered = lower(graph, _random_plan(graph, rng, microbatches, schedule))
        tg = build_tasks(lowered, TOPOLOGY, COST)
        order = device_order(lowered)
        assert device_steps(tg) == order
        assert sum(map(len, order.values())) == 2 * sum(len(parts) for per_mb in lowered.partitions.values()
                                                        for parts in per_mb)
        start, end = event_times(tg)
        task = {name: t for t, name in enumerate(tg.name) if isinstance(name, tuple) and len(name) == 4}
        for steps in order.values():
            ids = [task[("bwd" if s.backward else "fwd", s.op, s.index, s.microbatch)] for s in steps]
            assert all(start[b] >= end[a] for a, b in zip(ids, ids[1:]))


def test_device_steps_reads_the_order_back_by_name():
    graph = traced("mlp")
    rng = random.Random(1)
    lowered = lower(graph, _random_plan(graph, rng, 2, "1f1b"))
    steps = device_steps(build_tasks(lowered, TOPOLOGY, COST))
    assert steps and all(isinstance(s, Step) for per_device in steps.values() for s in per_device)
    for per_device in steps.values():  # each partition's forward and its backward, once per micro-batch
        assert sorted((s.op, s.index, s.microbatch) for s in per_device if s.backward) == \
            sorted((s.op, s.index, s.microbatch) for s in per_device if not s.backward)
