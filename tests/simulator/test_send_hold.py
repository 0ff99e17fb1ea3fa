"""A send holds its sender's host (Link.send_bandwidth, send_latency): the link's arithmetic
and the send tasks the task graph gets for it, against hand arithmetic (the JSON round trip:
test_topology.test_optional_link_fields_round_trip_and_are_checked)."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.cost import get_cost_model
from simulator.devices import Link
from simulator.engine import run_events
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import build_tasks
from simulator.taskgraph import GRAD_SEND, SEND
from simulator.topology import Topology
from soapsearch.executor import build_model
from strategies import baseline
from strategies.lowering import lower

LAT, BW = 1e-4, 2e9


def held(topology: Topology) -> Topology:
    return dataclasses.replace(topology, links=tuple(dataclasses.replace(k, send_bandwidth=BW, send_latency=LAT)
                                                     for k in topology.links))


def test_send_time_and_checks():
    link = Link("shm:0->1", "shm", 2e-4, 1.5e9, send_bandwidth=BW, send_latency=LAT)
    assert link.send_time(4e6) == pytest.approx(LAT + 4e6 / BW)
    assert Link("nvlink:0->1", "nvlink", 2e-6, 2e10).send_time(4e6) == 0.0  # a copy engine: not held
    with pytest.raises(ValueError, match=r"send_bandwidth 0 must be finite and > 0"):
        Link("x", "shm", 0.0, 1e9, send_bandwidth=0)
    with pytest.raises(ValueError, match=r"send_latency -1 must be finite and >= 0"):
        Link("x", "shm", 0.0, 1e9, send_bandwidth=1e9, send_latency=-1)


@pytest.mark.parametrize("plan", ["model_parallel", "pipeline"])
def test_each_send_holds_its_sender_for_latency_plus_bytes_over_bandwidth(plan):
    graph = build_model("mlp", "tiny").graph
    base = get_topology("local-cpu-2")
    strategy = baseline(plan, graph, 2, **({"microbatches": 2} if plan == "pipeline" else {}))
    low = lower(graph, strategy)
    cost = get_cost_model("analytical")
    tg = build_tasks(low, held(base), cost)
    start, end = run_events(tg)
    remote = [t for t in low.transfers if not t.local]
    sends = [i for i in range(len(tg)) if tg.category[i] == SEND]
    grads = [i for i in range(len(tg)) if tg.category[i] == GRAD_SEND]
    assert len(sends) == len(grads) == len(remote) > 0
    for i in sends + grads:
        kind, t = tg.name[i]
        sender = t.src_device if tg.category[i] == SEND else t.dst_device
        assert tg.resources[i] == (sender,) and tg.device[i] == sender
        assert end[i] - start[i] == pytest.approx(LAT + t.nbytes / BW, rel=1e-12)
    for i in sends:  # after the producer's forward: no earlier than the transfer it sits beside
        transfer = next(j for j in range(len(tg)) if tg.name[j] == ("send", tg.name[i][1]))
        assert start[i] >= start[transfer] - 1e-15
    # each device's busy time grows by exactly its sends' holds; no other task's duration changes
    plain, hold = simulate_plan(graph, low, base, cost), simulate_plan(graph, low, held(base), cost)
    for d in range(2):
        mine = sum(LAT + t.nbytes / BW for t in remote if t.src_device == d) + \
               sum(LAT + t.nbytes / BW for t in remote if t.dst_device == d)
        assert hold.busy_time[d] - plain.busy_time[d] == pytest.approx(mine, rel=1e-9)
    assert hold.iteration_time > plain.iteration_time
    assert run_events(tg) == run_events(tg, native=False)
