"""simulator.contention: compute that slows when the devices of a node compute at once."""

import dataclasses
import json

import pytest

from simulator.contention import contended_times, node_tasks, slowed_durations
from simulator.devices import DeviceSpec
from simulator.engine import event_times
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.taskgraph import TaskGraph, TaskKind
from simulator.topology import Topology
from strategies import baseline

MS = 1e-3


def node_of(n: int, contention: float) -> Topology:
    base = get_topology(f"local-cpu-{n}")
    return dataclasses.replace(base, devices=tuple(dataclasses.replace(d, contention=contention)
                                                   for d in base.devices))


def run(tg, topo):
    return contended_times(tg, topo, *event_times(tg))


def test_devices_computing_at_once_each_take_the_whole_slowdown():
    tg = TaskGraph(2, 2)
    tg.add("a", TaskKind.FORWARD, 1 * MS, (0,), 0)
    tg.add("b", TaskKind.FORWARD, 1 * MS, (1,), 1)
    start, end = run(tg, node_of(2, 2.0))
    assert end.tolist() == pytest.approx([2 * MS, 2 * MS], rel=1e-12)
    start, end = run(tg, node_of(2, 1.0))  # nothing shared: the event loop's times as they are
    assert end.tolist() == [1 * MS, 1 * MS]


def test_devices_taking_turns_are_not_slowed():
    tg = TaskGraph(2, 2)
    a = tg.add("a", TaskKind.FORWARD, 1 * MS, (0,), 0)
    b = tg.add("b", TaskKind.UPDATE, 1 * MS, (1,), 1)
    tg.edge(a, b)
    start, end = run(tg, node_of(2, 2.0))
    assert (start.tolist(), end.tolist()) == ([0.0, 1 * MS], [1 * MS, 2 * MS])


def test_partial_overlap_by_hand_over_the_passes():
    # a: 2 ms on device 0 from 0; b: 1 ms on device 1 after 1 ms of receiving (not compute).
    # Base timeline: a 0-2, b 1-2: k(a) = (1 + 2) / 2 = 1.5, k(b) = 2; c = 2, n = 2: f = k.
    # Pass 1: a 3 ms, b 2 ms: a 0-3, b 1-3: k(a) = (1 + 2·2) / 3 = 5/3, k(b) = 2.
    # Pass 2: a 2 · 5/3 = 3.33 ms, b 2 ms: a 0-3.33, b 1-3.
    tg = TaskGraph(2, 2)
    tg.add("a", TaskKind.FORWARD, 2 * MS, (0,), 0)
    r = tg.add("r", TaskKind.RECV, 1 * MS, (1,), 1)
    b = tg.add("b", TaskKind.FORWARD, 1 * MS, (1,), 1)
    tg.edge(r, b)
    topo = node_of(2, 2.0)
    start, end = event_times(tg)
    base = tg.arrays()[0]
    once = slowed_durations(node_tasks(tg, topo, base), base, start, end)
    assert once.tolist() == pytest.approx([3 * MS, 1 * MS, 2 * MS], rel=1e-12)
    start, end = run(tg, topo)
    assert end.tolist() == pytest.approx([10 / 3 * MS, 1 * MS, 3 * MS], rel=1e-12)
    # the Python loop takes the same durations and gives the same times
    py = event_times(tg, native=False, duration=once)
    assert [x.tolist() for x in py] == [x.tolist() for x in event_times(tg, duration=once)]


def test_the_slowdown_grows_with_the_devices_computing():
    # 4 devices of contention 2: 2 computing at once take 1 + (2 - 1)(2 - 1)/3 = 4/3, 4 take 2
    for busy, factor in ((2, 4 / 3), (4, 2.0)):
        tg = TaskGraph(4, 12)
        for d in range(busy):
            tg.add(f"t{d}", TaskKind.FORWARD, 3 * MS, (d,), d)
        start, end = run(tg, node_of(4, 2.0))
        assert end.tolist() == pytest.approx([3 * MS * factor] * busy, rel=1e-12)


def test_data_parallel_slows_more_than_model_parallel(graphs):
    g = graphs("mlp")
    plain, shared = get_topology("local-cpu-2"), node_of(2, 1.5)
    ratio = {name: simulate_plan(g, baseline(name, g, 2), shared).iteration_ms
             / simulate_plan(g, baseline(name, g, 2), plain).iteration_ms
             for name in ("data_parallel", "model_parallel")}
    assert 1.0 <= ratio["model_parallel"] < ratio["data_parallel"] <= 1.5
    r = simulate_plan(g, baseline("data_parallel", g, 2), shared, timeline=True)
    assert r == simulate_plan(g, baseline("data_parallel", g, 2), shared, timeline=True)  # deterministic
    assert max(r.busy_time) > max(simulate_plan(g, baseline("data_parallel", g, 2), plain).busy_time)


def test_a_node_of_one_device_has_nothing_to_share():
    from simulator.contention import contended

    assert not contended(node_of(2, 1.0))
    one = get_topology("p100-4x1")  # 4 nodes of one device each
    alone = dataclasses.replace(one, devices=tuple(dataclasses.replace(d, contention=1.5) for d in one.devices))
    assert not contended(alone) and contended(node_of(2, 1.5))


def test_contention_round_trips_and_is_checked(tmp_path):
    t = node_of(2, 1.4)
    obj = t.to_json()
    assert [d["contention"] for d in obj["devices"]] == [1.4, 1.4]
    assert "contention" not in get_topology("local-cpu-2").to_json()["devices"][0]
    assert Topology.from_json(json.loads(json.dumps(obj))) == t
    t.save(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == t
    import pickle
    assert pickle.loads(pickle.dumps(t)).devices[1].contention == 1.4
    obj["devices"][0]["contention"] = 0.9
    with pytest.raises(ValueError, match=r"devices\[0\].contention = 0.9: must be a finite number >= 1"):
        Topology.from_json(obj)
    for bad in (0.5, float("inf")):
        with pytest.raises(ValueError, match=rf"device 'x': contention = {bad}: must be finite and >= 1"):
            DeviceSpec("x", 1 << 30, {"float32": 1e12}, 1e11, contention=bad)
    assert "1.4x slower when its node's devices compute at once" in t.describe()
