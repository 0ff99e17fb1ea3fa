"""The step end per proposal from the last plans' (``simulator.step``'s recorded buckets,
``strategies.overlap.bucket_plan``'s memo): over a walk of one-op proposals (each with a drawn
ZeRO level), bucket caps, whole-plan levels 0-3 and micro-batch counts, delta simulation equals
a full simulation (iteration time, busy times, peak memory, bytes, tasks) at every step, the
bucket plan from the memo equals a fresh ``bucket_plan``, and the memos were read; the
recorded buckets stay under their bound of tasks."""

from __future__ import annotations

import random

import simulator.step

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.overlap import bucket_plan
from tests.conftest import traced
from tests.search.delta_check import checked_lowering, drawn_move


def _walk(moves: int, seed: int):
    """The walk's Evaluator, bucket plan memo, move kinds and buckets summed over its plans."""
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    n = topo.num_devices
    evaluate = Evaluator(graph, topo, cost)
    spaces = {m: candidate_configs(graph, n, m, topo.node_size) for m in (1, 2)}
    weighted = [x.name for x in graph if any(w.trainable for w in x.weights)]
    rng = random.Random(seed)
    current = data_parallel(graph, n).with_bucket_cap(0.01)  # several buckets per device set
    memo: dict = {}
    kinds = dict.fromkeys(("op", "level", "bucket", "count"), 0)
    buckets = 0
    for _ in range(moves):
        proposal, kind = drawn_move(rng, current, graph, spaces, weighted, (0.08, 0.16, 0.16, 0.24, 0.24),
                                    (0, 1, 2, 3))
        low = checked_lowering(evaluate, proposal, (kind, proposal.microbatches, proposal.bucket_cap_mb))
        if low is None:
            continue
        assert bucket_plan(low, None, memo) == bucket_plan(low), kind
        buckets += len(low.gradient_sync.buckets)
        kinds[kind] += 1
        if rng.random() < 0.6:
            current = proposal
    return evaluate, memo, kinds, buckets


def test_step_end_and_bucket_plan_from_the_last_plans_equal_fresh_ones_on_a_walk():
    evaluate, memo, kinds, buckets = _walk(90, 11)
    assert kinds["op"] >= 40 and min(kinds.values()) >= 2, kinds
    step_tasks = evaluate._tasks.step_tasks
    assert 0 < len(step_tasks.records) < buckets / 4  # each bucket's tasks recorded once, laid out at most steps
    assert len(memo) < buckets / 4


def test_the_recorded_buckets_stay_bounded(monkeypatch):
    monkeypatch.setattr(simulator.step, "MEMO_TASKS", 40)  # past 40 tasks recorded, the memo starts empty
    evaluate, _, kinds, _ = _walk(12, 3)  # delta = full at every step
    held = evaluate._tasks.step_tasks
    assert sum(kinds.values()) >= 8
    assert held.tasks == sum(len(t.cols) for t in held.records.values())
    assert held.tasks <= 40 + max(len(t.cols) for t in held.records.values())
