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
from simulator.taskgraph import TaskKind
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
    # a gradient goes back only where both ops carry one (the executor's rule): not for the targets
    back = [t for t in remote if graph.needs_grad[t.src_op] and graph.needs_grad[t.dst_op]]
    assert 0 < len(back) < len(remote)
    sends = [i for i in range(len(tg)) if tg.category[i] == TaskKind.SEND]
    grads = [i for i in range(len(tg)) if tg.category[i] == TaskKind.GRAD_SEND]
    assert sorted(tg.name[i][1] for i in sends) == sorted(remote)
    assert sorted(tg.name[i][1] for i in grads) == sorted(back)
    task = {tg.name[i]: i for i in range(len(tg))}
    for i in sends + grads:
        t = tg.name[i][1]
        forward = tg.category[i] == TaskKind.SEND
        sender = t.src_device if forward else t.dst_device
        assert tg.resources[i] == (sender,) and tg.device[i] == sender
        assert end[i] - start[i] == pytest.approx(LAT + t.nbytes / BW, rel=1e-12)
        # after the producer's forward, or after the consumer's backward for the gradient
        after = task[("fwd", t.src_op, t.src_index, t.microbatch) if forward
                     else ("bwd", t.dst_op, t.dst_index, t.microbatch)]
        assert start[i] >= end[after]
    # each device's busy time grows by exactly its sends' holds; no other task's duration changes
    plain, hold = simulate_plan(graph, low, base, cost), simulate_plan(graph, low, held(base), cost)
    for d in range(2):
        mine = sum(LAT + t.nbytes / BW for t in remote if t.src_device == d) + \
               sum(LAT + t.nbytes / BW for t in back if t.dst_device == d)
        assert hold.busy_time[d] - plain.busy_time[d] == pytest.approx(mine, rel=1e-9)
    assert hold.iteration_time > plain.iteration_time
    assert run_events(tg) == run_events(tg, native=False)


def test_each_direction_follows_its_own_first_link():
    graph = build_model("mlp", "tiny").graph
    base = get_topology("local-cpu-2")  # links: shm:0->1, shm:1->0
    one_way = dataclasses.replace(base, links=(base.links[0], dataclasses.replace(
        base.links[1], send_bandwidth=BW, send_latency=LAT)))
    low = lower(graph, baseline("model_parallel", graph, 2))
    tg = build_tasks(low, one_way, get_cost_model("analytical"))
    held_sends = {(tg.category[i], tg.device[i]) for i in range(len(tg))
                  if tg.category[i] in (TaskKind.SEND, TaskKind.GRAD_SEND)}
    # model parallel sends activations 0 -> 1 (free) and gradients 1 -> 0 (held): only the latter
    assert held_sends == {(TaskKind.GRAD_SEND, 1)}
    with pytest.raises(ValueError, match=r"send_latency 0.0001 needs a send_bandwidth"):
        Link("x", "shm", 0.0, 1e9, send_latency=1e-4)


@pytest.mark.parametrize("plan,microbatches,schedule", [("model_parallel", 1, "gpipe"), ("pipeline", 2, "gpipe"),
                                                         ("pipeline", 4, "1f1b")])
def test_receives_and_sends_run_in_their_steps(plan, microbatches, schedule):
    # the executor waits on a piece inside the step that reads it and sends at the end of the
    # step that wrote it: each receive runs after the step before its reader's on the device,
    # and the step after a send's writer (or, after a device's last step, its step end: update
    # and collectives) starts once the send is done (however early the piece arrives or however
    # late a step of another op becomes ready)
    graph = build_model("mlp", "tiny").graph
    base = held(get_topology("local-cpu-2"))
    topo = dataclasses.replace(base, devices=tuple(dataclasses.replace(d, message_overhead=3e-4, exchange_overhead=5e-4)
                                                  for d in base.devices))
    strategy = baseline(plan, graph, 2, microbatches).with_microbatches(microbatches, schedule)
    tg = build_tasks(lower(graph, strategy), topo, get_cost_model("analytical"))
    start, end = run_events(tg)
    task = {tg.name[i]: i for i in range(len(tg))}
    steps = {d: [i for i in range(len(tg))
                 if tg.device[i] == d and tg.category[i] in (TaskKind.FORWARD, TaskKind.BACKWARD)
                 and end[i] > start[i]] for d in range(2)}  # (a step of no time has no place to check)
    step_end = {d: [i for i in range(len(tg))
                    if tg.resources[i] == (d,) and tg.category[i] in (TaskKind.UPDATE, TaskKind.ALLREDUCE)]
                for d in range(2)}  # on the device: bucket packing, collectives' host work, update
    assert all(step_end.values())
    checked = {TaskKind.RECV: 0, TaskKind.SEND: 0, TaskKind.GRAD_SEND: 0}
    for i in range(len(tg)):
        cat = tg.category[i]
        if cat not in checked:
            continue
        t, d = tg.name[i][1], tg.device[i]
        if cat == TaskKind.RECV:  # in the reader's step (the consumer's forward or the producer's backward)
            step = task[("fwd", t.dst_op, t.dst_index, t.microbatch) if tg.name[i][0] == "recv"
                        else ("bwd", t.src_op, t.src_index, t.microbatch)]
            assert end[i] <= start[step]
            assert start[i] >= max((end[s] for s in steps[d] if end[s] <= start[step]), default=0.0)
        else:  # at the end of the writer's step (the producer's forward or the consumer's backward)
            step = task[("fwd", t.src_op, t.src_index, t.microbatch) if cat == TaskKind.SEND
                        else ("bwd", t.dst_op, t.dst_index, t.microbatch)]
            assert start[i] >= end[step]
            after = [s for s in steps[d] if start[s] >= end[step] and s != step]
            if not after:  # after the device's last step: its step end waits on it (not a tie's luck)
                after = step_end[d]
                assert {tg.category[k] for k in tg.successors(i)} & {TaskKind.UPDATE, TaskKind.ALLREDUCE}
            assert end[i] <= min(start[s] for s in after)
        checked[cat] += 1
    assert all(checked.values()), checked
    assert run_events(tg) == run_events(tg, native=False)
