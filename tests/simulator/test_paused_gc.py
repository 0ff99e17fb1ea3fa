"""simulate_plan pauses the cyclic collector and lets its task graph go before it resumes, so
the collector's first pass after the call does not walk the task graph's records
(simulator/simulate.py, ``simulate_plan``: after a GPT-3 175B simulation at 1,024 GPUs that
pass walked millions of records)."""

from __future__ import annotations

import gc

from simulator.simulate import simulate_plan
from simulator.taskgraph import TaskGraph
from strategies.megatron import megatron
from tests.conftest import traced


def test_the_collector_resumes_after_the_task_graph_is_let_go():
    graph = traced("gpt", batch_size=16)
    plan = megatron(graph, 16, tp=2, pp=2, microbatches=4)
    young: list[list] = []

    def first_pass(phase, info):
        if phase == "start" and not young:
            young.append(gc.get_objects(generation=0))

    gc.collect()
    gc.callbacks.append(first_pass)
    try:
        result = simulate_plan(graph, plan, "p100-4x4", "analytical", fold=False)
        [None for _ in range(2000)]  # allocations enough to start a young collection
        gc.collect(0)
    finally:
        gc.callbacks.remove(first_pass)
    assert result.num_tasks > 4_000 and young
    # what outlives the call (the result, the plan's lowering memo) is there, the task graph not
    assert not [o for o in young[0] if isinstance(o, TaskGraph)]
