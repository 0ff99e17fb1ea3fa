"""A task of no duration and no resource, numbered right after the task it leads into, delays
nothing: the property that lets a member's call of a collective be an arrival of the
collective's task (edges into it) instead of a task of its own (``simulator.collectives``,
``simulator.zero3``). The event loop places tasks in order of (ready time, id): such a join
becomes ready when the last of its predecessors ends and is placed at the very place of the
order its successor would have had, which follows it at once and finds the resources as it
would have."""

import random

import numpy as np
import pytest

from simulator.cost import get_cost_model
from simulator.engine import event_times
from simulator.presets import get_topology
from simulator.tasks import TaskGraph, TaskKind, build_tasks
from strategies.baselines import recomputed
from strategies.lowering import lower
from strategies.megatron import megatron
from tests.conftest import traced


def _plans():
    graph = traced("gpt", batch_size=32)
    plan = megatron(graph, 4, tp=2, pp=2, microbatches=4, sequence_parallel=True)
    rc = recomputed(plan, graph)
    zero3 = rc.with_configs({op: c.with_memory(zero=3) if graph[op].kind == "linear" else c for op, c in rc.items()})
    return [(graph, plan), (graph, zero3.with_fsdp_unit("block"))]


def _with_joins(tg: TaskGraph, rng: random.Random, share: float) -> tuple[TaskGraph, np.ndarray]:
    """``tg`` with a join (no duration, no resource) numbered right after each of a ``share`` of
    the tasks with predecessors, a random non-empty set of their in-edges led through it; and
    each task's new id."""
    src, dst = (a.tolist() for a in tg.edge_arrays())
    into: dict[int, list[int]] = {}
    for i, d in enumerate(dst):
        into.setdefault(d, []).append(i)
    targets = {d: set(rng.sample(edges, rng.randint(1, len(edges)))) for d, edges in into.items() if rng.random() < share}
    out = TaskGraph(tg.num_devices, tg.num_links)
    new, join = [], {}
    for t in range(len(tg)):
        new.append(out.add(tg.name[t], tg.category[t], tg.duration[t], tg.resources[t], tg.device[t], tg.nbytes[t]))
        if t in targets:
            join[t] = out.add(f"join {t}", TaskKind.COLLECTIVE, 0.0, (), tg.device[t])
            out.edge(join[t], new[t])
    for i, (s, d) in enumerate(zip(src, dst)):
        out.edge(new[s], join[d] if i in targets.get(d, ()) else new[d])
    return out, np.asarray(new)


@pytest.mark.parametrize("native", [True, False])
def test_a_join_numbered_after_its_successor_delays_nothing(native):
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    rng = random.Random(0)
    joined = 0
    for graph, plan in _plans():
        tg = build_tasks(lower(graph, plan), topo, cost, "adam")
        start, end = event_times(tg, native)
        for share in (0.1, 0.5, 1.0):
            other, new = _with_joins(tg, rng, share)
            joined += len(other) - len(tg)
            s2, e2 = event_times(other, native)
            assert np.array_equal(s2[new], start) and np.array_equal(e2[new], end)
    assert joined > 1000


def test_a_join_numbered_later_may_change_the_order():
    """The place in the order is what makes it exact: a join numbered after every other task
    is placed after the tasks ready at its time, so its successor may lose a tie for a link
    (two transfers ready at once on one link: the one led through a late join goes second)."""
    tg = TaskGraph(num_devices=1, num_links=1)
    first = tg.add("a", TaskKind.TRANSFER, 1.0, (1,), 0)
    second = tg.add("b", TaskKind.TRANSFER, 1.0, (1,), 0)
    start, _ = event_times(tg)
    assert start.tolist() == [0.0, 1.0]
    late = tg.add("join", TaskKind.COLLECTIVE, 0.0, (), 0)
    tg.edge(late, first)
    start, _ = event_times(tg)
    assert start[[first, second]].tolist() == [1.0, 0.0]
