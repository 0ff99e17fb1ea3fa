"""The factorization sweep (soapsearch/search/sweep.py): the closed-form estimate's terms, the
sweep's best-first order with the memory check before timing, a baseline's result reused, and a
search started from the sweep's best, deterministic for a seed with 1 and 2 workers."""

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.memory import peak_memory
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from soapsearch.search import search
from soapsearch.search.api import Evaluator, best_baselines
from soapsearch.search.globalmove import Factorization, GlobalMoves
from soapsearch.search.mcmc import plan_cost, rank
from soapsearch.search.sweep import Estimate, _Order, _shape, estimate, sweep
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.megatron import default_tp
from tests.conftest import traced


def _f(tp=1, pp=1, m=1, schedule="gpipe", zero=0, recompute=False, sp=False) -> Factorization:
    return Factorization(tp, pp, m, schedule, zero, recompute, sp)


def test_estimate_is_the_closed_forms():
    graph = traced("gpt", batch_size=16)
    topo = get_topology("p100-1x4")
    shape = _shape(graph, topo, 4, "adam", "bf16")
    # tp 1 on one data-parallel device per stage: the heaviest stage's compute with the bubble
    # (p - 1)/m alone, the ops outside the blocks on that stage
    assert 0 < shape.outside < shape.flops
    heaviest = (shape.flops - shape.outside) / 4 + shape.outside
    assert estimate(_f(pp=4, m=4), 4, shape).seconds == pytest.approx(
        heaviest * 3 / shape.peak_flops * (1 + 3 / 4), rel=1e-12)
    assert estimate(_f(pp=4, m=4, recompute=True), 4, shape).seconds == pytest.approx(
        heaviest * 4 / shape.peak_flops * (1 + 3 / 4), rel=1e-12)
    # tensor parallel over 4: two all-reduces of each block's output per block
    assert estimate(_f(tp=4), 4, shape).seconds == pytest.approx(
        shape.flops * 3 / (4 * shape.peak_flops) + shape.blocks * 2 * 2 * 3 / 4 * shape.block_out / shape.intra,
        rel=1e-12)
    compute = shape.flops * 3 / (4 * shape.peak_flops)
    # data parallel over 4: the gradients' ring, 2·3/4 of the weights' bf16 bytes
    ring = 2 * 3 / 4 * shape.params * 2 / shape.intra
    assert estimate(_f(), 4, shape).seconds == pytest.approx(compute + ring, rel=1e-12)
    # memory: states over the devices that hold them, ZeRO's levels dividing them by 4
    plain, z1, z3 = (estimate(_f(zero=z), 4, shape).peak_bytes for z in (0, 1, 3))
    acts = shape.activations / 4
    assert plain - acts == pytest.approx(shape.params * (2 + 2 + 4 + 8), rel=1e-12)
    assert z1 - acts == pytest.approx(shape.params * (2 + 2 + 12 / 4), rel=1e-12)
    assert z3 - acts == pytest.approx(shape.params * 16 / 4, rel=1e-12)
    one_f = estimate(_f(pp=2, m=4, schedule="1f1b"), 4, shape).peak_bytes
    gpipe = estimate(_f(pp=2, m=4), 4, shape).peak_bytes
    assert gpipe - one_f == pytest.approx(shape.activations / 4 * (1 - 2 / 4), rel=1e-12)
    assert estimate(_f(recompute=True), 4, shape).peak_bytes < plain
    # ZeRO-2/3: each weighted op's rings every micro-batch, each of 3 steps of the ring's latency
    assert shape.weighted_inside + shape.weighted_outside == sum(
        1 for node in graph if any(w.trainable for w in node.weights))
    assert shape.intra_latency == topo.route_latency(0, 1) > 0
    step = shape.intra_latency * 3
    one, two = (estimate(_f(m=2, zero=z), 4, shape).seconds for z in (1, 2))
    assert two - one == pytest.approx(2 * (shape.weighted_inside + shape.weighted_outside) * step, rel=1e-9)
    three = estimate(_f(pp=2, m=2, zero=3, recompute=True), 2 * 4, shape).seconds  # 4 data-parallel devices
    base = estimate(_f(pp=2, m=2, zero=1, recompute=True), 2 * 4, shape).seconds
    gathers = 2 * _ring_seconds(shape, 4, (shape.held_inside / 2 + shape.held_outside) * shape.value)
    uses = shape.weighted_inside / 2 + shape.weighted_outside  # the heaviest stage's
    assert three - base == pytest.approx(gathers + 2 * 4 * uses * step, rel=1e-9)  # reduce-scatter, 3 gathers


def _ring_seconds(shape, g: int, nbytes: float) -> float:
    """A ring all-reduce's seconds within a node (the estimate's, latency left out)."""
    return 2 * (g - 1) / g * nbytes / shape.intra


def _small(topo: Topology, nbytes: int) -> Topology:
    """``topo`` with every device's memory set to ``nbytes``."""
    obj = topo.to_json()
    for d in obj["devices"]:
        d["memory_bytes"] = int(nbytes)
    return Topology.from_json(obj)


def test_sweep_times_best_first_and_skips_plans_that_do_not_fit():
    graph = traced("gpt", batch_size=16)
    cost = get_cost_model("analytical")
    topo = get_topology("p100-1x4")
    evaluate = Evaluator(graph, topo, cost, "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1, 2, 4), "bf16")
    plans, results = best_baselines(graph, 4, evaluate)
    known = {plans[k]: results[k] for k in results}
    calls = evaluate.calls
    out = sweep(graph, topo, moves, "adam", "bf16", evaluate, evaluate.lowering_cache, None, 6, known)
    timed = [s for s in out if s.result is not None and not any(s.result is r for r in results.values())]
    assert evaluate.calls - calls == len({id(s.result) for s in timed}) <= 6
    shape = _shape(graph, topo, 4, "adam", "bf16")
    keys = [estimate(s.factorization, 4, shape).seconds for s in out]
    # the fastest estimate first (the later ones corrected by the simulated ratios), one per shape
    assert keys[0] == min(estimate(f, 4, shape).seconds for f in moves.factorizations)
    assert len({(s.factorization.tp, s.factorization.pp, s.factorization.microbatches) for s in out}) == len(out)
    for s in out[:4]:  # a timed plan's result is the simulator's
        full = simulate_plan(graph, s.plan, topo, cost, optimizer="adam", summary=False)
        assert s.result.iteration_ms == pytest.approx(full.iteration_ms, rel=1e-12)
    moves.factorizations = [_f(tp=default_tp(graph, 4))]  # megatron's own factorization
    again = sweep(graph, topo, moves, "adam", "bf16", evaluate, evaluate.lowering_cache, None, 1, known)
    assert again[0].plan == plans["megatron"] and again[0].result is results["megatron"]  # scored once

    moves.factorizations = [_f(zero=z, recompute=r) for z in (0, 3) for r in (False, True)]
    peaks = [max(peak_memory(lower(graph, moves.plan(f)), "adam")) for f in moves.factorizations]
    tight = _small(topo, sorted(peaks)[1])  # two of the four fit
    evaluate = Evaluator(graph, tight, cost, "adam", "bf16")
    out = sweep(graph, tight, moves, "adam", "bf16", evaluate, evaluate.lowering_cache, None, 4)
    assert [s.peak_bytes for s in out] == [peaks[moves.factorizations.index(s.factorization)] for s in out]
    assert [s.result is None for s in out] == [s.peak_bytes > sorted(peaks)[1] for s in out]
    assert sum(s.result is None for s in out) == 2 and evaluate.calls == 2


def test_search_from_the_sweep_is_deterministic_and_no_worse_than_its_best():
    gpt = traced("gpt", batch_size=16)
    kw = dict(topology="p100-1x4", budget_s=None, proposals=40, seed=3, chains=2, optimizer="adam",
              precision="bf16", init=("swept", "swept"), exhaustive_limit=0)
    one, two = (search(gpt, workers=w, **kw) for w in (1, 2))
    assert one.strategy == two.strategy and one.predicted_ms == two.predicted_ms
    one.strategy.validate(gpt)
    topo = get_topology("p100-1x4")
    evaluate = Evaluator(gpt, topo, get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(gpt, 4, (1, 2, 4, 8), "bf16")
    best = min((s for s in sweep(gpt, topo, moves, "adam", "bf16", evaluate, evaluate.lowering_cache, None, 8)
                if s.result is not None), key=lambda s: rank(s.result.fits, plan_cost(s.result)))
    assert rank(one.result.fits, one.predicted_ms) <= rank(best.result.fits, best.result.iteration_ms * (1 + 1e-12))


def test_swept_init_without_a_device_to_factor_is_named():
    with pytest.raises(Exception, match="init = 'swept': model 'mlp' on 1 devices has no factorization"):
        search(traced("mlp"), topology="p100-1x4", num_devices=1, budget_s=None, proposals=5, init="swept",
               exhaustive_limit=0)


def test_order_corrects_the_estimate_by_the_simulated_ratio_per_pipeline_degree():
    fs = [_f(tp=2, pp=2, m=4), _f(tp=2, pp=2, m=2), _f(tp=4), _f(tp=4, zero=1), _f(tp=1, pp=2, m=4, zero=3)]
    est = {fs[0]: Estimate(1.0, 1), fs[1]: Estimate(1.1, 1), fs[2]: Estimate(1.2, 1), fs[3]: Estimate(1.2, 1),
           fs[4]: Estimate(0.5, 2)}  # the last does not fit (capacity 1)
    order = _Order(fs, est, 1.0)
    assert order.next() == fs[0]
    order.timed(fs[0], 3.0)  # pp 2 simulated 3x its estimate; pp 1 unseen: the least ratio, 3
    assert order.next() == fs[1]  # 3.3 < 3.6
    order.timed(fs[1], 2.2)  # pp 2's ratio now 2: 2.4 for tp 4 at pp 1 (unseen: the least, 2)
    assert order.next() == fs[2]
    order.timed(fs[2], 1.2)  # ratio 1 at pp 1
    assert [order.next(), order.next(), order.next()] == [fs[3], fs[4], None]  # the flag variant, then no fit


def test_sequence_parallel_and_a_remembered_start():
    graph = traced("gpt", batch_size=16)
    topo = get_topology("p100-1x4")
    shape = _shape(graph, topo, 4, "adam", "bf16")
    assert 0 < shape.between < shape.activations
    plain, sp = (estimate(_f(tp=4, sp=s), 4, shape) for s in (False, True))
    assert plain.seconds == sp.seconds
    assert plain.peak_bytes - sp.peak_bytes == pytest.approx(shape.between * (1 - 1 / 4), rel=1e-12)
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), "adam", "bf16")
    plan = GlobalMoves(graph, 4, (1,), "bf16").plan(_f(tp=2))
    first = evaluate(plan)
    evaluate.remember(plan, first)
    assert evaluate(plan) is first and evaluate.calls == 1  # not simulated again
    assert evaluate(plan, summary=True) is not first and evaluate.calls == 2  # a summary is simulated


def test_a_plan_the_lowering_refuses_is_passed_over(monkeypatch):
    import sys

    from strategies.errors import PlanError
    sweep_module = sys.modules[sweep.__module__]
    graph = traced("gpt", batch_size=16)
    topo = get_topology("p100-1x4")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1,), "bf16")
    moves.factorizations = [_f(zero=2), _f(zero=1)]
    refused = moves.plan(moves.factorizations[0])

    class Refusing(sweep_module.Lowerings):  # a rule only the lowering checks (strategies.zero's pairing)
        def first(self, topology, fold):
            if self.plan is refused:
                raise PlanError("wte", "zero", 2, "each use pairs up")
            return super().first(topology, fold)

    monkeypatch.setattr(sweep_module, "Lowerings", Refusing)
    out = sweep(graph, topo, moves, "adam", "bf16", evaluate, evaluate.lowering_cache, None, 4)
    assert [s.factorization for s in out] == [moves.factorizations[1]] and evaluate.calls == 1


def test_a_sweep_that_times_nothing_starts_the_chains_from_the_best_baseline(monkeypatch):
    """A sweep whose share of the budget times no factorization (GPT-3 175B on 1,024 devices:
    every plan's memory check outlasts it) no longer ends the search: the best scored baseline
    starts the chains."""
    import sys
    api = sys.modules[best_baselines.__module__]
    starts = []

    def nothing(*args, **kwargs):
        starts.append(args[-3])  # the scored baselines' results, by name
        return []

    monkeypatch.setattr(api, "swept_starts", nothing)
    gpt = traced("gpt", batch_size=16)
    found = search(gpt, topology="p100-1x4", budget_s=None, proposals=6, init="swept", exhaustive_limit=0,
                   optimizer="adam", precision="bf16", workers=1, seed=0)
    results = starts[0]
    best = min(results.values(), key=lambda r: rank(r.fits, plan_cost(r)))
    assert rank(found.result.fits, found.predicted_ms) <= rank(best.fits, best.iteration_ms * (1 + 1e-12))
    assert found.proposals >= 1  # the chains ran from it (the search raised "no factorization" before)


def test_order_leaves_out_what_its_bound_says_cannot_beat_the_best():
    """A plan is left out where its estimate times the least ratio seen at its degrees and
    schedule (the estimate alone where none is timed) is the best time or more."""
    fs = [_f(tp=2, pp=2, m=4), _f(tp=2, pp=2, m=2), _f(tp=2, pp=2, m=2, schedule="1f1b"), _f(tp=4), _f(tp=4, m=2)]
    est = {fs[0]: Estimate(1.0, 1), fs[1]: Estimate(1.1, 1), fs[2]: Estimate(1.1, 1), fs[3]: Estimate(1.5, 1),
           fs[4]: Estimate(2.5, 1)}
    order = _Order(fs, est, 1.0)
    assert order.next(best=None) == fs[0]
    order.timed(fs[0], 2.0)  # (2, 2, gpipe) at ratio 2: fs[1]'s bound 2.2; fs[2] (1f1b) unseen: 1.1
    assert order.bound(fs[1]) == pytest.approx(2.2) and order.bound(fs[2]) == pytest.approx(1.1)
    assert order.bound(fs[3]) == pytest.approx(1.5)  # no ratio at tp 4: the estimate
    # fs[1] (2.2) and fs[4] (2.5) cannot beat 2.0; fs[2] (1.1) and fs[3] (1.5) can
    assert [order.next(best=2.0), order.next(best=2.0), order.next(best=2.0)] == [fs[3], fs[2], None]


def test_the_bounded_sweep_finds_the_best_of_every_factorization():
    """With no deadline and no limit the sweep stops where its bound leaves nothing, timing a
    few of the factorizations, and its best is the best of all of them simulated one by one."""
    graph = traced("gpt", batch_size=16)
    topo = get_topology("p100-2x4")
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 8, (1, 2, 4, 8), "bf16", evaluate)
    out = sweep(graph, topo, moves, "adam", "bf16", evaluate, evaluate.lowering_cache, None, None)
    timed = [s.result.iteration_ms for s in out if s.result is not None and s.result.fits]
    assert 0 < len(out) < len(moves.factorizations) / 10
    every = []
    for f in moves.factorizations:
        plan = moves.plan(f)
        if plan is not None:
            try:
                result = evaluate(plan)
            except PlanError:
                continue
            if result.fits:
                every.append(result.iteration_ms)
    assert len(every) > 10 * len(out) and min(timed) == min(every)
