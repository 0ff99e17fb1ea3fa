"""ZeRO-3 prefetch units of whole repeated blocks (``Strategy.fsdp_unit`` "block",
``strategies.prefetch``: FSDP2's ``fully_shard`` per transformer layer): the unit rule by hand,
its issue points on zoo gpt tiny (2 layers) under the ``fsdp`` baseline, the simulated call
times by hand, the memory held ahead, and delta = full on a walk of proposals."""

from __future__ import annotations

from simulator.comm import allgather_time
from simulator.presets import get_topology
from strategies.baselines import fsdp
from strategies.lowering import lower
from strategies.prefetch import block_units, gathered_bytes, issue_positions, step_units
from strategies.schedule import device_order
from strategies.zero import gather_groups
from tests.conftest import traced
from tests.simulator.delta_walk import delta_walk
from tests.simulator.test_prefetch import _times


def test_units_issue_one_unit_ahead_by_hand():
    # units a a a | b b | (own) | c c: a's gathers at a's first gathering step (0), b's at a's
    # first (0), the own step's at b's first (3), c's at the own step (5)
    gathers = [True, True, False, True, True, True, False, True]
    units = ["a", "a", "a", "b", "b", None, "c", "c"]
    assert issue_positions(gathers, units) == [0, 0, 2, 0, 0, 3, 6, 5]
    assert issue_positions(gathers, [None] * 8) == issue_positions(gathers) == [0, 0, 2, 1, 3, 4, 6, 5]


def _plan():
    g = traced("gpt")
    return g, fsdp(g, 2)


def _gathering(low, d=0):
    order = device_order(low)[d]
    reads = {(u.op, u.partitions[u.devices.index(d)]) for u in gather_groups(low) if u.zero == 3}
    flags = [(s.op, s.index) in reads for s in order]
    return order, flags, issue_positions(flags, step_units(low, order))


def test_the_fsdp_baseline_issues_each_layer_one_layer_ahead():
    g, plan = _plan()
    assert plan.fsdp_unit == "block"
    assert sorted(set(block_units(g).values())) == [(0, 0), (0, 1)]  # gpt tiny's 2 layers, 22 ops each
    low = lower(g, plan)
    order, flags, issue = _gathering(low)
    at = {(s.backward, s.op): order[issue[q]].op for q, s in enumerate(order) if flags[q]}
    weighted = ("ln_1", "attn_q", "attn_k", "attn_v", "attn_proj", "ln_2", "mlp_fc", "mlp_proj")
    for w in weighted:
        assert at[(False, f"blocks_0_{w}")] == "add"  # the unit before layer 0: the position embedding's add
        assert at[(False, f"blocks_1_{w}")] == "blocks_0_ln_1"  # layer 1's at layer 0's first gathering step
        assert at[(True, f"blocks_1_{w}")] == "ln_f"  # backward: layer 1 after ln_f
        assert at[(True, f"blocks_0_{w}")] == "blocks_1_mlp_proj"  # layer 0's at layer 1's first
    assert at[(False, "ln_f")] == "blocks_1_ln_1" and at[(False, "lm_head")] == "ln_f"
    # per op (fsdp_unit "op"): each step at the previous gathering step's start
    order, flags, issue = _gathering(lower(g, plan.with_fsdp_unit("op")))
    at = {(s.backward, s.op): order[issue[q]].op for q, s in enumerate(order) if flags[q]}
    assert at[(False, "blocks_1_mlp_fc")] == "blocks_1_ln_2" and at[(True, "blocks_0_mlp_fc")] == "blocks_0_mlp_proj"


def test_the_calls_start_where_the_previous_layer_starts_by_hand():
    # on p100-2x2 a layer's groups on devices 0-1 move in one all-gather per pass (FSDP2's one
    # per fully_shard unit): member i's chunk of each of its 8 groups, 13,120 / 2 = 6,560 B in
    # all, so it lasts allgather_time(6,560 B); layer 1's forward call is made at the start of
    # layer 0's first gathering step (its ln_1) and is done before layer 1's first forward step
    g, plan = _plan()
    topo = get_topology("p100-2x2")
    tg, names, start, end = _times(lower(g, plan))
    at = {x: i for i, x in enumerate(names)}
    first = start[at["fwd blocks_0_ln_1[0]@mb0"]]
    gathers = [x for x in names if x.startswith("allgather ") and " block0." in x]
    assert sorted(gathers) == [f"allgather {p} block0.{i} 0-1 @mb0 zero3" for p in ("bwd", "fwd") for i in (0, 1)]
    ag = at["allgather fwd block0.1 0-1 @mb0 zero3"]
    src, dst = tg.edge_arrays()
    # each member's call: at the end of the step before layer 0's first (the embedding's dropout)
    assert sorted(names[s] for s in src[dst == ag].tolist()) == ["fwd drop[0]@mb0", "fwd drop[1]@mb0"]
    assert start[ag] == first
    assert tg.duration[ag] == allgather_time(topo, (0, 1), 6_560)
    assert end[ag] <= start[at["fwd blocks_1_ln_1[0]@mb0"]]
    assert not [x for x in names if x.startswith("allgather fwd ") and " blocks_1_" in x]  # no call per op


def test_layer_units_hold_the_next_layer_ahead():
    # gpt tiny's level-3 groups on 2 devices: a layer's weights are 13,120 B in all (ln_1 and
    # ln_2 128 each, q, k, v and proj 1,088 each, fc 4,352, proj 4,160), gathered in one call
    # whose buffer lives until its last reader copies it out. At layer 0's mlp_fc step device 0
    # holds fc's weights and gradient (2 x 4,352 B), layer 0's call buffer (13,120 B; proj
    # reads it later) and layer 1's, issued at layer 0's first step (13,120 B): 34,944 B, the
    # most at any step (units of one op: 12,864 B)
    g, plan = _plan()
    low = lower(g, plan)
    layer = [u for u in gather_groups(low) if u.op.startswith("blocks_0_")]
    assert sum(u.nbytes for u in layer) == 13_120
    assert max(u.nbytes for u in layer) == 4_352
    assert gathered_bytes(low) == (2 * 4_352 + 2 * 13_120,) * 2 == (34_944,) * 2
    assert gathered_bytes(lower(g, plan.with_fsdp_unit("op"))) == (12_864,) * 2


def test_delta_equals_full_with_layer_units():
    graph = traced("gpt", batch_size=16)
    assert fsdp(graph, 4).fsdp_unit == "block"
    walked = delta_walk(graph, "p100-2x2", lambda n: fsdp(graph, n), (0, 3, 3), seed=3)
    assert len(walked) >= 10 and all(low.strategy.fsdp_unit == "block" for low in walked)
