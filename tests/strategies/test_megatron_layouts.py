"""megatron lays out each distinct block once (``strategies.megatron._block_key``: the ops'
signatures, dims' names and wiring inside the block): a repeated layer's attention and MLP are
laid out on their first instance and copied op for op, and the plan equals the one that lays out
every block."""

import pytest

from strategies import megatron as megatron_module
from strategies.megatron import megatron, megatron_blocks
from tests.conftest import traced


@pytest.mark.parametrize("model, n, tp, pp, m, sp", [
    ("gpt", 4, 2, 1, 1, False), ("gpt", 4, 2, 2, 2, True), ("gpt", 4, 1, 4, 4, False),
    ("llama", 4, 2, 1, 2, True), ("llama", 4, 2, 2, 2, False)])
def test_each_distinct_block_is_laid_out_once_and_the_plan_is_unchanged(model, n, tp, pp, m, sp, monkeypatch):
    graph = traced(model, batch_size=16)
    blocks = megatron_blocks(graph)
    assert len(blocks) == 4  # 2 layers: attention and MLP each
    calls = []
    layout = megatron_module.block_layout
    monkeypatch.setattr(megatron_module, "block_layout", lambda *a, **k: calls.append(a[1]) or layout(*a, **k))
    shared = megatron(graph, n, tp, pp, m, sp)
    assert calls == blocks[:2]  # layer 1's blocks copy layer 0's
    calls.clear()
    monkeypatch.setattr(megatron_module, "_block_key", lambda graph, block: block)  # every block its own
    assert megatron(graph, n, tp, pp, m, sp) == shared and calls == blocks
