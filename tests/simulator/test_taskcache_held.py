"""A TaskCache's count (``TaskCache.nbytes``) is what its blocks keep alive: measured by
tracemalloc as what dropping the cache frees, after a walk of plans whose lowering cache was let go
(the blocks then keep the lowered pieces alive alone), it is within a factor of the count; and
the count of each object once (``HeldBytes``) equals a count from scratch after every simulation."""

from __future__ import annotations

import gc
import random
import tracemalloc

from simulator.block_bytes import HeldBytes
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.taskcache import TaskCache
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from tests.conftest import traced

FACTOR = 1.5
"""How far the count may be from what tracemalloc sees freed (either way). The count's per-piece
record size (``strategies.lowering_bytes.RECORD_BYTES``) was measured on this same workload (gpt,
16 devices), so the pieces' part is checked here against its own calibration; the arrays and
lists are counted independently of it."""


def held_from_scratch(cache: TaskCache) -> int:
    """Every block the cache holds added once to a fresh ``HeldBytes``: its count."""
    blocks = [b for s in cache._states.values() for b in (s[2].blocks if s[2] is not None else ())]
    blocks += [b for s in cache._states.values() for known in s[1][3] for b in known.values()]
    fresh = HeldBytes()
    for b in {id(b): b for b in blocks}.values():
        fresh.add(b)
    return fresh.nbytes


def _plans(graph, n: int, count: int, seed: int):
    """Data parallel, then ``count`` plans each one op's config changed (micro-batches 1)."""
    space = candidate_configs(graph, n, 1, None)
    rng, plan = random.Random(seed), data_parallel(graph, n)
    yield plan
    ops = [op for op in space if len(space[op]) > 1]
    for _ in range(count):
        op = rng.choice(ops)
        plan = plan.with_configs({**dict(plan.configs), op: rng.choice(space[op])})
        yield plan


def test_the_count_is_what_the_blocks_keep_alive():
    graph, topo = traced("gpt", batch_size=16), get_topology("p100-4x4")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"))
    plans = list(_plans(graph, 16, 12, 3))
    tracemalloc.start()  # before the blocks are made: what dropping them frees is traced
    try:
        for plan in plans:
            evaluate(plan)
            evaluate.lowering_cache.clear()  # the pieces the blocks hold are then theirs alone
            assert evaluate._tasks.held.nbytes == held_from_scratch(evaluate._tasks)
        cache = evaluate._tasks
        cache.step_tasks.clear()  # recorded tasks: counted by ``TASK_BYTES``, not what is tested here
        cache.gathers.clear()
        cache.buckets.clear()
        counted = cache.nbytes()
        del cache
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        evaluate._tasks = None
        gc.collect()
        freed = before - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert freed / FACTOR <= counted <= freed * FACTOR, (counted, freed)
