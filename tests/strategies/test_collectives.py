"""Collectives in the lowering (strategies/collectives.py) and their place in each member's order
(strategies.schedule.collective_calls): which reads become an all-reduce, a reduce-scatter or an
all-gather and which stay point to point, and that every member calls them in one order."""

from __future__ import annotations

import itertools
import random

import pytest

from simulator.comm import allgather_time, allreduce_time, collective_time, reduce_scatter_time
from simulator.presets import get_topology
from soapsearch.executor import build_model
from strategies import ParallelConfig
from strategies.errors import PlanError
from strategies.lowering import lower, lower_reference
from strategies.megatron import megatron
from strategies.schedule import collective_calls, device_order
from tests.conftest import traced
from tests.executor.plans import make_plan
from tests.simulator.test_step_order import _random_plan


def test_reduce_scatter_only_in_the_groups_order():
    """torch's reduce_scatter_tensor gives group rank i chunk i: readers of the chunks in
    another device order keep their Partial pieces point to point."""
    g = traced("gpt")
    plan = megatron(g, 2, 2, sequence_parallel=True)  # the dropout cut on the sequence (dim 1)
    low = lower(g, plan)
    [rs] = [c for c in low.collectives if c.op == "blocks_0_attn_proj"]
    assert (rs.kind, rs.devices, rs.dim, rs.holders) == ("reduce_scatter", (0, 1), 1, (0, 1))
    swapped = plan.replace("blocks_0_attn_dropout", ParallelConfig(plan["blocks_0_attn_dropout"].degrees, (1, 0)))
    low = lower(g, swapped)
    assert not [c for c in low.collectives if c.op == "blocks_0_attn_proj"]
    moved = [t for t in low.transfers if t.src_op == "blocks_0_attn_proj" and not t.local]
    assert moved and all(t.partial for t in moved)


def test_all_reduce_when_every_reader_reads_the_whole_region():
    """A column-parallel linear reading a row-parallel one: each of its partitions reads the
    whole Partial region: one all-reduce over the holders, no piece point to point."""
    g = build_model("tests.executor.models:bottleneck", "tiny", dtype="float64").graph
    low = lower(g, make_plan(g, "rowcol", 4))
    [c] = low.collectives
    assert (c.kind, c.op, c.devices, c.dim, c.grad) == ("all_reduce", "down", (0, 1, 2, 3), None, True)
    assert c.sent == 2 * 3 * c.nbytes // 4  # a ring all-reduce: 2(n−1)/n per member
    assert [(r.dst_op, r.dst_index) for r in low.collective_readers[c]] == [("up", k) for k in range(4)]
    assert not [t for t in low.transfers if t.src_op == "down"]


def test_one_all_gather_serves_every_reader_op():
    """q, k and v read ln_1's sequence shards whole: one all-gather per tensor-parallel group
    and micro-batch, read by all three; the lowering and lower_reference agree."""
    g = traced("gpt", batch_size=8)
    plan = megatron(g, 4, 2).with_microbatches(2, "1f1b")
    low = lower(g, plan)
    gathers = [c for c in low.collectives if c.op == "blocks_0_ln_1"]
    assert sorted((c.devices, c.microbatch) for c in gathers) == [((0, 1), 0), ((0, 1), 1), ((2, 3), 0), ((2, 3), 1)]
    for c in gathers:
        assert {r.dst_op for r in low.collective_readers[c]} == {"blocks_0_attn_q", "blocks_0_attn_k",
                                                                 "blocks_0_attn_v"}
    assert low.pieces == lower_reference(g, plan).pieces


def _calls_agree(low) -> int:
    """Assert every member calls each collective once forward (and once backward where its
    gradient moves) and that any two collectives sharing members are called in one relative
    order on all of them; returns the number of collectives."""
    order = device_order(low)
    calls = collective_calls(low, order)
    seq = {d: [(c.collective, c.backward) for c in cs] for d, cs in calls.items()}
    for i, c in enumerate(low.collectives):
        for d in c.devices:
            assert seq[d].count((i, False)) == 1 and seq[d].count((i, True)) == int(c.grad)
    for d, e in itertools.combinations(sorted(seq), 2):
        common = set(seq[d]) & set(seq[e])
        assert [x for x in seq[d] if x in common] == [x for x in seq[e] if x in common], (d, e)
    for d, cs in calls.items():  # each call at a step of the member's own order
        assert all(c.step in order[d] for c in cs)
    return len(low.collectives)


@pytest.mark.parametrize("name", ["mlp", "gpt", "alexnet", "nmt"])
@pytest.mark.parametrize("microbatches,schedule", [(1, "gpipe"), (2, "1f1b"), (4, "gpipe")])
def test_members_call_collectives_in_one_order(name, microbatches, schedule):
    graph = traced(name)
    rng = random.Random(f"{name}/{microbatches}/{schedule}")
    found = 0
    for _ in range(16):
        try:
            low = lower(graph, _random_plan(graph, rng, microbatches, schedule))
        except PlanError:
            continue
        found += _calls_agree(low)
    assert found > 0


def test_ring_formulas():
    """Patarasuk & Yuan 2009: a ring reduce-scatter or all-gather moves (n−1)/n of the region
    per member in n−1 steps, an all-reduce both."""
    topo = get_topology("a100-1x8")
    group, nbytes = (0, 1, 2, 3), 1 << 20
    rs = reduce_scatter_time(topo, group, nbytes)
    assert collective_time(topo, "reduce_scatter", group, nbytes) == rs
    assert collective_time(topo, "all_gather", group, nbytes) == allgather_time(topo, group, nbytes / 4)
    assert collective_time(topo, "all_reduce", group, nbytes) == allreduce_time(topo, group, nbytes)
    assert rs == pytest.approx(collective_time(topo, "all_gather", group, nbytes), rel=1e-12)
    assert 2 * rs == pytest.approx(allreduce_time(topo, group, nbytes), rel=1e-12)
