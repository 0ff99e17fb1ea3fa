"""simulator.comm_overlap_rate: compute beside its device's own collectives runs at the device's
overlap rate (``DeviceSpec.overlap_rate``)."""

import dataclasses
import json
import pickle

import numpy as np
import pytest

from simulator.comm import ring_links
from simulator.comm_overlap_rate import finish_times, link_owners, overlapped_times
from simulator.devices import DeviceSpec
from simulator.engine import event_times
from simulator.presets import NCCL_OVERLAP_RATE, get_topology
from simulator.simulate import simulate_plan
from simulator.taskgraph import TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.baselines import data_parallel
from tests.conftest import traced

MS = 1e-3


def with_rate(name: str, rate: float) -> Topology:
    base = get_topology(name)
    return dataclasses.replace(base, devices=tuple(dataclasses.replace(d, overlap_rate=rate) for d in base.devices))


def ring_task(tg: TaskGraph, topo: Topology, devices, ms: float) -> int:
    links = tuple(topo.num_devices + j for j in ring_links(topo, devices))
    return tg.add("all-gather", TaskKind.COLLECTIVE, ms * MS, links, devices[0])


def run(tg: TaskGraph, topo: Topology):
    return overlapped_times(tg, topo, *event_times(tg))


def test_one_product_beside_one_all_gather():
    """By hand: a 10 ms product beside a 4 ms all-gather of its device at rate 1/2 does 2 ms of
    work in the first 4 ms, then 8 ms alone: it ends at 12 ms; the all-gather is unmoved."""
    topo = with_rate("a100-1x2", 0.5)
    tg = TaskGraph(topo.num_devices, len(topo.links))
    product = tg.add("fc1", TaskKind.FORWARD, 10 * MS, (0,), 0)
    gather = ring_task(tg, topo, (0, 1), 4)
    next_one = tg.add("fc2", TaskKind.FORWARD, 3 * MS, (0,), 0)  # after it on the stream, beside nothing
    start, end = run(tg, topo)
    assert end[product] == pytest.approx(12 * MS, rel=1e-12)
    assert (start[gather], end[gather]) == (0.0, 4 * MS)
    assert end[next_one] == start[next_one] + 3 * MS  # its base duration, bit for bit
    start, end = run(tg, with_rate("a100-1x2", 1.0))  # no slowdown: the event loop's times as they are
    assert end[product] == 10 * MS


def test_only_members_and_only_while_it_runs():
    """A product of a device outside the ring, and one after the ring ends, keep their time;
    one on the ring's other member slows as the first (rate 0.841: 4·(1 − f) ms more)."""
    topo = with_rate("a100-1x4", NCCL_OVERLAP_RATE)
    tg = TaskGraph(topo.num_devices, len(topo.links))
    gather = ring_task(tg, topo, (0, 1), 4)
    beside = [tg.add(f"fc1 device {d}", TaskKind.BACKWARD, 10 * MS, (d,), d) for d in (0, 1)]
    outside = tg.add("fc1 device 2", TaskKind.BACKWARD, 10 * MS, (2,), 2)
    after = tg.add("fc2 device 3", TaskKind.FORWARD, 3 * MS, (3,), 3)
    tg.edge(gather, after)
    start, end = run(tg, topo)
    assert [end[t] for t in beside] == pytest.approx([(10 + 4 * (1 - 1 / 1.189)) * MS] * 2, rel=1e-12)
    assert end[outside] == 10 * MS
    assert (start[after], end[after]) == (4 * MS, 7 * MS)


def test_finish_times_across_blocks():
    """Blocks [2, 4) and [6, 7) s at rate 1/2, 6 s of work from 0: 2 + 1 + 2 + 0.5 + 0.5 work
    by 2, 4, 6, 7, 7.5 s; from 3 s, 1 s of work: 0.5 by 4 s, then 0.5 alone: 4.5 s."""
    lo, hi = np.array([2.0, 6.0]), np.array([4.0, 7.0])
    got = finish_times(lo, hi, 0.5, np.array([0.0, 3.0, 8.0]), np.array([6.0, 1.0, 2.0]))
    assert got.tolist() == [7.5, 4.5, 10.0]


def test_presets_leave_the_rate_at_one():
    """The presets do not slow compute beside NCCL (its passes double a large simulation's
    event-loop time); published_runs sets the rate on its rows' topologies."""
    from benchmarks.published_data import ROWS
    from benchmarks.published_runs import row_topology
    assert {d.overlap_rate for d in get_topology("a100-2x8").devices} == {1.0}
    assert {d.overlap_rate for d in get_topology("h100-2x8").devices} == {1.0}
    run = next(r for r in ROWS if r.gpus <= 64)
    assert {d.overlap_rate for d in row_topology(run).devices} == {NCCL_OVERLAP_RATE}


def test_link_owners_are_the_devices_own_ports():
    """Every NVSwitch port's owner is its device, no link into a device has one, every route
    starting with an owned link starts at its owner, and no route is kept in the topology's memo
    (``Topology.route`` keeps each pair asked: G² at thousands of devices)."""
    topo = pickle.loads(pickle.dumps(get_topology("a100-2x8")))  # a fresh memo
    owners = link_owners(topo)
    assert len(topo._memo) == 0
    n = topo.num_devices
    for d in range(n):
        for x in range(n):
            first = topo.route(d, x)[:1] if x != d else ()
            assert all(owners[f] in (-1, d) for f in first)
    assert (owners >= 0).sum() == 2 * n  # each device's NVSwitch port and its own NIC
    for j, link in enumerate(topo.links):
        if link.name.startswith("nvswitch-up:"):
            assert owners[j] == int(link.name.split(":")[1])
        if link.name.startswith(("nvswitch-down:", "nic-in:")):
            assert owners[j] == -1  # no route starts with a link into a device


def test_ddp_backward_beside_its_buckets_is_slower_and_folds_exactly():
    """A data-parallel plan on 16 A100s (two copies of 8): its buckets' all-reduces run beside
    the backward, which takes longer than at rate 1; the fold on the copies equals every device's."""
    graph = traced("gpt", "small")
    plan = data_parallel(graph, 16)
    slowed, plain = with_rate("a100-2x8", NCCL_OVERLAP_RATE), get_topology("a100-2x8")
    full = simulate_plan(graph, plan, slowed, fold=False)
    assert full.iteration_time > simulate_plan(graph, plan, plain, fold=False).iteration_time
    folded = simulate_plan(graph, plan, slowed, fold=True)
    assert folded.num_tasks < full.num_tasks
    assert folded.iteration_time == full.iteration_time
    assert folded.peak_memory_bytes == full.peak_memory_bytes


def test_overlap_rate_round_trips_and_is_checked(tmp_path):
    topo = with_rate("a100-1x2", 0.8)
    obj = topo.to_json()
    assert [d["overlap_rate"] for d in obj["devices"]] == [0.8, 0.8]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(obj))
    assert Topology.load(path).devices == topo.devices
    with pytest.raises(ValueError, match=r"overlap_rate = 0: must be in \(0, 1\]"):
        DeviceSpec("gpu", 1, {"float32": 1.0}, 1.0, overlap_rate=0)
    with pytest.raises(ValueError, match="not both"):
        DeviceSpec("cpu", 1, {"float32": 1.0}, 1.0, contention=1.5, overlap_rate=0.9)
    mixed = (dataclasses.replace(topo.devices[0], overlap_rate=1.0, contention=1.5), topo.devices[1])
    with pytest.raises(ValueError, match=r"devices\[1\]\.overlap_rate .*devices\[0\] has contention 1.5.*not both"):
        dataclasses.replace(topo, devices=mixed)


def test_compiled_and_python_loops_give_the_same_slowed_timeline(monkeypatch):
    """The passes feed durations to ``engine.event_times``: the C loop and the Python loop
    place the slowed tasks alike, bit for bit (the C loop needs no change of its own)."""
    import simulator.engine as engine
    from simulator.native import library

    if library() is None:
        pytest.skip("no C compiler: the Python loop runs on both sides")
    graph = traced("gpt", "small")
    plan = data_parallel(graph, 8)
    topo = with_rate("a100-1x8", NCCL_OVERLAP_RATE)
    native = simulate_plan(graph, plan, topo, fold=False)
    monkeypatch.setattr(engine, "library", lambda: None)
    python = simulate_plan(graph, plan, topo, fold=False)
    assert python.iteration_time == native.iteration_time
    assert python.busy_time == native.busy_time


@pytest.mark.parametrize("case", ["no collective", "zero-length gather", "gather before"])
def test_compute_beside_no_collective_keeps_the_timeline_given(case):
    """Where no compute meets a collective of its device (none at all: no group; a gather of
    0 ms: no interval; a gather the product waits for), the timeline given comes back as it is,
    the same arrays, with no pass of the event loop."""
    topo = with_rate("a100-1x2", 0.5)
    tg = TaskGraph(topo.num_devices, len(topo.links))
    product = tg.add("fc1", TaskKind.FORWARD, 10 * MS, (0,), 0)
    if case != "no collective":
        gather = ring_task(tg, topo, (0, 1), 0 if case == "zero-length gather" else 4)
        if case == "gather before":
            tg.edge(gather, product)
    start, end = event_times(tg)
    got = overlapped_times(tg, topo, start, end)
    assert got[0] is start and got[1] is end
    assert end[product] - start[product] == 10 * MS


def test_graph_and_topology_of_other_sizes_are_refused():
    topo = with_rate("a100-1x2", 0.5)
    tg = TaskGraph(4, len(topo.links))
    tg.add("fc1", TaskKind.FORWARD, 10 * MS, (0,), 0)
    with pytest.raises(ValueError, match=rf"the graph has 4 devices and {len(topo.links)} links, topology "
                                         rf"'a100-1x2' 2 and {len(topo.links)}: they must be the same"):
        overlapped_times(tg, topo, *event_times(tg))
