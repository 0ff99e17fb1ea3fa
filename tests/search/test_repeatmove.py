"""The repeated-block move (soapsearch/search/repeatmove.py): one proposal sets op i of every
instance of a repeated block (the zoo gpt's layers) alike; with ``repeat_stages`` instances on
other pipeline stages keep their devices; delta simulation of a walk using it equals a full
simulation; a search with it is deterministic for a seed with 1 and 3 workers."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search import SearchConfig, search
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from soapsearch.search.repeatmove import RepeatMoves
from strategies import data_parallel
from strategies.config import ParallelConfig
from strategies.megatron import megatron
from tests.conftest import traced
from tests.search.delta_check import assert_delta_equals_full


def _changed(before, after):
    return {op for op in after if after[op] != before[op]}


def test_the_move_changes_every_instance_alike_and_delta_equals_full():
    graph = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    moves = RepeatMoves(graph, 4)
    (block,) = moves.blocks
    assert len(block) == 2
    candidates = candidate_configs(graph, 4, 2, None)
    evaluate = Evaluator(graph, topo, cost)
    rng = random.Random(7)
    current = data_parallel(graph, 4).with_microbatches(2, "1f1b")
    made = 0
    for _ in range(40):
        proposal = moves.propose(current, candidates, rng)
        if proposal is None:
            continue
        made += 1
        changed = _changed(current, proposal)
        positions = {block.position(op)[1] for op in changed}  # only the block's ops change
        for i in positions:  # op i of every instance, to one config
            assert len({proposal[inst[i]] for inst in block.instances}) == 1
            assert all(inst[i] in changed or proposal[inst[i]] == current[inst[i]] for inst in block.instances)
        assert any(all(inst[i] in changed for inst in block.instances) for i in positions)
        proposal.validate(graph)
        assert_delta_equals_full(evaluate, proposal)
        if rng.random() < 0.6:
            current = proposal
    assert made >= 25
    assert len(_changed(data_parallel(graph, 4).with_microbatches(2, "1f1b"), current)) >= 10


@pytest.mark.parametrize("stages", [False, True])
def test_instances_on_other_stages_keep_their_devices_with_repeat_stages(stages):
    graph = traced("gpt", batch_size=16)
    moves = RepeatMoves(graph, 4, stages=stages)
    (block,) = moves.blocks
    start = megatron(graph, 4, tp=2, pp=2, microbatches=2)
    for a, b in zip(*block.instances):  # layer 0 on the first stage's devices 0-1, layer 1 on 2-3
        cfg = start[a]
        assert set(cfg.devices) <= {0, 1}
        start = start.replace(b, ParallelConfig(cfg.degrees, tuple(d + 2 for d in cfg.devices)))
    start.validate(graph)
    candidates = candidate_configs(graph, 4, 2, None)
    rng = random.Random(1)
    kept = apart = 0
    for _ in range(150):
        proposal = moves.propose(start, candidates, rng)
        if proposal is None:
            continue
        for i in {block.position(op)[1] for op in _changed(start, proposal)}:
            a, b = (proposal[inst[i]] for inst in block.instances)
            ops = [inst[i] for inst in block.instances]
            if stages:  # moved onto the other stage's devices, or (no room there) as it was
                if a == start[ops[0]] or b == start[ops[1]]:
                    continue
                assert a.degrees == b.degrees and (a.zero, a.recompute) == (b.zero, b.recompute)
                assert [d + 2 for d in a.devices] == list(b.devices)
                kept += 1
            else:
                apart += a == b
    assert (kept if stages else apart) >= 10


def test_no_repeated_block_no_move():
    assert not RepeatMoves(traced("mlp"), 4)
    assert not RepeatMoves(traced("gpt"), 1)


def test_search_with_the_move_is_deterministic_for_1_and_3_workers():
    gpt = traced("gpt", batch_size=16)
    kw = dict(topology="p100-1x4", budget_s=None, proposals=90, seed=3, chains=3, repeat_move=0.5,
              repeat_stages=True, exhaustive_limit=0)
    one, three = (search(gpt, workers=w, **kw) for w in (1, 3))
    assert one.strategy == three.strategy and one.predicted_ms == three.predicted_ms
    one.strategy.validate(gpt)
    assert one.predicted_ms <= min(one.baselines.values()) * (1 + 1e-12)


@pytest.mark.parametrize("field,value,says", [
    ("repeat_move", 1.5, "repeat_move = 1.5: a probability is a number in \\[0, 1\\]"),
    ("repeat_stages", 1, "repeat_stages = 1: must be True or False"),
])
def test_bad_fields_are_named(field, value, says):
    with pytest.raises(ValueError, match=says):
        SearchConfig(**{field: value})
