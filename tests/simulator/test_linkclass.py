"""Link classes (``simulator.linkclass``): links held by exactly the same tasks are timed as one,
and the event loop's times are those of every link held."""

import numpy as np
import pytest

from simulator.engine import event_times
from simulator.linkclass import compact_resources
from simulator.tasks import TaskGraph, TaskKind
from strategies.members import Hashed, Members, hashed, kept_members, members


def ring_graph(links: int = 20) -> TaskGraph:
    """Two devices, ``links`` link directions: three 'all-reduces' on one shared ring tuple of
    every link, a transfer on links 0-1 only (which splits the ring's links in two classes),
    compute tasks between."""
    tg = TaskGraph(num_devices=2, num_links=links)
    ring = tuple(range(2, 2 + links))
    tg.add("c0", TaskKind.FORWARD, 1.0, (0,), 0)
    tg.add("ar0", TaskKind.TRANSFER, 2.0, ring, 0)
    tg.add("t", TaskKind.TRANSFER, 1.5, (2, 3), 0)
    tg.add("ar1", TaskKind.TRANSFER, 2.0, ring, 0)
    tg.add("c1", TaskKind.FORWARD, 0.5, (1,), 1)
    tg.add("ar2", TaskKind.TRANSFER, 2.0, ring, 0)
    tg.edge(0, 1)
    tg.edge(0, 2)
    tg.edge(4, 3)
    return tg


def test_links_held_by_the_same_tasks_are_one_class():
    tg = ring_graph()
    res_first, res, short = compact_resources(tg)
    # the ring keeps one link of {0, 1} (also the transfer's) and one of the eighteen others
    assert short[1] == short[3] == short[5] == (2, 4)
    assert short[2] == (2,)
    assert short[0] == (0,) and short[4] == (1,)
    assert res_first.tolist() == [0, 1, 3, 4, 6, 7, 9]
    assert res.tolist() == [0, 2, 4, 2, 2, 4, 1, 2, 4]


def test_the_loop_gives_the_times_of_every_link_held():
    tg = ring_graph()
    start, end = event_times(tg)
    # by readiness: ar2 (ready 0) 0..2, ar1 (after c1, 0.5) 2..4, ar0 (after c0, 1) 4..6, then t
    # (ready 1) on links 0-1 after ar0, 6..7.5
    assert start.tolist() == [0.0, 4.0, 6.0, 2.0, 0.0, 0.0]
    assert end.tolist() == [1.0, 6.0, 7.5, 4.0, 0.5, 2.0]
    tg.memo["compact"] = (len(tg), None)  # every link held, as before link classes
    full = event_times(tg)
    assert np.array_equal(full[0], start) and np.array_equal(full[1], end)
    python = event_times(ring_graph(), native=False)
    assert np.array_equal(python[0], start) and np.array_equal(python[1], end)


def test_few_links_per_task_are_not_compacted():
    tg = TaskGraph(num_devices=2, num_links=2)
    tg.add("t", TaskKind.TRANSFER, 1.0, (2, 3), 0)
    tg.add("c", TaskKind.FORWARD, 1.0, (0,), 0)
    assert compact_resources(tg) is None


def test_long_device_tuples_hash_once_and_equal_plain_ones():
    plain = tuple(range(100))
    m, h = members(reversed(plain)), hashed(plain)
    assert isinstance(m, Members) and isinstance(h, Hashed) and m == plain == h
    assert hash(m) == hash(plain) == hash(h)
    assert {plain: 1}[m] == 1
    assert type(members((3, 1))) is tuple and members((3, 1)) == (1, 3)
    assert m.array().tolist() == list(plain)
    assert kept_members(m, {5, 7, 200}) == [5, 7]
    assert kept_members((9, 5, 7), {5, 7}) == [5, 7]


def test_distinct_resources_per_list_equal_the_tuples_by_value():
    """``distinct_resources`` works out each resources list once (the blocks of twin ops share
    their twin's): on a pipelined plan whose layers are twins, the distinct tuples in order of
    first use and each task's index are those found task by task, by value."""
    from simulator.cost import get_cost_model
    from simulator.linkclass import distinct_resources
    from simulator.presets import get_topology
    from simulator.simulate import Lowerings
    from simulator.tasks import build_tasks
    from strategies.baselines import megatron_lm
    from tests.conftest import traced

    graph = traced("gpt", "small")
    topo = get_topology("a100-2x8")
    lowered = Lowerings(graph, megatron_lm(graph, 16, 4, 2)).first(topo, False)
    tg = build_tasks(lowered, topo, get_cost_model("analytical"), "adam")
    lists = tg.column_parts("resources")[:-1]  # the segments'
    assert len({id(r) for r in lists}) < len(lists)  # twin blocks share a list: the case at stake
    distinct, which = distinct_resources(tg)
    order: dict[tuple[int, ...], int] = {}
    expected = [order.setdefault(r, len(order)) for r in tg.resources]
    assert distinct == list(order) and which.tolist() == expected
