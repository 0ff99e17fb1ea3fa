"""Member folding's classes (``strategies.member_symmetry``): the tensor-parallel members found
from the Strategy, the lowering's check that keeps them apart, and the classes of alike members;
a per-device simulation proves each class alike (busy time per device to round-off, peak memory
per device equal) and member 0 apart where it holds the row-parallel biases. Plans whose members
are not alike (an uneven cut, an op on one member only, a transfer across members, data
parallel) have no member fold."""

from __future__ import annotations

import random

import pytest

from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from strategies import ParallelConfig, Strategy
from strategies.baselines import data_parallel, megatron_lm, recomputed
from strategies.lowered import WEIGHT_KINDS
from strategies.lowering import lower
from strategies.megatron import megatron
from strategies.member_symmetry import find_members, member_classes, members_apart
from tests.conftest import traced


def _plans():
    tiny, small = traced("gpt", "tiny"), traced("gpt", "small")
    sp = megatron(tiny, 8, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    return [
        pytest.param(tiny, sp, "a100-1x8", 2, ((0,), (1,)), id="megatron-sp-gpipe"),
        pytest.param(tiny, recomputed(sp.with_microbatches(2, "1f1b"), tiny), "a100-1x8", 2, ((0,), (1,)),
                     id="megatron-sp-1f1b-recompute"),
        # 1F1B, 8 micro-batches, sequence parallel, recompute, ZeRO-1, bf16
        pytest.param(small, megatron_lm(small, 16, 4, 2), "a100-2x8", 4, ((0,), (1, 2, 3)), id="megatron_lm-T4-P2-D2"),
    ]


@pytest.mark.parametrize("graph,plan,preset,count,classes", _plans())
def test_classes_alike_in_the_per_device_simulation(graph, plan, preset, count, classes):
    found = find_members(graph, plan)
    assert found is not None and found.count == count
    assert found.size * count == plan.num_devices
    for i, group in enumerate(found.groups):  # each group: T devices of one stage and copy
        assert len(group) == count and min(group) == found.members[0][i]
    lowered = lower(graph, plan)
    assert members_apart(lowered, found) is None
    assert member_classes(lowered, found) == classes
    result = simulate_plan(graph, plan, get_topology(preset), fold=False)
    busy, peak = result.busy_time, result.peak_memory_bytes
    for cls in classes:
        for m in cls[1:]:
            for d0, d in zip(found.members[cls[0]], found.members[m]):
                assert busy[d] == pytest.approx(busy[d0], rel=1e-12, abs=0)
                assert peak[d] == peak[d0]
    # member 0 reads the row-parallel biases (and holds the position table): more bytes, more work
    for d0, d1 in zip(found.members[0], found.members[1]):
        assert peak[d0] > peak[d1]
        assert busy[d0] != busy[d1]


def test_transfer_across_members_is_named():
    graph = traced("llama", "tiny")
    plan = megatron(graph, 8, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    found = find_members(graph, plan)
    assert found is not None and found.count == 4
    why = members_apart(lower(graph, plan), found)
    assert why is not None and why.startswith("transfer view[1] -> transpose[0]: device 1 -> 0 crosses members")


def test_no_members_where_the_plan_is_not_alike():
    graph = traced("gpt", "tiny")
    assert find_members(graph, data_parallel(graph, 4)) is None  # groups of one device
    plan = megatron(graph, 8, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    # seq 8 cut 3 ways on ln_1: uneven shards
    ln = graph["blocks_0_ln_1"]
    c = plan[ln.name]
    uneven = ParallelConfig((2, 3, 1), (0, 1, 2, 3, 4, 5), c.zero, c.recompute)
    assert ln.dims[1].size % 3
    assert find_members(graph, _with(plan, ln.name, uneven)) is None
    # the first block's q projection whole on member 0's devices (one per sample coordinate)
    q = graph["blocks_0_attn_q"]
    c = plan[q.name]
    lone = ParallelConfig((2, 1, 1, 1), (0, 2), c.zero, c.recompute)
    assert find_members(graph, _with(plan, q.name, lone)) is None
    # the loss's flattened tokens (one dim, cut on samples alone) on member 0's devices only:
    # not closed under ψ
    flat = next(n for n in graph if n.kind == "reshape" and len(n.dims) == 1)
    assert plan[flat.name].devices == (4, 5, 6, 7)
    c = plan[flat.name]
    assert find_members(graph, _with(plan, flat.name, ParallelConfig((2,), (4, 6), c.zero, c.recompute))) is None
    assert find_members(graph, _with(plan, flat.name, ParallelConfig((2,), (4, 5), c.zero, c.recompute))) is not None


def _with(plan: Strategy, op: str, config: ParallelConfig) -> Strategy:
    configs = dict(plan.configs)
    configs[op] = config
    return Strategy.of(configs, plan.num_devices, plan.microbatches, plan.schedule, plan.precision)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_memory_features_keep_the_classes(seed):
    """megatron at T 4, P 2, D 2 under GPipe or 1F1B with each op's recompute and ZeRO level
    drawn at random: the classes are the same and each stays alike in the per-device simulation."""
    graph = traced("gpt", "small")
    rng = random.Random(seed)
    schedule = rng.choice(("gpipe", "1f1b"))
    base = megatron(graph, 16, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    configs = {}
    for node in graph:
        c = base[node.name]
        zero = rng.choice((0, 1, 2, 3)) if any(w.trainable for w in node.weights) else 0
        recompute = node.kind not in (*WEIGHT_KINDS, "input") and graph.needs_grad[node.name] and rng.random() < 0.3
        configs[node.name] = c.with_memory(zero, recompute)
    plan = Strategy.of(configs, 16, 2, schedule)
    found = find_members(graph, plan)
    assert found is not None and found.count == 4 and found.size == 4
    lowered = lower(graph, plan)
    assert members_apart(lowered, found) is None
    assert member_classes(lowered, found) == ((0,), (1, 2, 3))
    result = simulate_plan(graph, plan, get_topology("a100-2x8"), fold=False)
    busy, peak = result.busy_time, result.peak_memory_bytes
    for m in (2, 3):
        for d1, d in zip(found.members[1], found.members[m]):
            assert busy[d] == pytest.approx(busy[d1], rel=1e-12, abs=0)
            assert peak[d] == peak[d1]
