"""The global move (soapsearch/search/globalmove.py): every op re-derived from a factorization
of the devices as the megatron baseline does, with the baseline's flags; the pipeline stages
rebalanced by the simulator's times and the dynamic program (stagemove.py); delta simulation
of a walk using them equals a full simulation; a search with them is deterministic for a seed
with 1 and 3 workers."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from soapsearch.search import search
from soapsearch.search.api import Evaluator
from soapsearch.search.globalmove import Factorization, GlobalMoves
from soapsearch.search.stagemove import op_seconds, pipeline_groups, restage, units
from strategies.config import ParallelConfig
from strategies.megatron import megatron, megatron_blocks
from strategies.repeats import repeated_blocks
from strategies.stages import dp_partition
from tests.conftest import traced
from tests.search.delta_check import assert_delta_equals_full


def test_each_factorization_is_re_derived_as_the_baseline_does():
    graph = traced("gpt", batch_size=16)
    moves = GlobalMoves(graph, 4, (1, 2, 4), "bf16")
    assert len(moves.factorizations) > 100
    blocks = megatron_blocks(graph)
    columns = [c for cols, _, _ in blocks for c in cols]
    inside = {op for cols, mid, row in blocks for op in (*cols, *mid, row)}
    rng = random.Random(0)
    seen = set()
    for f in rng.sample(moves.factorizations, 40):
        plan = moves.plan(f)
        if plan is None:
            continue
        seen.add((f.tp, f.pp))
        plan.validate(graph)
        assert (plan.microbatches, plan.precision) == (f.microbatches, "bf16")
        assert f.microbatches == 1 or plan.schedule == f.schedule
        for op in columns:  # column linears: out_features cut tp ways, on one stage's 4 / pp devices
            cut = [k for k, d in zip(plan[op].degrees, graph[op].dims) if d.role == "parameter"]
            assert cut == [f.tp] and len(plan[op].devices) == 4 // f.pp
        assert pipeline_groups(plan, [op for op in plan if graph[op].kind not in ("input", "parameter")]) >= f.pp
        assert all(plan[op].recompute == f.recompute for op in inside if graph[op].kind != "input")
        assert {plan[op].zero for op in columns} == {f.zero if 4 // f.pp // f.tp > 1 else 0}
    assert {(1, 1), (2, 1), (1, 2), (2, 2)} <= seen


def test_restage_balances_the_units_by_the_dynamic_program():
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    timed = lambda plan: simulate_plan(graph, plan, topo, cost, timeline=True)  # noqa: E731
    plan = megatron(graph, 4, tp=2, pp=2, microbatches=2)
    lopsided = plan
    for op, cfg in plan.items():  # every op on the first stage's devices 0-1
        if min(cfg.devices) >= 2:
            lopsided = lopsided.replace(op, ParallelConfig(cfg.degrees, tuple(d - 2 for d in cfg.devices)))
    balanced = restage(graph, lopsided, timed)
    assert balanced is not None
    balanced.validate(graph)
    cut = units(graph, repeated_blocks(graph)[0])
    assert [len(u) for u in cut] == [5, 22, 22, 6]  # embedding, 2 layers, head
    seconds = op_seconds(timed(lopsided))
    starts, slowest = dp_partition([sum(seconds.get(op, 0.0) for op in u) for u in cut], 2)
    stage = [{min(balanced[op].devices) // 2 for op in u if graph[op].kind != "input"} for u in cut]
    assert stage == [{int(k >= starts[1])} for k in range(len(cut))]  # each unit on its DP stage
    assert timed(balanced).iteration_time < 0.8 * timed(lopsided).iteration_time
    assert restage(graph, balanced, timed) is None  # already balanced
    assert restage(graph, megatron(graph, 4, tp=2), timed) is None  # one stage


def test_a_walk_of_global_moves_delta_equals_full():
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost, precision="bf16")
    moves = GlobalMoves(graph, 4, (1, 2), "bf16", lambda plan: evaluate(plan, timeline=True))
    rng = random.Random(2)
    current = moves.plan(Factorization(2, 2, 2, "1f1b", 0, False, False))
    made = 0
    for _ in range(16):
        proposal = moves.propose(current, rng)
        if proposal is None:
            continue
        made += 1
        assert_delta_equals_full(evaluate, proposal)
        current = proposal
    assert made >= 8


def test_search_with_global_moves_is_deterministic_for_1_and_3_workers():
    gpt = traced("gpt", batch_size=16)
    kw = dict(topology="p100-1x4", budget_s=None, proposals=60, seed=4, chains=3, global_move=0.5,
              init=("factorized", "hybrid"), exhaustive_limit=0)
    one, three = (search(gpt, workers=w, **kw) for w in (1, 3))
    assert one.strategy == three.strategy and one.predicted_ms == three.predicted_ms
    one.strategy.validate(gpt)
    assert one.predicted_ms <= min(one.baselines.values()) * (1 + 1e-12)


def test_factorized_init_without_a_device_to_factor_is_named():
    with pytest.raises(Exception, match="init = 'factorized': model 'mlp' on 1 devices has no valid factorization"):
        search(traced("mlp"), topology="p100-1x4", num_devices=1, budget_s=None, proposals=5, init="factorized",
               exhaustive_limit=0)
