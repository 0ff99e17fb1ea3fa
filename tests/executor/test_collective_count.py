"""The executor's tensor-parallel collectives, counted on 2 gloo processes (each
``run_collective`` call of ``Executor._call``: the forward's, the duals', and those called again
in the backward), equal the simulator's collective tasks for the same plan
(``simulator.collectives``), kind by kind, and both ranks call the same collectives in the same
order (a mismatch would hang or fail the step). Under full recompute (``rc_layers``, Megatron-LM's
``CheckpointFunction``: the layer's forward rerun in the backward, collectives included) the
row-parallel linears' reduce-scatters of partial sums are called again at the recomputation
(``strategies.collective_buffers.BufferLife.regather``), as the layer's all-gathers are; under
selective recompute (``rc_attn``) no producer of partial sums recomputes and nothing is called
again."""

from __future__ import annotations

from collections import Counter

import pytest

import soapsearch.executor.reads as reads
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.taskgraph import TaskKind
from simulator.tasks import build_tasks
from soapsearch.executor import build_model
from strategies.lowering import lower
from tests.executor.counted import save_counted_steps
from tests.executor.gloo import spawn_ranks
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

WORLD = 2
PLANS = ("megatron", "megatron+rc_layers", "megatron_sp", "megatron_sp+rc_layers", "megatron+rc_attn")


def _count(rank: int, world: int, port: int, out: str) -> None:
    save_counted_steps(rank, world, port, out, PLANS, reads, "run_collective",
                       lambda kind, t, *args: (kind, tuple(t.shape)))


def _simulated(graph, name: str) -> Counter:
    """Kind -> the collective tasks the simulator charges for plan ``name`` (forward, again, dual)."""
    low = lower(graph, make_plan(graph, name, WORLD))
    tg = build_tasks(low, get_topology("p100-2x2"), get_cost_model("analytical"))
    labels = [tg.label(t) for t in range(len(tg))]  # a collective's name is a template of its micro-batch
    return Counter(x.split()[0] for x, c in zip(labels, tg.category)
                   if c == TaskKind.COLLECTIVE and " device " not in x)


def test_executor_calls_the_collectives_the_simulator_charges():
    logs = spawn_ranks(_count, WORLD)
    g = build_model("gpt", "tiny", dtype="float64").graph
    for name in PLANS:
        assert logs[0][name] == logs[1][name], name  # the same calls, in the same order, on both ranks
        assert Counter(kind for kind, _ in logs[0][name]) == _simulated(g, name), name
    calls = {name: Counter(kind for kind, _ in logs[0][name]) for name in PLANS}
    # gpt tiny, 2 layers: each layer's two row-parallel reduce-scatters called again under full recompute
    assert calls["megatron+rc_layers"]["reduce_scatter"] == calls["megatron"]["reduce_scatter"] + 2 * 2
    assert calls["megatron+rc_layers"]["all_gather"] == calls["megatron"]["all_gather"] + 2 * 2
    # under sequence parallelism the linears' all-gathers are gathered again in the backward
    # with or without recompute: only the reduce-scatters are added
    assert calls["megatron_sp+rc_layers"]["reduce_scatter"] == calls["megatron_sp"]["reduce_scatter"] + 2 * 2
    assert calls["megatron_sp+rc_layers"]["all_gather"] == calls["megatron_sp"]["all_gather"]
    assert calls["megatron+rc_attn"] == calls["megatron"]
