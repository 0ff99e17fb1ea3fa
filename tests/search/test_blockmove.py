"""The block move (soapsearch/search/blockmove.py): one proposal turns a Megatron-shaped block's
column linears, middle ops and row linear to one layout together. Its plans are valid, change
only the block's ops, are scored by delta simulation exactly as from scratch, and a search on
the zoo's gpt makes and accepts such moves and ends no worse than data parallel."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search import search
from soapsearch.search.api import Evaluator
from soapsearch.search.blockmove import BlockMoves
from strategies import data_parallel
from strategies.megatron import megatron_blocks
from tests.conftest import traced
from tests.search.delta_check import assert_delta_equals_full


@pytest.mark.parametrize("name,microbatches", [("gpt", 1), ("gpt", 2), ("llama", 1)])
def test_block_moves_are_valid_and_delta_equals_full(name, microbatches):
    graph = traced(name, batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    moves = BlockMoves(graph, 4, microbatches)
    assert len(moves.blocks) == 4
    blocks = [set((*cols, *mid, row)) for cols, mid, row in megatron_blocks(graph)]
    evaluate = Evaluator(graph, topo, cost)
    rng = random.Random(3)
    current = data_parallel(graph, 4).with_microbatches(microbatches, "1f1b")
    made = tensor_parallel = 0
    for _ in range(30):
        proposal = moves.propose(current, rng)
        if proposal is None:
            continue
        made += 1
        proposal.validate(graph)
        changed = {op for op in proposal if proposal[op] != current[op]}
        assert any(changed <= b for b in blocks), changed  # one block's ops, together
        rows = [op for op in changed if graph[op].kind == "linear" and any(
            proposal[op].degrees[i] > 1 for i in graph[op].reduction_dims)]
        tensor_parallel += bool(rows)
        assert_delta_equals_full(evaluate, proposal)
        if rng.random() < 0.6:
            current = proposal
    assert made >= 10 and tensor_parallel >= 5, (made, tensor_parallel)


def test_no_block_no_move():
    assert not BlockMoves(traced("resnet101"), 4)  # no linear → activation → linear
    assert not BlockMoves(traced("gpt"), 1)


def test_search_on_gpt_uses_block_moves():
    graph = traced("gpt")
    result = search(graph, topology="p100-1x4", proposals=600, seed=1, workers=1)
    assert result.predicted_ms <= result.baselines["data_parallel"]
    assert result.block_accepted > 0
