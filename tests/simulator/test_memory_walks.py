"""``memory_breakdown``'s three activation walks (without the collectives, with them, with the
buckets) share their rows (``simulator.memory_walks.Walks``): each equals ``activation_peaks`` run
alone, whatever order they are asked in, on per-device, copy-0 and member-folded lowerings."""

from __future__ import annotations

import pytest

from simulator.memory import memory_breakdown
from simulator.memory_walks import Walks, activation_peaks
from simulator.presets import get_topology
from simulator.simulate import Lowerings
from strategies.baselines import megatron_lm, recomputed
from strategies.lowering import lower
from strategies.megatron import megatron
from tests.conftest import traced

WALKS = [(False, False), (True, False), (True, True), (False, True)]


def _lowerings():
    small = traced("gpt", "small")
    sp = megatron(small, 16, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    one = recomputed(sp.with_microbatches(2, "1f1b"), small)
    yield pytest.param(small, lambda: lower(small, one), id="megatron-1f1b-recompute")
    yield pytest.param(small, lambda: lower(small, megatron_lm(small, 16, 4, 2)), id="megatron_lm")
    lm = megatron_lm(small, 16, 4, 2)
    yield pytest.param(small, lambda: Lowerings(small, lm).first(get_topology("a100-2x8"), True),
                       id="megatron_lm-member-fold")
    yield pytest.param(small, lambda: Lowerings(small, one).first(get_topology("a100-2x8"), True, False),
                       id="megatron-copy-0")
    gpt = traced("gpt")  # 4 blocks: 2 ranks x 2 chunks
    yield pytest.param(gpt, lambda: lower(gpt, megatron(gpt, 4, tp=2, pp=2, microbatches=4, virtual_stages=2,
                                                        sequence_parallel=True)), id="interleaved")


@pytest.mark.parametrize("graph,make", list(_lowerings()))
def test_shared_walks_equal_each_walk_alone(graph, make):
    lowered = make()
    alone = {w: activation_peaks(lowered, None, *w) for w in WALKS}
    assert alone[True, True] != alone[False, False]  # the walks differ: sharing a wrong row shows
    for order in (WALKS, WALKS[::-1]):
        walks = Walks(lowered, None)
        assert {w: walks.peaks(*w) for w in order} == alone
    got = memory_breakdown(lowered, "adam")
    assert [b.activations for b in got] == alone[False, False]
    assert [b.activations + b.collective_buffers for b in got] == alone[True, False]
    assert [b.activations + b.collective_buffers + b.gradient_buckets for b in got] == alone[True, True]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_folded_walk_is_the_representatives_columns(schedule):
    """A folded lowering's walk runs on one column per representative device (``memory_rows.Columns``:
    members 0 and 1 of each tensor-parallel group of copy 0 here), fewer than the devices, and
    gives every device the peaks the per-device lowering's walk over every column gives it
    (1F1B and interleaved, member-folded)."""
    from simulator.memory_rows import columns_of

    small = traced("gpt", "small")
    if schedule == "1f1b":
        plan, topo = recomputed(megatron_lm(small, 16, 4, 2), small), get_topology("a100-2x8")
    else:
        plan = megatron(small, 32, tp=4, pp=2, microbatches=4, sequence_parallel=True, virtual_stages=2)
        topo = get_topology("a100-4x8")
    folded = Lowerings(small, plan).first(topo, True)
    columns = columns_of(folded, plan.num_devices)
    assert columns is not None and 0 < len(columns.devices) <= plan.num_devices // 2
    assert Walks(folded, None).walk(True).rows[0].shape[1] == len(columns.devices)
    whole = lower(small, plan)
    for w in WALKS:
        assert activation_peaks(folded, None, *w) == activation_peaks(whole, None, *w), w
