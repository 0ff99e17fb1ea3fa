"""The Evaluator's caches bounded as a whole (``simulator.taskcache.TaskCache.trim``,
``CACHE_BYTES``; ``Evaluator._seen`` keeping only the leader's summary): over a walk of one-op
proposals with ZeRO levels 0-3, bucket caps, whole-plan levels and micro-batch counts, the task
cache's bound fires, drops all but the current graph's blocks, its counts stay true, and every
result equals a full simulation; the results kept by plan are what a scoring without a summary
returns, the leader's excepted."""

from __future__ import annotations

import random

import simulator.taskcache
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.taskcache import TaskCache
from soapsearch.search.api import Evaluator, scored
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from tests.conftest import traced
from tests.simulator.test_taskcache_held import held_from_scratch
from tests.search.delta_check import checked_lowering, drawn_move


def _walk(evaluate: Evaluator, moves: int, seed: int, each=lambda: None) -> int:
    """``moves`` drawn moves from data parallel, delta = full asserted on each; ``each`` called
    after each scored one. How many were scored."""
    graph, n = evaluate.graph, evaluate.topology.num_devices
    spaces = {m: candidate_configs(graph, n, m, evaluate.topology.node_size) for m in (1, 2)}
    weighted = [x.name for x in graph if any(w.trainable for w in x.weights)]
    rng = random.Random(seed)
    current, scored_ = data_parallel(graph, n).with_bucket_cap(0.01), 0
    for _ in range(moves):
        proposal, kind = drawn_move(rng, current, graph, spaces, weighted, (0.08, 0.2, 0.24, 0.3, 0.4),
                                    (0, 1, 2, 3))
        if checked_lowering(evaluate, proposal, (kind, proposal.microbatches)) is None:
            continue
        scored_ += 1
        each()
        if rng.random() < 0.6:
            current = proposal
    return scored_


def _counts_true(cache: TaskCache) -> None:
    assert cache.gathers.tasks == sum(len(c.cols) for c in cache.gathers.records.values())
    assert cache.step_tasks.tasks == sum(len(t.cols) for t in cache.step_tasks.records.values())
    assert cache.known_bytes == sum(simulator.taskcache.block_bytes(b) for s in cache._states.values()
                                    for known in s[1][3] for b in known.values())
    assert cache.held.nbytes == held_from_scratch(cache)


def test_the_task_cache_bound_fires_and_results_stay_exact(monkeypatch):
    graph, topo = traced("gpt", batch_size=16), get_topology("p100-2x2")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"))
    # each recorded task charged 4,000 bytes, many times TASK_BYTES: at this size the blocks, with
    # the lists and pieces they keep alive, outweigh the records as charged, so the records then
    # pass half the bound too and trim's records branch (TASK_BYTES * tasks > limit // 2) runs
    monkeypatch.setattr(simulator.taskcache, "TASK_BYTES", 4000)
    evaluate(data_parallel(graph, 4).with_bucket_cap(0.01))
    bound = 3 * evaluate._tasks.nbytes() // 2  # about one graph's blocks and records and a half
    monkeypatch.setattr(simulator.taskcache, "CACHE_BYTES", bound)
    fired, gathered, records = [], [], []
    trim = TaskCache.trim

    def checked(cache: TaskCache, limit=None) -> bool:
        held = cache.nbytes()
        tasks = simulator.taskcache.TASK_BYTES * (cache.gathers.tasks + cache.step_tasks.tasks)
        dropped = trim(cache, limit)
        assert dropped == (held > bound)
        if dropped:  # the known blocks and the other states gone; the records past half the bound
            fired.append(held)
            assert not any(known for s in cache._states.values() for known in s[1][3])
            assert list(cache._states.values()) in ([], [cache._current])
            if tasks > bound // 2:
                records.append(tasks)
                assert not cache.gathers.records and not cache.step_tasks.records and not cache.buckets
            else:
                assert cache.gathers.tasks + cache.step_tasks.tasks == tasks // simulator.taskcache.TASK_BYTES
        _counts_true(cache)
        return dropped

    monkeypatch.setattr(TaskCache, "trim", checked)
    scored_ = _walk(evaluate, 40, 5, lambda: gathered.append(evaluate._tasks.gathers.tasks))
    assert scored_ >= 30
    assert len(fired) >= 3 and records and max(gathered) > 0, (fired, records, gathered)


def test_the_results_kept_by_plan_hold_only_the_leaders_summary():
    graph, topo = traced("gpt", batch_size=16), get_topology("p100-2x2")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), summarize_best=True)
    summaries = []
    _walk(evaluate, 24, 7, lambda: summaries.append(sum(s for s, _ in evaluate._seen.values())))
    assert max(summaries) == 1  # every call asks a summary (delta = full): one kept, the leader's
    kept = [(plan, s, r) for plan, (s, r) in evaluate._seen.items()]
    assert len(kept) >= 10
    for plan, summarized, result in kept:
        assert summarized == (plan == evaluate._leader)
        if summarized:
            assert result.memory and result.busy_time
            continue
        quick = simulate_plan(graph, plan, topo, evaluate.cost, summary=False)
        assert result == quick == scored(result)  # what a scoring returns, field for field
        assert evaluate(plan) is result  # and returned again without simulating
