"""The megatron baseline (strategies/megatron.py): the blocks it finds by structure, the cuts it
gives them, and the bytes one transformer layer moves against Megatron-LM's count (Narayanan et
al. 2021; Korthikanti et al. 2022): per layer and tensor-parallel group, 2 all-reduces of
b·s·h elements forward and 2 backward, which sequence parallelism moves as 2 all-gathers and
2 reduce-scatters each way: (t−1)·b·s·h elements over the t devices of a group for each
(a ring's (t−1)/t per member), 2(t−1)·b·s·h per all-reduce."""

import pytest

from strategies import PlanError, baseline
from strategies.graph import DTYPE_BYTES
from strategies.lowering import lower
from strategies.megatron import default_tp, megatron, megatron_blocks
from tests.conftest import traced


def test_blocks_are_found_by_structure():
    g = traced("gpt")
    blocks = megatron_blocks(g)
    assert [(cols, row) for cols, _, row in blocks] == [
        (("blocks_0_attn_q", "blocks_0_attn_k", "blocks_0_attn_v"), "blocks_0_attn_proj"),
        (("blocks_0_mlp_fc",), "blocks_0_mlp_proj"),
        (("blocks_1_attn_q", "blocks_1_attn_k", "blocks_1_attn_v"), "blocks_1_attn_proj"),
        (("blocks_1_mlp_fc",), "blocks_1_mlp_proj")]
    assert blocks[0][1][-3:] == ("scaled_dot_product_attention", "transpose_3", "view_3")
    assert blocks[1][1] == ("blocks_0_mlp_gelu",)
    assert default_tp(g, 8) == 2  # 2 heads


def test_cuts_column_row_heads_and_sequence():
    g = traced("gpt")  # batch 4, seq 8
    plan = megatron(g, 4, tp=2)
    show = {n.name: plan[n.name].show(n.dims) for n in g}
    assert show["blocks_0_attn_q"] == "S2·P2 @ 0-3" and show["blocks_0_mlp_fc"] == "S2·P2 @ 0-3"
    assert show["blocks_0_attn_proj"] == "S2·R2 @ 0-3" and show["blocks_0_mlp_proj"] == "S2·R2 @ 0-3"
    heads = g["scaled_dot_product_attention"].dims[1]
    assert heads.name == "heads" and plan["scaled_dot_product_attention"].degrees[:2] == (2, 2)
    assert plan["blocks_0_ln_1"].degrees == (2, 2, 1)  # sample × sequence
    assert show["wte"] == "S2·R2 @ 0-3"  # vocab-parallel embedding
    assert plan["cross_entropy"].degrees == (4,)


def _layer_bytes(g, plan, first, last):
    """(forward, backward) bytes moved into the ops from ``first`` to ``last``: their remote
    pieces and what every member of their collectives sends (``Collective.sent``)."""
    names = [n.name for n in g]
    layer = set(names[names.index(first):names.index(last) + 1])
    low = lower(g, plan)
    remote = [t for t in low.transfers if not t.local and t.dst_op in layer]
    shared = [c for c in low.collectives if low.collective_readers[c][0].dst_op in layer]
    return (sum(t.nbytes for t in remote) + sum(c.sent * len(c.devices) for c in shared),
            sum(t.nbytes for t in remote if g.moves_grad(t.src_op, t.dst_op))
            + sum(c.sent * len(c.devices) for c in shared if c.grad))


@pytest.mark.parametrize("devices,tp", [(2, 2), (4, 2), (8, 2)])
def test_one_layer_moves_megatron_lm_bytes(devices, tp):
    g = traced("gpt")
    b, s, h = 4 // (devices // tp), 8, 16  # per data-parallel replica (one tensor-parallel group)
    item = DTYPE_BYTES[g["blocks_0_mlp_proj"].output.dtype]
    groups = devices // tp
    all_reduce = 2 * (tp - 1) * b * s * h * item * groups  # a ring's bytes over each group's t devices
    plan = megatron(g, devices, tp)
    low = lower(g, plan)
    # the MLP: an all-gather of ln_2's sequence shards into fc, a reduce-scatter of proj's
    # Partial sums into the sequence-cut dropout; their duals backward: one all-reduce each way
    assert _layer_bytes(g, plan, "blocks_0_ln_2", "add_2") == (all_reduce, all_reduce)
    # attention: the same; q, k and v read ln_1's output through one all-gather (as Megatron's
    # fused qkv linear does)
    assert _layer_bytes(g, plan, "blocks_0_ln_1", "add_1") == (all_reduce, all_reduce)
    layer = [c for c in low.collectives if c.op.startswith("blocks_0_")]
    assert sorted((c.kind, c.op) for c in layer if c.devices == tuple(range(tp))) == [
        ("all_gather", "blocks_0_ln_1"), ("all_gather", "blocks_0_ln_2"),
        ("reduce_scatter", "blocks_0_attn_proj"), ("reduce_scatter", "blocks_0_mlp_proj")]
    assert all(c.nbytes == b * s * h * item and c.grad for c in layer)
    assert {r.dst_op for c in layer if c.op == "blocks_0_ln_1" for r in low.collective_readers[c]} == {
        "blocks_0_attn_q", "blocks_0_attn_k", "blocks_0_attn_v"}
    # no Partial piece moves point to point anywhere in the plan
    assert not any(t.partial and not t.local for t in low.transfers)


def test_bad_tensor_parallel_degree():
    g = traced("gpt")
    with pytest.raises(PlanError, match=r"tp = 3: tensor-parallel degree must be a whole number dividing num_devices \(4\)"):
        megatron(g, 4, tp=3)
    assert baseline("megatron", g, 4, tp=2) == megatron(g, 4, 2)
