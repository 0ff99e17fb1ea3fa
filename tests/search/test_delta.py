"""Delta simulation equals full simulation: a chain of random one-op proposals (accepted at
random, as MCMC walks) is scored by the search's Evaluator, which reuses every unchanged op's
lowering and task block, and by a from-scratch simulation; every figure must be identical."""

import dataclasses
import random

import pytest

from simulator.cost import get_cost_model
from simulator.devices import DeviceSpec
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator import tasks
from simulator.tasks import TaskCache
from simulator.topology import Topology
from soapsearch.search import evaluator as scorer
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel, owt
from strategies import lowering_cache
from strategies.baselines import sharded
from strategies.errors import PlanError
from strategies.lowering import lower
from tests.conftest import traced
from tests.search.delta_check import assert_delta_equals_full, assert_same_result


def _with_overheads(topo: Topology) -> Topology:
    """``topo`` with host overheads set and sends holding their senders, so the receive and
    send tasks (chained into the senders' schedules) are in the graph too."""
    devices = tuple(DeviceSpec(d.kind, d.memory_bytes, dict(d.peak_flops), d.memory_bandwidth, d.node,
                               task_overhead=3e-5, message_overhead=2e-5,
                               collective_overhead=4e-5) for d in topo.devices)
    links = tuple(dataclasses.replace(k, send_bandwidth=5e9, send_latency=1e-5) for k in topo.links)
    return Topology(topo.name + "+overheads", devices, links, topo.routes)


CASES = [  # model, topology, micro-batches, schedule, proposals
    ("resnet101", "p100-2x2", 1, "gpipe", 250),
    pytest.param("inception_v3", "p100-1x4", 2, "1f1b", 120, marks=pytest.mark.slow),
    ("gpt", "p100-2x2", 2, "1f1b", 180),
    ("nmt", "k80-2x4", 1, "gpipe", 300),
    ("rnntc", "p100-2x2", 4, "gpipe", 300),
    ("mlp", "local-cpu-4", 4, "1f1b", 400),
    ("alexnet", "overheads", 2, "1f1b", 300),
]


@pytest.mark.parametrize("name,topology,microbatches,schedule,proposals", CASES)
def test_delta_equals_full(name, topology, microbatches, schedule, proposals):
    graph = traced(name, batch_size=16)
    topo = _with_overheads(get_topology("p100-2x2")) if topology == "overheads" else get_topology(topology)
    n = topo.num_devices
    cost = get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    candidates = candidate_configs(graph, n, microbatches, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    rng = random.Random(hash((name, topology)) & 0xFFFF)
    start = data_parallel(graph, n) if rng.random() < 0.5 else owt(graph, n)
    current = start.with_microbatches(microbatches, schedule)
    changed = 0
    for _ in range(proposals):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]))
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(graph, proposal, topo, cost, summary=True)
        assert delta.iteration_time == full.iteration_time, (name, op, proposal[op].show())
        assert delta.peak_memory_bytes == full.peak_memory_bytes and delta.memory == full.memory
        assert delta.busy_time == full.busy_time
        assert delta.bytes_moved == full.bytes_moved
        assert delta.num_tasks == full.num_tasks
        if rng.random() < 0.5:
            changed += proposal[op] != current[op]
            current = proposal
    assert changed > proposals // 5  # the walk really moved


def test_a_task_cache_handed_another_graph_starts_over():
    # one TaskCache, two graphs in turn (the blocks' positions are a graph's): each equals its
    # from-scratch simulation.
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    cache = TaskCache(topo, cost)
    graphs = [traced(name, batch_size=16) for name in ("mlp", "alexnet", "mlp")]
    for graph in graphs + graphs[::-1]:
        for plan in (data_parallel(graph, 4), owt(graph, 4)):
            delta = simulate_plan(graph, plan, topo, cost, cache=cache)
            assert delta == simulate_plan(graph, plan, topo, cost)


def test_a_rejected_proposal_then_the_current_plan_again_rebuilds_no_block(monkeypatch):
    # MCMC evaluates current + change, rejects it, then current + another change: the changed
    # ops get back from the cache the blocks their proposal's replaced, and nothing is built.
    graph, topo, cost = traced("mlp", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    candidates = candidate_configs(graph, 4, 1, topo.node_size)
    current = data_parallel(graph, 4)
    op = next(op for op, cfgs in candidates.items() if len(cfgs) > 1)
    proposal = current.replace(op, next(c for c in candidates[op] if c != current[op]))
    evaluate = Evaluator(graph, topo, cost)
    evaluate(current)
    evaluate(proposal)
    full = simulate_plan(graph, current, topo, cost)
    real, built = tasks._op_block, []
    monkeypatch.setattr(tasks, "_op_block", lambda node, *rest: built.append(node.name) or real(node, *rest))
    assert evaluate(current, summary=True) == full
    assert built == []


@pytest.mark.parametrize("name,topology,microbatches", [("gpt", "p100-2x2", 1), ("mlp", "local-cpu-4", 2)])
def test_delta_equals_full_with_reduction_cuts(name, topology, microbatches):
    """A walk whose every proposal for an op with a reduction dim cuts that dim (row-parallel
    linears, a vocab-parallel embedding: Partial pieces, ``Transfer.partial``, and the
    collectives that replace them where their readers form one, ``Lowered.collectives``; the
    loss on its classes: its class shards' sums): delta and full simulation agree to the bit on
    every figure."""
    graph = traced(name, batch_size=16)
    topo = get_topology(topology)
    n, cost = topo.num_devices, get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    candidates = candidate_configs(graph, n, microbatches, topo.node_size)
    reducing = {op: [c for c in cfgs if any(c.degrees[i] > 1 for i in graph[op].reduction_dims)]
                for op, cfgs in candidates.items()}
    ops = [op for op, cfgs in reducing.items() if cfgs]
    assert len(ops) >= 3 and graph.outputs[0] in ops  # the loss on its classes (vocab-parallel)
    rng = random.Random(7)
    current = data_parallel(graph, n).with_microbatches(microbatches, "1f1b")
    partial, kinds = 0, set()
    for _ in range(150):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(reducing[op]))
        assert_delta_equals_full(evaluate, proposal, (name, op, proposal[op].show()))
        kinds |= {c.kind for c in lower(graph, proposal).collectives}
        if rng.random() < 0.7:
            current = proposal
            partial += 1
    assert partial > 50 and "reduce_scatter" in kinds, kinds
    assert sum(any(c.degrees[i] > 1 for i in graph[op].reduction_dims) for op in ops for c in [current[op]]) >= 3


def test_replicas_walking_in_turn_rebuild_no_block_of_a_plan_seen_before(monkeypatch):
    # A chain's replicas (mcmc.REPLICAS) walk plans of their own in turn: each op keeps the
    # blocks of the plans before its last (taskcache.KNOWN), so going back to the first of four
    # plans that differ in other ops builds nothing, and every figure equals a full simulation.
    graph, topo, cost = traced("mlp", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    candidates = candidate_configs(graph, 4, 1, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    base = data_parallel(graph, 4)
    plans = [base.replace(op, next(c for c in candidates[op] if c != base[op])) for op in ops[:4]]
    assert len(plans) == 4
    evaluate = Evaluator(graph, topo, cost)
    for plan in plans:
        evaluate(plan)
    full = [simulate_plan(graph, plan, topo, cost) for plan in plans]
    real, built = tasks._op_block, []
    monkeypatch.setattr(tasks, "_op_block", lambda node, *rest: built.append(node.name) or real(node, *rest))
    assert [evaluate(plan, summary=True) for plan in plans] == full
    assert built == []


def test_delta_equals_full_on_replicas_walking_in_turn():
    # Four walks from data parallel share one Evaluator, three proposals each in turn (as a
    # chain's replicas): the blocks a walk finds again were built for another walk's plans.
    graph = traced("resnet101", batch_size=16)
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    candidates = candidate_configs(graph, 4, 1, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    rng = random.Random(3)
    walks = [data_parallel(graph, 4)] * 4
    for turn in range(8):
        current = walks[turn % 4]
        for _ in range(3):
            op = rng.choice(ops)
            proposal = current.replace(op, rng.choice(candidates[op]))
            assert_delta_equals_full(evaluate, proposal, ("resnet101", op, proposal[op].show()))
            if rng.random() < 0.5:
                current = proposal
        walks[turn % 4] = current


@pytest.mark.parametrize("name,topology", [("gpt", "p100-2x2"),  # its position embedding: a weight op's level
                                           pytest.param("resnet101", "p100-2x2", marks=pytest.mark.slow)])
def test_delta_equals_full_across_microbatch_counts_and_sharding_levels(name, topology):
    # A walk of one-op proposals (each with a drawn sharding level), micro-batch moves (another
    # count or schedule) and whole-plan sharding-level moves, as the search's micro-batch and
    # global moves make them: the counts and levels come back, so ops take the pieces of
    # another level (strategies.lowering_memo) and the blocks built for them. Every figure
    # equals a full simulation, and every lowering the one derived from scratch.
    graph = traced(name, batch_size=16)
    topo = get_topology(topology)
    n, cost = topo.num_devices, get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    spaces = {m: candidate_configs(graph, n, m, topo.node_size) for m in (1, 2)}
    rng = random.Random(11)
    current = data_parallel(graph, n)
    kinds = {"op": 0, "count": 0, "level": 0}
    for _ in range(14):
        u = rng.random()
        if u < 0.3:
            m = rng.choice([c for c in (1, 2) if c != current.microbatches])
            proposal, kind = current.with_microbatches(m, rng.choice(("gpipe", "1f1b"))), "count"
        elif u < 0.55:
            proposal, kind = sharded(current, graph, rng.choice((0, 1, 2, 3))), "level"
        else:
            candidates = spaces[current.microbatches]
            op = rng.choice([op for op, cfgs in candidates.items() if len(cfgs) > 1])
            cfg = rng.choice(candidates[op])
            proposal, kind = current.replace(op, cfg.with_memory(zero=rng.choice((0, 3)) if cfg.zero or any(
                w.trainable for w in graph[op].weights) else 0)), "op"
        try:
            want = lower(graph, proposal)
        except PlanError:
            continue
        assert_delta_equals_full(evaluate, proposal, (name, kind, proposal.microbatches))
        got = lower(graph, proposal, evaluate.lowering_cache)
        assert got.weight_shards == want.weight_shards and got.device_bytes == want.device_bytes
        assert got.pieces == want.pieces
        kinds[kind] += 1
        if rng.random() < 0.6:
            current = proposal
    assert min(kinds.values()) >= 3, kinds


def test_a_count_seen_before_under_other_sharding_levels_lowers_and_builds_nothing(monkeypatch):
    # Data parallel at 2 micro-batches, then at 1, then FSDP (level 3) at 2: every op's pieces
    # at 2 are data parallel's with the weight reads' levels set (strategies.lowering_memo) and
    # its block is the one built for them; nothing is lowered or built, and the figures are a
    # full simulation's.
    graph, topo, cost = traced("resnet101", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    dp = data_parallel(graph, 4)
    evaluate = Evaluator(graph, topo, cost)
    evaluate(dp.with_microbatches(2))
    evaluate(dp)
    lowered, built = [], []
    real_lower, real_block = lowering_cache.lower_op, tasks._op_block
    monkeypatch.setattr(lowering_cache, "lower_op", lambda g, s, node, *rest: lowered.append(node.name)
                        or real_lower(g, s, node, *rest))
    monkeypatch.setattr(tasks, "_op_block", lambda node, *rest: built.append(node.name) or real_block(node, *rest))
    fsdp = sharded(dp, graph, 3).with_microbatches(2)
    assert sum(c.zero == 3 for _, c in fsdp.configs) >= 30  # every conv and the fc
    delta = evaluate(fsdp, summary=True)
    assert lowered == [] and built == []
    monkeypatch.undo()
    assert_same_result(delta, simulate_plan(graph, fsdp, topo, cost, summary=True))


def test_a_plan_simulated_before_is_not_simulated_again(monkeypatch):
    # A micro-batch move and its reverse: the plan back at 1 micro-batch equals the first (a
    # new object) and gets its result without a simulation; a summary is simulated once where
    # the kept result has none; past evaluator.SEEN other plans the first is simulated again.
    graph, topo, cost = traced("mlp", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    simulated = []
    real = scorer.simulate_plan
    monkeypatch.setattr(scorer, "simulate_plan", lambda g, plan, *a, **k: simulated.append(plan) or real(g, plan, *a, **k))
    monkeypatch.setattr(scorer, "SEEN", 2)
    dp = data_parallel(graph, 4)
    first = evaluate(dp)
    evaluate(dp.with_microbatches(2))
    back = dp.with_microbatches(2).with_microbatches(1)
    assert back == dp and back is not dp
    assert evaluate(back) is first and len(simulated) == 2
    summed = evaluate(back, summary=True)
    assert len(simulated) == 3 and summed.busy_time and summed == simulate_plan(graph, dp, topo, cost)
    assert evaluate(back) is summed and evaluate(back, summary=True) is summed and len(simulated) == 3
    evaluate(dp.with_microbatches(4))
    evaluate(dp.with_microbatches(2, "1f1b"))  # two other plans since: the first is gone
    assert evaluate(dp) == first and len(simulated) == 6
