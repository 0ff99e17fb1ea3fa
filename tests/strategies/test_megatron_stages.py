"""The megatron baseline's stage boundaries (strategies/megatron_stages.py): each moved among
the ops between two blocks to where the fewest bytes cross it, after a layer's closing residual
add, as Megatron-LM cuts its layers (Narayanan et al. SC'21 §2.2, §4.1)."""

from strategies.lowering import lower
from strategies.megatron import megatron, megatron_blocks
from strategies.megatron_stages import _narrowest, _units
from tests.conftest import traced


def test_boundary_after_the_residual_add():
    g = traced("gpt")  # 2 layers: a boundary between them
    plan = megatron(g, 4, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    stage = {n.name: plan[n.name].devices[0] // 2 for n in g}
    assert stage["blocks_0_mlp_proj"] == 0 and stage["blocks_1_ln_1"] == 1 and stage["blocks_1_attn_q"] == 1
    crossing = {(t.src_op, t.dst_op) for t in lower(g, plan).transfers if t.src_device // 2 != t.dst_device // 2}
    # one tensor crosses, the residual stream, read by the next LayerNorm and the next residual add
    assert {src for src, _ in crossing} == {"add_2"} and {dst for _, dst in crossing} == {"blocks_1_ln_1", "add_3"}
    # each rank sends its own sequence shard to the same rank of the next stage: 2 readers x 2 ranks x 2 micro-batches
    moved = [t for t in lower(g, plan).transfers if t.src_device // 2 != t.dst_device // 2]
    assert len(moved) == 8 and all(t.dst_device == t.src_device + 2 for t in moved)


def test_narrowest_cut_by_hand():
    g = traced("gpt")
    units = _units(g, megatron_blocks(g))
    at = units.index(["blocks_1_ln_1"])
    assert units[at - 2:at] == [["blocks_0_mlp_dropout"], ["add_2"]] and len(units[at + 1]) > 1  # the next block
    # from any cut between the two blocks the boundary moves to the one before blocks_1_ln_1
    for start in (at - 2, at - 1, at, at + 1):
        assert _narrowest(g, units, [0, start]) == [0, at]
