"""The task graph of one training iteration, built from the lowering (never re-derived).

Tasks: forward and backward of every partition of every micro-batch (on its device); every
transfer that crosses devices, forward and its mirrored gradient backward (on the links of its
route); the small reductions op rules ask for; the gradient sync as the executor runs it — one
all-reduce per device set holding replicated trainable shards (a DDP-style bucket), once every
device of the set has finished its backward pass; one optimizer update per device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from simulator.comm import allreduce_time, ring_links, transfer_time
from simulator.cost import CostModel
from simulator.topology import Topology
from strategies.config import format_devices
from strategies.lowering import Lowered
from strategies.schedule import device_order

__all__ = ["TaskGraph", "build_tasks", "FORWARD", "BACKWARD", "TRANSFER", "GRAD_TRANSFER",
           "REDUCE", "ALLREDUCE", "UPDATE"]

FORWARD, BACKWARD, TRANSFER, GRAD_TRANSFER, REDUCE, ALLREDUCE, UPDATE = range(7)
CATEGORY = ("forward", "backward", "transfer", "grad_transfer", "reduce", "allreduce", "update")

# Optimizer update: read weight, gradient and state, write weight and state (bytes per weight
# byte, memory-bound): SGD with momentum 2 reads + 2 writes + grad read = 5; Adam 7.
_UPDATE_TRAFFIC = {"sgd": 5, "adam": 7}


@dataclass
class TaskGraph:
    """Parallel lists, one entry per task (array layout keeps the event loop fast)."""

    num_devices: int
    num_links: int
    name: list[Any] = field(default_factory=list)
    """A label per task: a string, or a tuple formatted by ``label`` only when shown (traces,
    errors), which keeps building the graph cheap."""
    category: list[int] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    resources: list[tuple[int, ...]] = field(default_factory=list)
    """Resource ids: device d is d, link l is num_devices + l."""
    device: list[int] = field(default_factory=list)
    """The device a task belongs to (a transfer's source) for traces and busy time."""
    nbytes: list[int] = field(default_factory=list)
    succs: list[list[int]] = field(default_factory=list)
    ndeps: list[int] = field(default_factory=list)

    def add(self, name: str, category: int, duration: float, resources: tuple[int, ...],
            device: int, nbytes: int = 0) -> int:
        self.name.append(name)
        self.category.append(category)
        self.duration.append(duration)
        self.resources.append(resources)
        self.device.append(device)
        self.nbytes.append(nbytes)
        self.succs.append([])
        self.ndeps.append(0)
        return len(self.name) - 1

    def label(self, t: int) -> str:
        name = self.name[t]
        if isinstance(name, str):
            return name
        what, op, index, mb = name
        return f"{what} {op}[{index}]@mb{mb}"

    def edge(self, a: int, b: int) -> None:
        self.succs[a].append(b)
        self.ndeps[b] += 1

    def __len__(self) -> int:
        return len(self.name)


def _links(topology: Topology, src: int, dst: int, offset: int) -> tuple[int, ...]:
    return tuple(offset + l for l in topology.route(src, dst))


def build_tasks(lowered: Lowered, topology: Topology, cost: CostModel, optimizer: str = "sgd") -> TaskGraph:
    """The task graph of one iteration of ``lowered`` on ``topology`` timed by ``cost``."""
    graph, strategy = lowered.graph, lowered.strategy
    if strategy.num_devices > topology.num_devices:
        raise ValueError(f"the plan uses {strategy.num_devices} devices but topology "
                         f"{topology.name!r} has {topology.num_devices}")
    n = topology.num_devices
    tg = TaskGraph(n, len(topology.links))
    fwd: dict[tuple[str, int, int], int] = {}
    bwd: dict[tuple[str, int, int], int] = {}
    devices = topology.devices
    names, cats, durs, res, devs, nbytes, succs, ndeps = (
        tg.name, tg.category, tg.duration, tg.resources, tg.device, tg.nbytes, tg.succs, tg.ndeps)
    for node in graph:  # the hot loop: inlined appends, labels formatted only when shown
        op_time = cost.op_time
        for parts in lowered.partitions[node.name]:
            for p in parts:
                f_s, b_s = op_time(node, p.box, devices[p.device])
                key = (node.name, p.index, p.microbatch)
                t = len(durs)
                fwd[key], bwd[key] = t, t + 1
                d = p.device
                names += (("fwd",) + key, ("bwd",) + key)
                cats += (FORWARD, BACKWARD)
                durs += (f_s, b_s)
                res += ((d,), (d,))
                devs += (d, d)
                nbytes += (0, 0)
                succs += ([t + 1], [])
                ndeps += (0, 1)
    # A partition's output is final once its reductions are done: consumers wait on those.
    fwd_done, bwd_done = dict(fwd), dict(bwd)
    for g in lowered.reductions:
        links = tuple(n + l for l in ring_links(topology, g.devices))
        t = allreduce_time(topology, g.devices, g.nbytes)
        rf = tg.add(f"reduce {g.name} {g.op}@mb{g.microbatch}", REDUCE, t, links, g.devices[0], g.nbytes)
        rb = tg.add(f"reduce-grad {g.name} {g.op}@mb{g.microbatch}", REDUCE, t, links, g.devices[0], g.nbytes)
        for k in g.partitions:
            key = (g.op, k, g.microbatch)
            tg.edge(fwd[key], rf)
            tg.edge(bwd[key], rb)
            fwd_done[key], bwd_done[key] = rf, rb
    for t in lowered.transfers:
        src = (t.src_op, t.src_index, t.microbatch)
        dst = (t.dst_op, t.dst_index, t.microbatch)
        if t.local:
            tg.edge(fwd_done[src], fwd[dst])
            tg.edge(bwd_done[dst], bwd[src])
            continue
        tag = f"{t.src_op}[{t.src_index}]->{t.dst_op}[{t.dst_index}]@mb{t.microbatch}"
        tf = tg.add(f"send {tag}", TRANSFER, transfer_time(topology, t.src_device, t.dst_device, t.nbytes),
                    _links(topology, t.src_device, t.dst_device, n), t.src_device, t.nbytes)
        tb = tg.add(f"send-grad {tag}", GRAD_TRANSFER,
                    transfer_time(topology, t.dst_device, t.src_device, t.nbytes),
                    _links(topology, t.dst_device, t.src_device, n), t.dst_device, t.nbytes)
        tg.edge(fwd_done[src], tf)
        tg.edge(tf, fwd[dst])
        tg.edge(bwd_done[dst], tb)
        tg.edge(tb, bwd[src])
    last: dict[int, int] = {}  # each device's last step: its backward pass is over after it
    for device, steps in device_order(lowered).items():  # each device runs the schedule's order
        for a, b in zip(steps, steps[1:]):
            tg.edge((bwd if a.backward else fwd)[a[1:]], (bwd if b.backward else fwd)[b[1:]])
        if steps:
            b = steps[-1]
            last[device] = (bwd if b.backward else fwd)[b[1:]]
    # Gradient sync as the executor does it (DDP-style buckets): after its last backward each
    # rank all-reduces one bucket per device set holding replicated trainable shards; then
    # every device runs its optimizer update.
    update_deps: dict[int, list[int]] = {d: [last[d]] for d in last}
    weight_bytes = [0] * n
    buckets: dict[tuple[int, ...], int] = {}
    for s in lowered.weight_shards:
        if not s.trainable:
            continue
        for d in s.devices:
            weight_bytes[d] += s.nbytes
        if len(s.devices) > 1:
            buckets[s.devices] = buckets.get(s.devices, 0) + s.nbytes
    for devs in sorted(buckets):
        links = tuple(n + l for l in ring_links(topology, devs))
        ar = tg.add(f"allreduce bucket {format_devices(devs)}", ALLREDUCE,
                    allreduce_time(topology, devs, buckets[devs]), links, devs[0], buckets[devs])
        for d in devs:
            tg.edge(last[d], ar)
            update_deps[d].append(ar)
    traffic = _UPDATE_TRAFFIC.get(optimizer)
    if traffic is None:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(_UPDATE_TRAFFIC)}")
    for d in sorted(last):
        if weight_bytes[d]:
            spec = topology.devices[d]
            u = tg.add(f"update {optimizer} device {d}", UPDATE,
                       traffic * weight_bytes[d] / spec.memory_bandwidth, (d,), d, weight_bytes[d])
            for dep in dict.fromkeys(update_deps[d]):
                tg.edge(dep, u)
    return tg

