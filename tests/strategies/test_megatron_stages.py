"""The megatron baseline's stage boundaries (strategies/megatron_stages.py): each moved among
the ops between two blocks to where the fewest bytes cross it, after a layer's closing residual
add, as Megatron-LM cuts its layers (Narayanan et al. SC'21 §2.2, §4.1)."""

import torch

from soapsearch import trace
from soapsearch._models.transformer import GPT, GPTConfig
from strategies.lowering import lower
from strategies.megatron import megatron, megatron_blocks
from strategies.megatron_stages import _narrowest, _units, megatron_stages
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
    assert units[at - 1] == ["add_2"] and units[at - 2][-2:] == ["blocks_0_mlp_proj", "blocks_0_mlp_dropout"]
    assert len(units[at + 1]) > 1  # the next block
    # from any cut between the two blocks the boundary moves to the one before blocks_1_ln_1
    for start in (at - 1, at, at + 1):
        assert _narrowest(g, units, [0, start]) == [0, at]


def test_a_row_linear_and_its_reduction_on_one_stage():
    """A block's unit ends with its row linear's readers, where the partial sums are reduced
    (Megatron-LM's RowParallelLinear reduces inside the layer): gpt's dropouts after attn_proj
    and mlp_proj, llama's residual adds after wo and w2 (no dropout between)."""
    gpt, llama = traced("gpt"), traced("llama")
    ends = {u[-2]: u[-1] for u in _units(gpt, megatron_blocks(gpt)) if len(u) > 1}
    assert ends == {f"blocks_{i}_{b}_proj": f"blocks_{i}_{b}_dropout" for i in (0, 1) for b in ("attn", "mlp")}
    ends = {u[-2]: u[-1] for u in _units(llama, megatron_blocks(llama)) if len(u) > 1}
    assert ends == {"blocks_0_attn_wo": "add_2", "blocks_0_mlp_w2": "add_3",
                    "blocks_1_attn_wo": "add_6", "blocks_1_mlp_w2": "add_7"}


def test_no_stage_starts_after_a_row_linear():
    """24 layers in 32 stages (more stages than layers, as GPT-3's 96 layers in 128): balanced
    by FLOPs alone, the stage after blocks_4_mlp_proj started at its dropout, so the partial
    sums crossed the boundary; now every row linear's readers are on its stage, and each of the
    32 stages still holds ops."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=24, n_head=2, n_embd=16, seq_len=16, vocab_size=50))
        tokens = torch.zeros(8, 16, dtype=torch.long)
    g = trace(model, (tokens, tokens), name="gpt-24-layers")
    blocks = megatron_blocks(g)
    stage = megatron_stages(g, blocks, 32)
    assert sorted(set(stage.values())) == list(range(32))
    for _, _, row in blocks:
        assert all(stage[u] == stage[row] for u in g.users(row)), row
