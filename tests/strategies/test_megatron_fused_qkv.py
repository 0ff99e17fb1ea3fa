"""The megatron baseline on the zoo GPT with Megatron-LM's fused query-key-value linear
(``GPTConfig.fused_qkv``: one ``Linear(C, 3C)``, its output per head [q k v]): the linear cut
column-parallel over whole heads, the view, the three slices and the attention by heads on the
same devices, so no byte moves inside the block, and one layer moves what the three linears'
plan moves (Megatron-LM's two all-reduces of b·s·h each way a block)."""

from __future__ import annotations

import functools

import pytest

from soapsearch import trace, zoo
from strategies import baseline
from strategies.baselines import megatron_lm
from strategies.lowering import lower
from strategies.megatron import megatron, megatron_blocks
from tests.strategies.test_megatron import _layer_bytes

HEADS, WIDTH = 8, 64
"""8 heads of 8: one head a device at TP 8."""


@functools.lru_cache(maxsize=None)
def _gpt(fused: bool):
    model, inputs = zoo.build("gpt", "tiny", batch_size=8, device="meta", n_head=HEADS, n_embd=WIDTH,
                              fused_qkv=fused)
    return trace(model, inputs, name="gpt-fused" if fused else "gpt")


def test_block_is_the_fused_linear_then_the_heads():
    g = _gpt(True)
    cols, middle, row = megatron_blocks(g)[0]
    assert (cols, row) == (("blocks_0_attn_qkv",), "blocks_0_attn_proj")
    assert [g[m].kind for m in middle] == ["reshape", "slice", "permute", "slice", "permute", "slice", "permute",
                                           "attention", "permute", "reshape"]


@pytest.mark.parametrize("devices,tp", [(8, 8), (8, 4), (8, 2)])
def test_each_device_computes_whole_heads(devices, tp):
    """Device i·t + j (sample shard i, tensor-parallel member j) computes qkv's columns [j·3C/t, (j+1)·3C/t),
    which the per-head layout makes heads [j·H/t, (j+1)·H/t) (their q, k and v), and the
    attention of those heads: every piece inside the block is read on its own device."""
    g = _gpt(True)
    plan = megatron(g, devices, tp)
    plan.validate(g)
    low = lower(g, plan)
    low.check_whole("the test")
    d, width, heads = devices // tp, 3 * WIDTH // tp, HEADS // tp
    for p in low.partitions["blocks_0_attn_qkv"][0]:
        j = p.device % tp
        assert p.output[2] == (j * width, (j + 1) * width) and p.output[0][1] - p.output[0][0] == 8 // d, p
    attention = g["scaled_dot_product_attention"]
    h = [dim.name for dim in attention.dims].index("heads")
    for p in low.partitions[attention.name][0]:
        j = p.device % tp
        assert p.box[h] == (j * heads, (j + 1) * heads), p
    _, middle, row = megatron_blocks(g)[0]
    inside = {"blocks_0_attn_qkv", *middle, row}
    into = [t for t in low.transfers if t.dst_op in inside and t.src_op in inside]
    assert into and all(t.local for t in into)


@pytest.mark.parametrize("sp", [False, True])
def test_one_layer_moves_what_the_three_linears_move(sp):
    """The fused model's plan moves the bytes of the three linears' plan, layer for layer:
    ln_1's output all-gathered once into the one linear as it was into q, k and v."""
    fused, separate = _gpt(True), _gpt(False)
    got = _layer_bytes(fused, megatron(fused, 8, 4, sequence_parallel=sp), "blocks_0_ln_1", "add_1")
    assert got == _layer_bytes(separate, megatron(separate, 8, 4, sequence_parallel=sp), "blocks_0_ln_1", "add_1")
    assert got[0] > 0
    low = lower(fused, megatron(fused, 8, 4, sequence_parallel=sp))
    readers = {r.dst_op for c in low.collectives if c.op == "blocks_0_ln_1" for r in low.collective_readers[c]}
    assert readers == {"blocks_0_attn_qkv"}


def test_megatron_lm_plan_is_valid():
    """``megatron_lm`` (TP × PP with sequence parallelism, every layer recomputed, ZeRO-1, bf16)
    and the ``megatron`` baseline with recompute take the fused model."""
    g = _gpt(True)
    plan = megatron_lm(g, 8, tp=4, pp=2, micro_batch=1)
    plan.validate(g)
    assert plan["blocks_0_attn_qkv"].degrees == (1, 1, 4, 1) and plan["blocks_0_attn_qkv"].recompute
    assert set(plan["blocks_0_attn_qkv"].devices) == {0, 1, 2, 3} and set(plan["blocks_1_attn_qkv"].devices) == {
        4, 5, 6, 7}
    baseline("megatron", g, 8, tp=2, recompute=True).validate(g)
