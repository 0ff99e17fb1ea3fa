"""A lowering cache's count (``LoweringCache.total``, ``RECORD_BYTES`` a record) is what its
entries keep alive: measured by tracemalloc as what emptying the cache frees once nothing else
holds its pieces (the task blocks, the results, the state ``lower`` patches, the cost model's
memos and the regions' memo let go first), it is within a factor of the count on a
factorization sweep's plans; on one-op proposals, whose records share more of their boxes with
the graph's memos, it counts more than is freed, never less. Each is measured in a fresh
process: module memos left by other tests in the same process hold boxes the records share,
so what emptying the cache frees there depends on which tests ran before."""

from __future__ import annotations

import gc
import multiprocessing
import tracemalloc
from concurrent.futures import ProcessPoolExecutor

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search.api import Evaluator
from soapsearch.search.globalmove import GlobalMoves
from strategies.lowering import is_patched_state
from strategies.lowering_bytes import LoweringCache
from strategies.pieces import overlapping
from tests.conftest import traced
from tests.simulator.test_taskcache_held import FACTOR, _plans


def _drop_patched(cache: LoweringCache) -> None:
    """The states ``lower`` patches (one plan's lowering, counted nowhere) let go, nested too."""
    for key in [k for k in dict.keys(cache) if is_patched_state(k)]:
        del cache[key]
    for nested in cache._nested.values():
        _drop_patched(nested)


def _freed_and_counted(evaluate: Evaluator, plans: list) -> tuple[int, int]:
    """What emptying ``evaluate``'s lowering cache frees after ``plans``, and its count then."""
    tracemalloc.start()  # before the pieces are made: what dropping them frees is traced
    try:
        for plan in plans:
            evaluate(plan)
        evaluate._tasks = None  # the blocks hold the pieces they were built from
        evaluate._seen.clear()
        evaluate.cost = get_cost_model("analytical")  # its memos are keyed by the pieces' boxes
        overlapping.cache_clear()  # regions by partition grid: the pieces' boxes again
        cache = evaluate.lowering_cache
        _drop_patched(cache)
        gc.collect()
        counted = cache.total()
        before = tracemalloc.get_traced_memory()[0]
        cache.clear()
        gc.collect()
        return before - tracemalloc.get_traced_memory()[0], counted
    finally:
        tracemalloc.stop()


def _factorizations() -> tuple[int, int]:
    """``_freed_and_counted`` on four plans of a factorization sweep (gpt, 64 devices)."""
    graph, topo = traced("gpt", batch_size=64), get_topology("a100-8x8")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 64, (1, 2, 4, 8), "bf16")
    plans = [p for p in map(moves.plan, moves.factorizations[::7]) if p is not None][:4]
    assert len(plans) == 4
    return _freed_and_counted(evaluate, plans)


def _one_op_proposals() -> tuple[int, int]:
    """``_freed_and_counted`` on data parallel and 12 one-op proposals (gpt, 16 devices)."""
    graph, topo = traced("gpt", batch_size=16), get_topology("p100-4x4")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"))
    return _freed_and_counted(evaluate, list(_plans(graph, 16, 12, 3)))


def _fresh(measure) -> tuple[int, int]:
    """``measure()`` in a fresh process (nothing another test left holds what it measures)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure).result()


def test_the_count_is_what_factorizations_keep_alive():
    freed, counted = _fresh(_factorizations)
    assert freed / FACTOR <= counted <= freed * FACTOR, (counted, freed)


def test_one_op_proposals_free_no_more_than_counted():
    freed, counted = _fresh(_one_op_proposals)
    assert freed <= counted <= 4 * freed, (counted, freed)  # 2.97-3.0x in a fresh process
