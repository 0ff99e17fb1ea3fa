"""One bucket plan per lowering for the task build and the memory model
(``strategies.overlap.bucket_plan``, kept per lowering): over a walk of one-op proposals (drawn
configs and ZeRO levels 0-1, several buckets per device set), each lowering's buckets are
planned once, by the task build, and the memory model's bucket rows read that plan and equal
the rows of a fresh ``bucket_plan`` (no memo) at every step."""

from __future__ import annotations

import random

import numpy as np

import strategies.overlap as overlap
from simulator.cost import get_cost_model
from simulator.memory_collectives import bucket_rows
from simulator.presets import get_topology
from simulator.tasks import TaskCache, build_tasks
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.collective_buffers import bucket_buffers
from strategies.errors import PlanError
from strategies.lowering import lower
from tests.conftest import traced


def _fresh_rows(low, position: dict[str, int], n: int) -> np.ndarray | None:
    """``bucket_rows`` from a ``bucket_plan`` made afresh (no memo, nothing kept)."""
    sizes = bucket_buffers(low)
    if not sizes:
        return None
    out = np.zeros((len(position), n), dtype=np.int64)
    for d, its in overlap.bucket_plan(low)[1].items():
        for issue in its:
            out[position[issue.after.op], d] += sizes[issue.key]
    return out


def test_the_memory_model_reads_the_task_builds_bucket_plan_and_it_equals_a_fresh_one(monkeypatch):
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    n = topo.num_devices
    candidates = candidate_configs(graph, n, 1, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    position = {node.name: i for i, node in enumerate(graph)}
    planned: list = []
    real = overlap._bucket_ops
    monkeypatch.setattr(overlap, "_bucket_ops", lambda low, *a: planned.append(low) or real(low, *a))
    lowering_cache: dict = {}
    tasks = TaskCache(topo, cost)
    rng = random.Random(5)
    current = data_parallel(graph, n).with_bucket_cap(0.01)
    steps = 0
    for _ in range(40):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]).with_memory(
            zero=rng.choice((0, 1)) if any(w.trainable for w in graph[op].weights) else 0))
        try:
            low = lower(graph, proposal, lowering_cache)
        except PlanError:
            continue
        planned.clear()
        build_tasks(low, topo, cost, cache=tasks)
        got = bucket_rows(low, position, n)
        assert planned == [low]  # planned once, by the task build
        planned.clear()
        want = _fresh_rows(low, position, n)
        assert (got is None) == (want is None) and (got is None or np.array_equal(got, want))
        steps += 1
        if rng.random() < 0.5:
            current = proposal
    assert steps >= 30
