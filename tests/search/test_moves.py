"""The sharding-level, recompute and micro-batch moves (soapsearch/search/moves.py): every
proposal is a valid plan, op/group/block moves keep an op's zero and recompute, a micro-batch
move is rejected before simulation where a config cannot take the count, delta simulation of
the moves equals full simulation, and any plan that fits ranks before any that does not.
These tests do not depend on what the simulator charges for zero or recompute."""

import random

import pytest

from strategies.errors import PlanError

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.result import SimResult
from simulator.simulate import simulate_plan
from soapsearch.search import search
from soapsearch.search.api import Evaluator
from soapsearch.search.config import SearchConfig
from soapsearch.search.mcmc import Budget, ChainStats, accept, candidate_configs, consider, rank, run_chain
from soapsearch.search.moves import MoveRates, Moves, microbatch_choices, neighbor_ops
from soapsearch.search.blockmove import BlockMoves
from strategies import data_parallel
from strategies.baselines import fsdp
from strategies.replicas import shardable
from tests.conftest import traced

N = 4


@pytest.fixture(scope="module")
def gpt():
    return traced("gpt", batch_size=16)


def _moves(graph, rates, choices=(1, 2, 4)):
    return Moves(graph, N, rates, microbatch_choices(graph, choices, 1))


def test_every_kind_of_proposal_is_a_valid_plan(gpt):
    """A property test: 600 proposals of every kind from a walk that accepts most of them."""
    moves = _moves(gpt, MoveRates(zero=0.3, recompute=0.3, microbatches=0.2))
    rng = random.Random(0)
    current = data_parallel(gpt, N)
    made = {"zero": 0, "recompute": 0, "microbatches": 0, "op": 0}
    counts, levels, schedules = set(), set(), set()
    for i in range(600):
        kind = ("zero", "recompute", "microbatches", "op")[i % 4]
        if kind == "op":
            space = moves.space(current.microbatches)
            op = rng.choice(space.ops)
            proposal = current.replace(op, rng.choice(space.candidates[op]).with_memory(
                current[op].zero, current[op].recompute))
        else:
            proposal = getattr(moves, kind)(current, rng)
        if proposal is None:
            continue
        made[kind] += 1
        proposal.validate(gpt)  # every config valid with the plan's own micro-batches
        for node in gpt:
            cfg = proposal[node.name]
            assert not cfg.zero or any(w.trainable for w in node.weights), node.name
            assert not cfg.recompute or node.kind not in ("input", "parameter", "constant"), node.name
        changed = [op for op in proposal if proposal[op] != current[op]]
        if kind == "zero":  # only levels move, only on ops whose shards have replicas
            assert changed and all(proposal[op].degrees == current[op].degrees for op in changed)
            assert all(shardable(gpt, current, op) for op in changed)
            assert len({proposal[op].zero for op in changed}) == 1
        if kind == "recompute":
            assert changed and len({proposal[op].recompute for op in changed}) == 1
        if kind == "microbatches":
            assert not changed and (proposal.microbatches, proposal.schedule) != (current.microbatches,
                                                                                   current.schedule)
            assert proposal.microbatches != current.microbatches or proposal.microbatches > 1
            schedules.add((proposal.microbatches > 1, proposal.schedule))
        counts.add(proposal.microbatches)
        levels |= {proposal[op].zero for op in proposal}
        if rng.random() < 0.8:
            current = proposal
    assert all(v >= 40 for v in made.values()), made
    assert counts == {1, 2, 4} and levels == {0, 1, 2, 3}
    assert {(True, "gpipe"), (True, "1f1b")} <= schedules


def test_a_micro_batch_count_a_config_cannot_take_is_rejected(gpt):
    moves = _moves(gpt, MoveRates(microbatches=1.0), choices=(1, 8))
    assert moves.choices == (1, 8)  # 16 samples: 1 and 8 divide them
    dp = data_parallel(gpt, N)  # the sample dim cut 4 ways: 16 / 8 micro-batches = 2 samples
    assert moves.microbatches(dp, random.Random(0)) is None
    two = data_parallel(gpt, 2)  # on 2 devices 16 / 8 = 2 samples take a cut in 2
    assert Moves(gpt, 2, MoveRates(microbatches=1.0), (1, 8)).microbatches(two, random.Random(0)).microbatches == 8
    # counts the batch does not divide are not offered
    assert microbatch_choices(gpt, (1, 2, 3, 5, 32), 1) == (1, 2)


def test_op_group_and_block_moves_keep_zero_and_recompute(gpt):
    """Every op at zero 3 (where it has a weight) and recomputed: a chain of op, group and block
    moves only, every proposal accepted, never drops either."""
    start = fsdp(gpt, N)
    start = start.__class__.of({op: cfg.with_memory(recompute=gpt[op].kind not in ("input", "parameter", "constant"))
                                for op, cfg in start.items()}, N)
    weighted = {op for op, cfg in start.items() if cfg.zero == 3}
    computing = {op for op, cfg in start.items() if cfg.recompute}
    seen = []
    flat = SimResult(1e-3, (), (0,), (1,), {}, 1)

    def evaluate(plan, summary=False):  # every plan costs the same: every proposal accepted
        seen.append(plan)
        return flat

    cands = candidate_configs(gpt, N, 1, None)
    stats = run_chain(start, evaluate, cands, Budget(proposals=400), random.Random(1),
                      neighbors=neighbor_ops(gpt, cands), blocks=BlockMoves(gpt, N, 1))
    assert stats.block_accepted >= 10 and len(seen) > 150  # (it stops once half its budget brings no gain)
    moved = set()
    for plan in seen:
        for op, cfg in plan.items():
            assert (cfg.zero == 3) == (op in weighted) and cfg.recompute == (op in computing), (op, cfg)
            moved.add((op, cfg.degrees, cfg.devices) != (op, start[op].degrees, start[op].devices))
    assert True in moved  # the degrees and devices did move


def test_block_move_keeps_memory_choices(gpt):
    blocks = BlockMoves(gpt, N)
    cols, mid, row = blocks.blocks[0]
    start = fsdp(gpt, N)
    start = start.replace(mid[0], start[mid[0]].with_memory(recompute=True))
    rng = random.Random(0)
    for _ in range(40):
        proposal = blocks.propose(start, rng)
        if proposal is None:
            continue
        for op in (*cols, row):
            assert proposal[op].zero == start[op].zero
        for op in mid:
            assert proposal[op].recompute == start[op].recompute


@pytest.mark.parametrize("rates", [MoveRates(zero=0.5, recompute=0.5), MoveRates(microbatches=1.0)])
def test_delta_equals_full_simulation_over_the_moves(gpt, rates):
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    evaluate = Evaluator(gpt, topo, cost, "adam")
    moves = _moves(gpt, rates)
    rng = random.Random(2)
    current = data_parallel(gpt, N).with_microbatches(1, "1f1b")
    checked = 0
    for _ in range(12):
        u = rng.random()
        proposal = (moves.microbatches if u < rates.microbatches else
                    moves.zero if u < rates.microbatches + rates.zero else moves.recompute)(current, rng)
        if proposal is None:
            continue
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(gpt, proposal, topo, cost, optimizer="adam", summary=True)
        assert (delta.iteration_time, delta.peak_memory_bytes, delta.busy_time, delta.bytes_moved) == \
            (full.iteration_time, full.peak_memory_bytes, full.busy_time, full.bytes_moved)
        checked += 1
        current = proposal
    assert checked >= 6


def _res(ms, fits):
    return SimResult(ms / 1e3, (), (0.5 if fits else 2.0,), (1.0,), {}, 1)


def test_any_fitting_plan_ranks_before_any_that_does_not():
    assert rank(True, 1e9) < rank(False, 1.0) and rank(True, 1.0) < rank(True, 2.0)
    stats = ChainStats()
    assert consider(stats, "over, fast", _res(1.0, False), 1.0, 0.0)
    assert consider(stats, "fits, slow", _res(1000.0, True), 1000.0, 0.0)  # fits: better
    assert not consider(stats, "over, faster", _res(0.5, False), 0.5, 0.0)
    assert consider(stats, "fits, faster", _res(999.0, True), 999.0, 0.0)
    assert stats.best == "fits, faster"
    rng = random.Random(0)
    # from a plan that does not fit, one that fits is always accepted, however slow
    assert all(accept(True, 1e6, False, 1.0, 1.0, rng) for _ in range(100))
    # the other way the Metropolis rule on the penalized cost decides
    assert not accept(False, 1e6, True, 1.0, 1.0, rng)
    assert accept(False, 0.5, True, 1.0, 1.0, rng)


def test_a_chain_that_finds_a_fitting_plan_returns_it():
    """A fake simulator where plans fit only with every weighted op at zero 3 and are slower for
    it: the zero move reaches that plan and the chain's best is it, not the faster plan that
    does not fit."""
    g = traced("mlp")
    weighted = [n.name for n in g if any(w.trainable for w in n.weights)]

    def evaluate(plan, summary=False):
        fits = all(plan[op].zero == 3 for op in weighted)
        sharded = sum(plan[op].zero for op in weighted)
        return _res(10.0 + sharded, fits)

    cands = candidate_configs(g, 2, 1, None)
    moves = Moves(g, 2, MoveRates(zero=0.9), (1,))
    stats = run_chain(data_parallel(g, 2), evaluate, cands, Budget(proposals=400), random.Random(0),
                      moves=moves)
    assert stats.best_result.fits and all(stats.best[op].zero == 3 for op in weighted)
    assert stats.best_cost == 10.0 + 3 * len(weighted)


def test_a_proposal_the_lowering_refuses_is_rejected_not_raised():
    """Some rules are checked only by the lowering (``strategies.zero``: each level-2/3 use pairs
    up across replicas): a proposal that breaks one is a rejected proposal, and the chain goes
    on to its budget."""
    g = traced("mlp")
    refused = []

    def evaluate(plan, summary=False):
        if any(plan[op].zero for op in plan):
            refused.append(plan)
            raise PlanError("layers_0", "zero", 2, "refused by the lowering")
        return _res(10.0, True)

    stats = run_chain(data_parallel(g, 2), evaluate, candidate_configs(g, 2, 1, None), Budget(proposals=200),
                      random.Random(0), moves=Moves(g, 2, MoveRates(zero=0.5), (1,)))
    assert refused and stats.proposals > 100 and all(not stats.best[op].zero for op in stats.best)


def test_search_with_every_move_is_deterministic_and_valid(gpt):
    kw = dict(topology="p100-1x4", budget_s=None, proposals=120, seed=5, chains=2, zero_move=0.2,
              recompute_move=0.2, microbatch_move=0.2, optimizer="adam")
    one, two = (search(gpt, workers=w, **kw) for w in (1, 2))
    assert one.strategy == two.strategy and one.predicted_ms == two.predicted_ms
    one.strategy.validate(gpt)
    assert {"zero1", "fsdp"} <= set(one.baselines)
    assert one.predicted_ms <= min(one.baselines.values()) * (1 + 1e-12)


@pytest.mark.parametrize("field,value,says", [
    ("zero_move", -0.1, "zero_move = -0.1: a probability is a number in \\[0, 1\\]"),
    ("recompute_move", True, "recompute_move = True"),
    ("microbatch_move", 0.9, "zero_move \\+ recompute_move \\+ microbatch_move \\+ subgraph_move = "
     "0.05 \\+ 0.05 \\+ 0.9 \\+ 0.05 = 1.05: "),
    ("microbatch_choices", (0, 2), "microbatch_choices = \\[0, 2\\]: must be whole numbers >= 1"),
])
def test_bad_rates_are_named(field, value, says):
    if field == "microbatch_move":
        SearchConfig(microbatch_move=0.85)  # 1.0 in all: allowed
        with pytest.raises(ValueError, match=says + "the probabilities of a proposal's kinds must sum to at most 1"):
            SearchConfig(microbatch_move=value)
        return
    with pytest.raises(ValueError, match=says):
        SearchConfig(**{field: value})


@pytest.mark.parametrize("name,n,m,node_size", [("alexnet", 16, 1, 4), ("mlp", 4, 2, None)])
def test_candidate_configs_are_enumerate_configs_one_object_per_cut(name, n, m, node_size):
    from strategies.config import enumerate_configs
    g = traced(name, "default" if name == "alexnet" else "tiny")
    got = candidate_configs(g, n, m, node_size)
    assert got == {node.name: list(enumerate_configs(node, n, m, node_size)) for node in g}
    cuts = {(c.degrees, c.devices) for cfgs in got.values() for c in cfgs}
    assert len({id(c) for cfgs in got.values() for c in cfgs}) == len(cuts)
    if name == "alexnet":
        assert (sum(map(len, got.values())), len(cuts)) == (3_266, 905)  # configs, distinct cuts (objects)


def test_memory_moves_set_one_op_of_every_instance(gpt):
    """A sharding-level or recompute move draws one op, one op at its place in every instance of
    a repeated block (the same linear of each layer), one Megatron block's ops or every op it
    applies to, and changes no op outside what it drew."""
    moves = _moves(gpt, MoveRates(zero=0.5, recompute=0.5, repeat=0.1))
    (block,) = moves.repeats.blocks
    assert len(block) == 2  # the test model's two layers
    columns = {op: [inst[i] for inst in block.instances] for inst in block.instances for i, op in enumerate(inst)}
    blocks = [list(b) for b in moves.blocks]
    drawn, scope = [], moves._scope
    moves._scope = lambda ops, rng: drawn.append((ops, scope(ops, rng))) or drawn[-1][1]
    rng = random.Random(1)
    current, seen = data_parallel(gpt, N), set()
    for i in range(400):
        kind = ("zero", "recompute")[i % 2]
        proposal = getattr(moves, kind)(current, rng)
        ops, picked = drawn[-1]
        if len(picked) == 1:
            seen.add("op")
        elif picked == [op for op in columns.get(picked[0], ()) if op in ops]:
            seen.add("repeated")
        elif any(picked == [op for op in b if op in ops] for b in blocks):
            seen.add("block")
        else:
            assert picked == list(ops), (kind, picked)
            seen.add("all")
        if proposal is None:
            continue
        assert {op for op in proposal if proposal[op] != current[op]} <= set(picked)
        if rng.random() < 0.5:
            current = proposal
    assert seen == {"op", "repeated", "block", "all"}, seen


def test_a_micro_batch_move_re_lays_the_targets_as_their_flatten_reads_them():
    """megatron T4 on 8 devices (d = 2) at 8 micro-batches of the 16 samples (one a replica):
    the targets are cut 2 samples x 4 of the sequence. Moved to 4 micro-batches (2 samples a
    replica), they are re-cut 4 x 2, so the loss's flattened view, cut 8 ways on its rows on the
    same devices, reads each block on its own device (no piece of the targets moves), as
    ``megatron`` lays them out at 4; the other ops keep their configs."""
    from strategies.lowering import lower
    from strategies.megatron import megatron

    graph = traced("gpt", "small")  # batch 16, 4 heads
    current = megatron(graph, 8, tp=4, microbatches=8, sequence_parallel=True).with_microbatches(8, "1f1b")
    assert current["targets"].degrees == (2, 4)
    moves = Moves(graph, 8, MoveRates(microbatches=1.0), (4, 8))
    proposal = moves.microbatches(current, random.Random(0))
    assert proposal.microbatches == 4
    assert proposal["targets"] == megatron(graph, 8, tp=4, microbatches=4, sequence_parallel=True)["targets"]
    assert proposal["targets"].degrees == (4, 2) and proposal["targets"].devices == current["targets"].devices
    assert [op for op, cfg in proposal.items() if cfg != current[op]] == ["targets"]
    assert not any(t.src_op == "targets" and not t.local for t in lower(graph, proposal).transfers)
    # without the re-cut the view would read the targets across devices
    kept = current.with_microbatches(4, "1f1b")
    assert any(t.src_op == "targets" and not t.local for t in lower(graph, kept).transfers)
