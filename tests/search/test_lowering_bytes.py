"""An Evaluator's lowering cache bounded by bytes (``strategies.lowering_bytes``): the count
equals the bytes of the distinct pieces, per-device tuples and shards its entries hold, it stays under the bound,
the oldest entries go, and every result equals a full simulation."""

import random

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search.api import Evaluator
from soapsearch.search.globalmove import GlobalMoves
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel, model_parallel
from strategies.lowered import OpPieces
from strategies.lowering_bytes import LOWERING_BYTES, LoweringCache, counted, entry_bytes, key_bytes, pieces_bytes
from tests.conftest import traced
from tests.search.delta_check import assert_delta_equals_full


def _real(cache: LoweringCache) -> int:
    """The bytes of the distinct objects the cache's entries hold and of its keys, found afresh."""
    found = {id(item): item for value in dict.values(cache) for item in counted(value)}
    return sum(map(entry_bytes, found.values())) + sum(map(key_bytes, dict.keys(cache)))


def test_the_lowering_cache_stays_under_its_bytes_and_results_stay_exact(monkeypatch):
    # the Evaluator trims before and after each simulation: after a call the cache is under its
    # bound (a lowering past it is not held while the next is made), and a trim fired on the way
    fired = []
    trim = LoweringCache.trim

    def counting(cache: LoweringCache) -> bool:
        before = cache.nbytes
        dropped = trim(cache)
        if dropped and before > cache.limit:
            fired.append(before)
        return dropped

    monkeypatch.setattr(LoweringCache, "trim", counting)
    graph, topo = traced("gpt", batch_size=16), get_topology("p100-1x4")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1, 2), "bf16")
    plans = [p for p in map(moves.plan, moves.factorizations[::5]) if p is not None][:6]
    evaluate(plans[0])
    one = evaluate.lowering_cache.total()  # one plan's pieces and shards
    assert one > 0
    evaluate.lowering_cache[("precision", "bf16")].limit = bound = 2 * one
    candidates = candidate_configs(graph, 4, 1, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    rng, held = random.Random(3), []
    for k in range(24):
        plan = plans[k % len(plans)]
        if k % 3 == 2:  # a one-op proposal from a factorization's plan
            op = rng.choice(ops)
            plan = plan.replace(op, rng.choice(candidates[op]))
        assert_delta_equals_full(evaluate, plan, (k, plan.microbatches))
        nested = evaluate.lowering_cache[("precision", "bf16")]
        assert nested.nbytes == _real(nested)
        held.append(nested.nbytes)
        assert nested.nbytes == _real(nested) <= bound
    assert fired and max(fired) > bound and min(held) > 0  # past the bound, then the oldest dropped


def test_a_nested_cache_and_a_replaced_entry_keep_the_count_true():
    graph = traced("mlp", batch_size=16)
    evaluate = Evaluator(graph, get_topology("p100-2x2"), get_cost_model("analytical"))
    evaluate(data_parallel(graph, 4))
    cache = evaluate.lowering_cache
    first = cache.nbytes
    assert first == _real(cache) > 0
    evaluate(model_parallel(graph, 4))
    assert cache.nbytes == _real(cache) > first
    key = next(k for k, v in dict.items(cache) if type(v) is OpPieces)
    cache[key] = cache[key]  # the same pieces again: counted once
    assert cache.nbytes == _real(cache) >= pieces_bytes(cache[key])
    assert cache.nbytes == _real(cache)
    del cache[key]
    assert cache.nbytes == _real(cache)
    cache.limit = 1
    assert cache.trim() and cache.nbytes == _real(cache) == 0 and len(cache) == 0


def test_trim_and_total_visit_exactly_the_nested_caches_held():
    # LoweringCache._nested: the nested caches trim and total visit, kept as entries are set,
    # replaced, popped and cleared (not found by a pass over every entry)
    graph = traced("mlp", batch_size=16)
    evaluate = Evaluator(graph, get_topology("p100-2x2"), get_cost_model("analytical"), precision="bf16")
    evaluate(data_parallel(graph, 4))
    cache = evaluate.lowering_cache
    nested = cache[("precision", "bf16")]
    assert isinstance(nested, LoweringCache) and nested.nbytes == _real(nested) > 0
    assert cache.total() == cache.nbytes + nested.nbytes
    nested.limit = 1
    assert cache.trim() and nested.nbytes == 0  # trimmed through the outer cache
    nested.limit = LOWERING_BYTES  # (the Evaluator trims after a simulation too)
    evaluate(model_parallel(graph, 4))
    assert cache.total() == cache.nbytes + nested.nbytes > cache.nbytes
    cache[("precision", "bf16")] = 0  # replaced by a plain value: no longer visited
    assert cache.total() == cache.nbytes and not cache.trim()
    other = cache.setdefault(("precision", "fp16"), {})
    other[("x",)] = next(v for v in dict.values(nested) if type(v) is OpPieces)
    assert cache.total() == cache.nbytes + other.nbytes > cache.nbytes
    cache.pop(("precision", "fp16"))
    assert cache.total() == cache.nbytes
    cache.setdefault(("precision", "fp16"), {})[("x",)] = other[("x",)]
    assert cache.total() > cache.nbytes
    del cache[("precision", "fp16")]
    assert cache.total() == cache.nbytes
    cache.setdefault(("precision", "fp16"), {})[("x",)] = other[("x",)]
    cache.clear()
    assert cache.total() == 0


def test_the_stage_moves_lowering_leaves_the_cache_under_its_bound():
    # GlobalMoves.op_seconds lowers through the Evaluator's cache between its calls (the chains'
    # start restages the sweep's plans): it trims after, as a simulation does
    graph = traced("gpt", batch_size=16)
    evaluate = Evaluator(graph, get_topology("p100-1x4"), get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1, 2), "bf16", evaluate)
    plans = [p for p in map(moves.plan, moves.factorizations[::5]) if p is not None][:3]
    evaluate(plans[0])
    nested = evaluate.lowering_cache[("precision", "bf16")]
    nested.limit = bound = nested.nbytes + 1  # the next plan's pieces take it past its bound
    for plan in plans[1:]:
        moves.op_seconds(plan)
        assert nested.nbytes == _real(nested) <= bound
