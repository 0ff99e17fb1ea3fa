"""Repeated blocks (strategies/repeats.py): a transformer's layers and a ResNet's bottlenecks
found as one block each, instance k's op i playing op i's part."""

import functools

import pytest

from soapsearch import trace, zoo
from strategies.repeats import repeated_blocks


@functools.cache
def _graph(name, variant):
    return trace(*zoo.build(name, variant, device="meta"))


def _alike(graph, block):
    for i in range(block.length):
        ops = [graph[inst[i]] for inst in block.instances]
        assert len({(n.kind, n.output.shape, tuple(w.spec.shape for w in n.weights)) for n in ops}) == 1


def test_gpt_default_has_its_12_layers_as_one_block():
    g = _graph("gpt", "default")
    blocks = repeated_blocks(g)
    assert [(len(b), b.length) for b in blocks] == [(12, 22)]
    assert [inst[0] for inst in blocks[0].instances] == [f"blocks_{k}_ln_1" for k in range(12)]
    assert blocks[0].position("blocks_5_ln_1") == (5, 0)
    assert blocks[0].position("lm_head") is None
    _alike(g, blocks[0])


def test_llama_3_8b_has_its_32_layers_as_one_block():
    g = _graph("llama", "default")
    blocks = repeated_blocks(g)
    assert [(len(b), b.length) for b in blocks] == [(32, 36)]
    assert blocks[0].instances[31][0] == "blocks_31_attn_norm"
    _alike(g, blocks[0])


def test_resnet101_bottlenecks_all_but_each_stages_first():
    """3 + 4 + 23 + 3 = 33 bottlenecks; the first of each stage has a downsample and another
    input width, so each stage's other 2, 3, 22, 2 (29) are one block each, 10 ops an instance
    (from the relu that ends the bottleneck before it to the residual add)."""
    g = _graph("resnet101", "default")
    blocks = repeated_blocks(g)
    assert sorted((len(b), b.length) for b in blocks) == [(2, 10), (2, 10), (3, 10), (22, 10)]
    assert sum(len(b) for b in blocks) == 29
    ops = {op for b in blocks for inst in b.instances for op in inst}
    assert not any("downsample" in op for op in ops)
    stage3 = max(blocks, key=len)
    assert [g[op].kind for op in stage3.instances[0]] == [
        "elementwise", "conv2d", "batchnorm2d", "elementwise", "conv2d", "batchnorm2d", "elementwise",
        "conv2d", "batchnorm2d", "add"]
    _alike(g, stage3)


def test_small_models():
    assert [(len(b), b.length) for b in repeated_blocks(_graph("gpt", "tiny"))] == [(2, 22)]
    assert repeated_blocks(_graph("mlp", "tiny")) == []
    assert repeated_blocks(_graph("alexnet", "tiny")) == []


@pytest.mark.parametrize("min_ops", [2, 23])
def test_min_ops(min_ops):
    blocks = repeated_blocks(_graph("gpt", "tiny"), min_ops=min_ops)
    assert len(blocks) == (1 if min_ops <= 22 else 0)
