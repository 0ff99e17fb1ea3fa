"""``summarize``'s busy times and bytes moved (numpy over the graph's resource arrays) against a
plain loop over the tasks: a device is busy for the tasks that hold it and no link (the first
device they hold); a task's bytes count once for every kind of link it holds, times the tasks a
folded graph's task stands for."""

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
import simulator.result as result_module
from simulator.result import summarize
from simulator.simulate import Lowerings, timed_graph
from simulator.taskgraph import TaskGraph, TaskKind
from strategies import baseline
from strategies.megatron import megatron
from tests.conftest import traced
from tests.strategies.test_lowering import random_plan


def _by_loop(tg, topology, start, end, copies):
    n = topology.num_devices
    busy, moved = [0.0] * n, {}
    for t, res in enumerate(tg.resources):
        links = [r - n for r in res if r >= n]
        if res and not links:
            busy[res[0]] += end[t] - start[t]
        for kind in {topology.links[link].kind for link in links}:
            moved[kind] = moved.get(kind, 0) + tg.nbytes[t] * (1 if copies is None else copies[t])
    if tg.copies is not None:
        busy = [busy[tg.copies.representative.get(d, d)] for d in range(n)]
    return busy, moved


def _plans():
    gpt, mlp = traced("gpt", batch_size=32), traced("mlp", batch_size=32)
    yield gpt, baseline("data_parallel", gpt, 16), "p100-4x4"
    yield gpt, megatron(gpt, 16, tp=2, pp=2, microbatches=4, sequence_parallel=True), "a100-2x8"
    yield gpt, baseline("fsdp", gpt, 16).with_microbatches(2, "1f1b"), "a100-2x8"
    for seed in range(4):
        yield mlp, random_plan(mlp, 4, seed, microbatches=2), "p100-2x2"
        yield gpt, random_plan(gpt, 4, seed), "p100-2x2"


@pytest.mark.parametrize("fold", [False, True])
def test_busy_and_bytes_moved_are_the_loops(fold, monkeypatch):
    """The link kinds a task holds found per task or per distinct resource tuple, where a pass
    found those (``linkclass.known_distinct``): both give the loop's figures."""
    cost = get_cost_model("analytical")
    seen_kinds, folded_graphs, ways = set(), 0, set()
    known = result_module.known_distinct

    def spied(tg):
        got = known(tg)
        ways.add(got is None)
        return got

    monkeypatch.setattr(result_module, "known_distinct", spied)
    for graph, plan, name in _plans():
        topo = get_topology(name)
        lowerings = Lowerings(graph, plan)
        tg, folded, start, end = timed_graph(lowerings.first(topo, fold), topo, cost, "adam", fold=fold,
                                             relower=lowerings)
        copies = None if folded is None else folded.copies
        peak = [0] * topo.num_devices
        got = summarize(tg, topo, start, end, peak, False, copies=copies)
        busy, moved = _by_loop(tg, topo, start.tolist(), end.tolist(), None if copies is None else copies.tolist())
        assert list(got.busy_time) == busy  # the same floats, summed in the same order
        assert got.bytes_moved == moved and all(type(v) is int for v in got.bytes_moved.values())
        assert got.iteration_time == max(end.tolist())
        seen_kinds |= set(moved)
        folded_graphs += folded is not None
    assert seen_kinds == {"nvlink", "nvswitch", "ib"}  # every kind of link reached
    assert (folded_graphs > 0) == fold
    assert ways == ({True, False} if fold else {True})  # a fold finds the distinct tuples: both ways then


def test_a_task_counts_once_per_kind_of_link_and_past_int64():
    topo = get_topology("p100-2x2")  # 4 devices; links 0-3 nvlink, 4-7 ib (the NICs)
    n = topo.num_devices
    tg = TaskGraph(n, len(topo.links))
    tg.add("compute", TaskKind.FORWARD, 1.0, (1,), 1)
    tg.add("two nvlinks", TaskKind.TRANSFER, 1.0, (n + 0, n + 1), 0, nbytes=10)
    tg.add("nvlink and ib", TaskKind.TRANSFER, 1.0, (n + 0, n + 4, n + 5), 0, nbytes=7)
    tg.add("host and ib", TaskKind.SEND, 1.0, (2, n + 6), 2, nbytes=2 ** 62)
    tg.add("ib", TaskKind.TRANSFER, 1.0, (n + 7,), 3, nbytes=2 ** 62)
    tg.add("nothing", TaskKind.UPDATE, 0.0, (), 3)
    start, end = [0.0, 0.0, 1.0, 0.0, 2.0, 3.0], [1.5, 1.0, 2.0, 1.0, 3.0, 3.0]
    got = summarize(tg, topo, start, end, [0] * n, True, copies=[1, 1, 1, 1, 3, 1])
    assert got.busy_time == (0.0, 1.5, 0.0, 0.0)  # the host task holds a link: not compute
    assert got.bytes_moved == {"nvlink": 17, "ib": 7 + 2 ** 62 + 3 * 2 ** 62}  # exact past 2**63
    assert list(got.bytes_moved) == ["nvlink", "ib"]  # in the order tasks first hold them
    assert [e[2] for e in got.timeline] == ["compute", "nvlink:0->1", "nvlink:0->1", "nic-out:node1",
                                           "nic-in:node1"]  # a task that holds nothing is not shown
    assert got.iteration_time == 3.0
