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
from soapsearch.search import globalmove, stagemove
from soapsearch.search.globalmove import Factorization, GlobalMoves
from soapsearch.search.stagemove import op_seconds, pipeline_groups, restage, units
from strategies.baselines import recomputed
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


def _timeline_seconds(result) -> dict[str, float]:
    """Op -> seconds of its forward and backward compute tasks per device that runs them, read
    off a summarized timeline (task names ``fwd op[k]@mbM``): what ``op_seconds`` must equal."""
    total, devices = {}, {}
    for name, device, lane, start, end, category in result.timeline:
        if lane == "compute" and category in ("forward", "backward", "recompute"):
            op = name.split(" ", 1)[-1].rsplit("[", 1)[0]
            total[op] = total.get(op, 0.0) + end - start
            devices.setdefault(op, set()).add(device)
    return {op: t / len(devices[op]) for op, t in total.items()}


def _lopsided(plan):
    """``plan`` with every op of its second stage (devices 2-3 of 4) moved onto the first's."""
    for op, cfg in plan.items():
        if min(cfg.devices) >= 2:
            plan = plan.replace(op, ParallelConfig(cfg.degrees, tuple(d - 2 for d in cfg.devices), cfg.zero,
                                                   cfg.recompute))
    return plan


@pytest.mark.parametrize("model, topology, tp, pp, fold_from", [
    ("gpt", "p100-1x4", 2, 2, 64), ("gpt", "a100-1x8", 2, 2, 2), ("gpt", "p100-1x4", 1, 4, 64),
    ("llama", "p100-1x4", 2, 2, 64)])
def test_op_seconds_are_the_timeline_s_compute_seconds(model, topology, tp, pp, fold_from, monkeypatch):
    """Per device (4 devices) and folded on copy 0 (8 devices: 2 data-parallel copies, the fold
    threshold lowered to reach it), recompute, bf16 and twin ops (their twin's tasks) included:
    the lowering's seconds are the timeline's, op for op (the presets' ``overlap_rate`` is 1:
    ``simulator.comm_overlap_rate`` would stretch the timeline's compute past them)."""
    monkeypatch.setattr(stagemove, "FOLD_FROM", fold_from)
    graph = traced(model, batch_size=16)
    topo, cost = get_topology(topology), get_cost_model("analytical")
    n = topo.num_devices
    plan = recomputed(megatron(graph, n, tp=tp, pp=pp, microbatches=4), graph).with_precision("bf16")
    lowered = []
    monkeypatch.setattr(stagemove, "_lowered_seconds",
                        lambda low, *a, read=stagemove._lowered_seconds: lowered.append(low) or read(low, *a))
    got = op_seconds(graph, plan, topo, cost)
    want = _timeline_seconds(simulate_plan(graph, plan, topo, cost, timeline=True))
    assert set(got) == set(want) and len(got) > 40
    for op, seconds in want.items():
        assert got[op] == pytest.approx(seconds, rel=1e-12, abs=1e-15), op
    assert any(plan[op].recompute for op in got) and any(v > 0 for v in got.values())
    assert any(op in lowered[0].twins for op in got)
    copies = lowered[0].copies  # 8 devices: copy 0's lowering, 4 of 8 devices (the simulation's fold)
    assert (copies is None) == (n == 4) and (copies is None or len(copies.kept) == 4)


def test_restage_balances_the_units_by_the_dynamic_program():
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    timed = lambda plan: simulate_plan(graph, plan, topo, cost, timeline=True)  # noqa: E731
    seconds = lambda plan: op_seconds(graph, plan, topo, cost)  # noqa: E731
    lopsided = _lopsided(megatron(graph, 4, tp=2, pp=2, microbatches=2))
    balanced = restage(graph, lopsided, seconds)
    assert balanced is not None
    balanced.validate(graph)
    cut = units(graph, repeated_blocks(graph)[0])
    assert [len(u) for u in cut] == [5, 22, 22, 6]  # embedding, 2 layers, head
    per_op = _timeline_seconds(timed(lopsided))
    starts, slowest = dp_partition([sum(per_op.get(op, 0.0) for op in u) for u in cut], 2)
    assert starts == [0, 2]  # embedding and layer 1, layer 2 and head
    stage = [{min(balanced[op].devices) // 2 for op in u if graph[op].kind != "input"} for u in cut]
    assert stage == [{int(k >= starts[1])} for k in range(len(cut))]  # each unit on its DP stage
    assert timed(balanced).iteration_time < 0.8 * timed(lopsided).iteration_time
    assert restage(graph, balanced, seconds) is None  # already balanced
    assert restage(graph, megatron(graph, 4, tp=2), seconds) is None  # one stage


def test_the_search_s_restage_reads_nonzero_times_and_balances(monkeypatch):
    """The global move's restage as the search wires it (``GlobalMoves`` given the search's
    Evaluator, bf16): from a plan with every op on the first of 2 stages, the proposal puts the
    units on the stages the dynamic program picks from the timeline's compute times, not the
    split all-zero times give (every unit but the last on the first stage)."""
    monkeypatch.setattr(globalmove, "RESTAGE", 1.0)
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost, "adam", "bf16", summarize_best=True)
    moves = GlobalMoves(graph, 4, (1, 2), "bf16", evaluate)
    lopsided = evaluate.planned(_lopsided(megatron(graph, 4, tp=2, pp=2, microbatches=2)))
    before = evaluate(lopsided).iteration_time  # the chain's current plan, scored
    proposal = moves.propose(lopsided, random.Random(0))
    assert proposal is not None
    cut = units(graph, repeated_blocks(graph)[0])
    per_op = _timeline_seconds(simulate_plan(graph, lopsided, topo, cost, optimizer="adam", timeline=True))
    starts, _ = dp_partition([sum(per_op.get(op, 0.0) for op in u) for u in cut], 2)
    assert starts == [0, 2] != dp_partition([0.0] * len(cut), 2)[0]
    stage = [{min(proposal[op].devices) // 2 for op in u if graph[op].kind != "input"} for u in cut]
    assert stage == [{0}, {0}, {1}, {1}]
    assert evaluate(proposal).iteration_time < 0.8 * before


def test_a_walk_of_global_moves_delta_equals_full():
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost, precision="bf16")
    moves = GlobalMoves(graph, 4, (1, 2), "bf16", evaluate)
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


def test_a_walk_turns_the_gradient_sync_and_draws_keep_it(monkeypatch):
    """``RESYNC``: a pipelined, replicated plan's proposal is the plan with its buckets synced after
    the backward (``overlap_grad_reduce``), the configs unchanged, and back; a drawn
    factorization keeps the current plan's sync; delta simulation equals full on the walk."""
    monkeypatch.setattr(globalmove, "RESYNC", 0.5)
    monkeypatch.setattr(globalmove, "RESTAGE", 0.0)  # the other proposals are drawn factorizations
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost, precision="bf16")
    moves = GlobalMoves(graph, 4, (2,), "bf16", evaluate)
    rng = random.Random(5)
    current = moves.plan(Factorization(1, 2, 2, "1f1b", 0, False, False))
    turned = kept = 0
    for _ in range(30):
        proposal = moves.propose(current, rng)
        if proposal is None:
            continue
        if proposal.configs == current.configs and proposal.microbatches == current.microbatches:
            turned += proposal.overlap_grad_reduce != current.overlap_grad_reduce
        elif not current.overlap_grad_reduce:
            kept += not proposal.overlap_grad_reduce
        assert_delta_equals_full(evaluate, proposal)
        current = proposal
    assert turned >= 3 and kept >= 1
    dp = moves.plan(Factorization(1, 1, 2, "1f1b", 0, False, False))
    assert all(moves.propose(dp, random.Random(k)) != dp.with_overlap_grad_reduce(False) for k in range(20))


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


def test_pipeline_degrees_divide_the_layers():
    """Megatron-LM's rule (num_layers % pp == 0): GPT-3's 96 layers (192 blocks) on 1,024
    devices factor P 1-32, not 64 (1.5 layers a stage) or 128 (a stage of one block, half with
    none of a layer's attention); where the blocks do not pair into layers, P up to the blocks."""
    assert globalmove.pipeline_degrees(1024, 192, 96) == [1, 2, 4, 8, 16, 32]
    assert globalmove.pipeline_degrees(12, 6, 3) == [1, 3]
    assert globalmove.pipeline_degrees(8, 5, None) == [1, 2, 4]


def test_interleaving_takes_two_chunks_of_whole_layers_a_rank():
    """The zoo gpt's 2 layers (4 blocks) on 32 devices: pipeline 1 or 2 (4 would leave a stage
    without a layer), and no interleaving, which needs 2 ranks and 2 chunks a rank: 4 stages of
    2 layers, a layer cut in two (Megatron-LM's num_layers % (pp · virtual stages) == 0)."""
    graph = traced("gpt", batch_size=32)
    assert len(megatron_blocks(graph)) == 4
    moves = GlobalMoves(graph, 32, (2, 4), "bf16")
    assert {f.pp for f in moves.factorizations} == {1, 2}
    assert not [f for f in moves.factorizations if f.schedule == "interleaved"]
    assert globalmove.stages_fit(2, 4, 2) and not globalmove.stages_fit(4, 4, 2)
    assert globalmove.stages_fit(4, 5, None) and not globalmove.stages_fit(6, 5, None)
