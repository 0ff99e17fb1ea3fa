"""A collective whose producer drops its output and whose readers all recompute is called again
at the recomputation (``strategies.collective_buffers.BufferLife.regather``; Megatron-LM's full
recompute, ``CheckpointFunction``: the layer's forward rerun in the backward, the row-parallel
linears' reductions of partial sums included); where the producer keeps its output, or a reader
does not recompute, the result is kept or transient as before. Delta simulation equals a full
simulation across plans that turn it on and off op by op."""

from __future__ import annotations

import pytest

from simulator.cost import get_cost_model
from simulator.memory_collectives import collective_rows
from simulator.presets import get_topology
from soapsearch.search.api import Evaluator
from strategies.collective_buffers import buffer_lives
from strategies.lowering import lower
from tests.conftest import traced
from tests.executor.plans import make_plan, recompute
from tests.search.delta_check import assert_delta_equals_full

SUMS = ("reduce_scatter", "all_reduce")


def _sums(graph, plan):
    return [life for life in buffer_lives(lower(graph, plan), 0) if life.collective.kind in SUMS
            and life.collective.op.startswith("blocks_")]


@pytest.mark.parametrize("name", ["megatron+rc_layers", "megatron_sp+rc_layers"])
def test_full_recompute_reduces_the_partial_sums_again(name):
    g = traced("gpt")
    lives = _sums(g, make_plan(g, name, 2))
    assert len(lives) == 4  # 2 layers x (attention's and the mlp's row-parallel linear)
    for life in lives:
        assert not life.kept and life.regather == life.collective.op.split("_")[0] + "_" + \
            life.collective.op.split("_")[1] + "_mlp_dropout", life  # the layer recomputed at its last dropout's step


def test_a_kept_producer_or_a_reader_that_keeps_leaves_the_sum_as_it_was():
    g = traced("gpt")
    base = make_plan(g, "megatron", 2)
    dropouts = [n.name for n in g if n.name.startswith("blocks_") and n.name.endswith(("attn_dropout", "mlp_dropout"))]
    # the readers recompute, the row-parallel linears keep their outputs: the sums kept for the recomputation
    lives = _sums(g, recompute(base, dropouts))
    assert len(lives) == 4 and all(life.kept and life.regather is None for life in lives)
    # neither recomputes: transient (read by no backward)
    assert all(not life.kept and life.regather is None for life in _sums(g, base))


def test_the_sum_called_again_is_freed_after_the_forward_and_held_at_the_recomputation():
    """The memory rows: a regathered sum's bytes leave after its reader's forward (not kept per
    micro-batch in flight) and come back at its recomputation, freed after that op's backward."""
    g = traced("gpt")
    low = lower(g, make_plan(g, "megatron+rc_layers", 2))
    position = {node.name: i for i, node in enumerate(g)}
    held, freed, redone, gone = collective_rows(low, position, 2)
    for life in _sums(g, low.strategy):
        at = position[life.collective.op.replace("attn_proj", "attn_dropout").replace("mlp_proj", "mlp_dropout")]
        assert held[at, 0] == freed[at, 0] > 0  # in and out in the dropout's forward (nothing else there)
        assert redone[position[life.regather], 0] >= held[at, 0]


def test_delta_equals_full_turning_full_recompute_on_and_off_op_by_op():
    topo = get_topology("p100-2x2")
    g = traced("gpt", batch_size=8)
    evaluate = Evaluator(g, topo, get_cost_model("analytical"))
    plan = make_plan(g, "megatron", topo.num_devices)
    full = make_plan(g, "megatron+rc_layers", topo.num_devices)
    assert_delta_equals_full(evaluate, plan, "megatron")
    assert_delta_equals_full(evaluate, full, "megatron+rc_layers")
    for op in ("blocks_0_attn_proj", "blocks_0_attn_dropout", "blocks_1_mlp_proj", "blocks_1_mlp_dropout"):
        plan = plan.replace(op, full[op])  # recompute turned on one op at a time
        assert_delta_equals_full(evaluate, plan, op)
        off = full.replace(op, full[op].with_memory(recompute=False))
        assert_delta_equals_full(evaluate, off, ("off", op))
    assert_delta_equals_full(evaluate, full, "megatron+rc_layers again")
