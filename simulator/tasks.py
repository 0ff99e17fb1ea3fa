"""The task graph of one training iteration, built from the lowering (never re-derived).

Tasks: forward and backward of every partition of every micro-batch (on its device, each
charged the device's ``task_overhead`` of host work where the executor runs it); every transfer
that crosses devices, forward and its mirrored gradient backward (on the links of its route),
each followed by a receive of ``message_overhead`` on the receiving device when that is set; the
small reductions op rules ask for; the gradient sync as the executor runs it — one all-reduce
per device set holding replicated trainable shards (a DDP-style bucket), once every device of
the set has finished its backward pass; one optimizer update per device.

Delta simulation: the tasks of one op — its partitions, its reductions and the transfers into
it — depend only on the op's lowered pieces (its config and its producers' configs). They are
built as one block with local task ids and references to the producers' tasks, and a
``TaskCache`` keeps each op's block while the op's pieces are the same object (the lowering's
cache hands back the same object for an unchanged op). ``build_tasks`` lays the blocks out in
graph order and then links them (producer references, each device's schedule order, gradient
sync), so a graph built from cached blocks is the one built from scratch, task for task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simulator.comm import allreduce_time, ring_links, transfer_time
from simulator.cost import CostModel
from simulator.topology import Topology
from strategies.config import format_devices
from strategies.graph import OpNode
from strategies.lowering import WEIGHT_KINDS, Lowered, OpPieces
from strategies.schedule import passes, warmups

__all__ = ["TaskGraph", "TaskCache", "build_tasks", "FORWARD", "BACKWARD", "TRANSFER", "GRAD_TRANSFER",
           "REDUCE", "ALLREDUCE", "UPDATE", "RECV"]

FORWARD, BACKWARD, TRANSFER, GRAD_TRANSFER, REDUCE, ALLREDUCE, UPDATE, RECV = range(8)
CATEGORY = ("forward", "backward", "transfer", "grad_transfer", "reduce", "allreduce", "update", "recv")

# Optimizer update: read weight, gradient and state, write weight and state (bytes per weight
# byte, memory-bound): SGD with momentum 2 reads + 2 writes + grad read = 5; Adam 7.
_UPDATE_TRAFFIC = {"sgd": 5, "adam": 7}


@dataclass
class TaskGraph:
    """Parallel lists, one entry per task (array layout keeps the event loop fast); edges are
    collected as (source, target) arrays and turned into one adjacency (CSR) when first read."""

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
    edge_src: list[int] = field(default_factory=list)
    edge_dst: list[int] = field(default_factory=list)
    chunks: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """Edges added in bulk: (sources, targets)."""
    _adjacency: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False)

    def add(self, name: str, category: int, duration: float, resources: tuple[int, ...],
            device: int, nbytes: int = 0) -> int:
        self.name.append(name)
        self.category.append(category)
        self.duration.append(duration)
        self.resources.append(resources)
        self.device.append(device)
        self.nbytes.append(nbytes)
        return len(self.name) - 1

    def label(self, t: int) -> str:
        name = self.name[t]
        if isinstance(name, str):
            return name
        what, op, index, mb = name
        return f"{what} {op}[{index}]@mb{mb}"

    def edge(self, a: int, b: int) -> None:
        self.edge_src.append(a)
        self.edge_dst.append(b)

    def adjacency(self) -> tuple[list[int], list[int], list[int]]:
        """(first, succ, ndeps): task t's successors are succ[first[t]:first[t + 1]], in the
        order their edges were added; ndeps[t] counts t's predecessors (with multiplicity)."""
        if self._adjacency is None:
            n = len(self.name)
            src = np.concatenate([np.asarray(self.edge_src, dtype=np.int64)] + [c[0] for c in self.chunks])
            dst = np.concatenate([np.asarray(self.edge_dst, dtype=np.int64)] + [c[1] for c in self.chunks])
            order = np.argsort(src, kind="stable")
            first = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.bincount(src, minlength=n), out=first[1:])
            self._adjacency = (first.tolist(), dst[order].tolist(), np.bincount(dst, minlength=n).tolist())
        return self._adjacency

    def successors(self, t: int) -> list[int]:
        first, succ, _ = self.adjacency()
        return succ[first[t]:first[t + 1]]

    def __len__(self) -> int:
        return len(self.name)


def _links(topology: Topology, src: int, dst: int, offset: int) -> tuple[int, ...]:
    return tuple(offset + l for l in topology.route(src, dst))


class _Block(TaskGraph):
    """The tasks of one op, ids local to the block: forward t and backward t + 1 of partition
    k of micro-batch j at t = ``fwd[j][k]``, then its reductions, then the transfers into it."""

    def __init__(self, pieces: OpPieces, num_devices: int, num_links: int):
        super().__init__(num_devices, num_links)
        self.pieces = pieces
        self.fwd: list[list[int]] = []
        self.fwd_done: list[list[int]] = []
        """What a consumer's forward waits on: the forward, or the reduction completing it."""
        self.bwd_done: list[list[int]] = []
        self.from_producer: dict[str, tuple[Any, Any]] = {}
        """Producer op -> (its local tasks, ours): the producer's fwd_done[j][k] -> our task."""
        self.to_producer: dict[str, tuple[Any, Any]] = {}
        """Producer op -> (our local tasks, its): our task -> the producer's backward."""
        self.steps: Any = ([], [], [])
        """(forward task, its device, its micro-batch) of every partition, in partition order."""
        self.local: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.int64), np.empty(0, np.int64))
        """The edges inside the block (sources, targets)."""

    def seal(self) -> "_Block":
        """Freeze the edges collected so far into arrays (blocks are shared by the cache)."""
        self.local = (np.asarray(self.edge_src, dtype=np.int64), np.asarray(self.edge_dst, dtype=np.int64))
        self.edge_src, self.edge_dst = [], []  # now in ``local``
        for pairs in (self.from_producer, self.to_producer):
            for op, (a, u) in pairs.items():
                pairs[op] = (np.asarray(a, dtype=np.int64), np.asarray(u, dtype=np.int64))
        self.steps = tuple(np.asarray(x, dtype=np.int64) for x in self.steps)
        return self


class TaskCache:
    """Task blocks of one graph's ops on one topology timed by one cost model, reused while an
    op's lowered pieces are the same object (see the module docstring)."""

    def __init__(self, topology: Topology, cost: CostModel):
        self.topology, self.cost = topology, cost
        self.blocks: dict[str, _Block] = {}


def _op_block(node: OpNode, pieces: OpPieces, backward: bool, producers: dict[str, _Block],
              topology: Topology, cost: CostModel) -> _Block:
    """``producers``: the blocks of the ops ``node`` reads (their partitions' and reductions'
    local ids depend on their configs only, which ``pieces`` was derived from)."""
    n = topology.num_devices
    b = _Block(pieces, n, len(topology.links))
    devices = topology.devices
    op_time = cost.op_time
    runs = node.kind not in WEIGHT_KINDS  # the executor reads weights in place: no host work
    names, cats, durs, res, devs, nbytes, esrc, edst = (
        b.name, b.category, b.duration, b.resources, b.device, b.nbytes, b.edge_src, b.edge_dst)
    for j, parts in enumerate(pieces.partitions):
        ids = []
        for p in parts:  # the hot loop: inlined appends, labels formatted only when shown
            f_s, b_s = op_time(node, p.box, devices[p.device])
            d = p.device
            over = devices[d].task_overhead if runs else 0.0
            t = len(durs)
            ids.append(t)
            key = (node.name, p.index, j)
            names += (("fwd",) + key, ("bwd",) + key)
            cats += (FORWARD, BACKWARD)
            durs += (f_s + over, b_s + (over if backward else 0.0))
            res += ((d,), (d,))
            devs += (d, d)
            nbytes += (0, 0)
            esrc.append(t)
            edst.append(t + 1)
            b.steps[0].append(t)
            b.steps[1].append(d)
            b.steps[2].append(j)
        b.fwd.append(ids)
        b.fwd_done.append(list(ids))
        b.bwd_done.append([t + 1 for t in ids])
    for g in pieces.reductions:  # a partition's output is final once its reductions are done
        links = tuple(n + l for l in ring_links(topology, g.devices))
        t = allreduce_time(topology, g.devices, g.nbytes)
        rf = b.add(f"reduce {g.name} {g.op}@mb{g.microbatch}", REDUCE, t, links, g.devices[0], g.nbytes)
        rb = b.add(f"reduce-grad {g.name} {g.op}@mb{g.microbatch}", REDUCE, t, links, g.devices[0], g.nbytes)
        for k in g.partitions:
            b.edge(b.fwd[g.microbatch][k], rf)
            b.edge(b.fwd[g.microbatch][k] + 1, rb)
            b.fwd_done[g.microbatch][k], b.bwd_done[g.microbatch][k] = rf, rb
    for t in pieces.transfers:
        dst_f = b.fwd[t.microbatch][t.dst_index]
        dst_b = b.bwd_done[t.microbatch][t.dst_index]
        p = producers[t.src_op]
        src_f, src_b = p.fwd_done[t.microbatch][t.src_index], p.fwd[t.microbatch][t.src_index] + 1
        into = b.from_producer.setdefault(t.src_op, ([], []))
        back = b.to_producer.setdefault(t.src_op, ([], []))
        if t.local:
            _pair(into, src_f, dst_f)
            _pair(back, dst_b, src_b)
            continue
        tag = f"{t.src_op}[{t.src_index}]->{t.dst_op}[{t.dst_index}]@mb{t.microbatch}"
        tf = b.add(f"send {tag}", TRANSFER, transfer_time(topology, t.src_device, t.dst_device, t.nbytes),
                   _links(topology, t.src_device, t.dst_device, n), t.src_device, t.nbytes)
        tb = b.add(f"send-grad {tag}", GRAD_TRANSFER,
                   transfer_time(topology, t.dst_device, t.src_device, t.nbytes),
                   _links(topology, t.dst_device, t.src_device, n), t.dst_device, t.nbytes)
        _pair(into, src_f, tf)
        b.edge(dst_b, tb)
        recv_f, recv_b = devices[t.dst_device].message_overhead, devices[t.src_device].message_overhead
        if recv_f:
            r = b.add(f"recv {tag}", RECV, recv_f, (t.dst_device,), t.dst_device)
            b.edge(tf, r)
            tf = r
        if recv_b:
            r = b.add(f"recv-grad {tag}", RECV, recv_b, (t.src_device,), t.src_device)
            b.edge(tb, r)
            tb = r
        b.edge(tf, dst_f)
        _pair(back, tb, src_b)
    return b.seal()


def _pair(pairs: tuple[list[int], list[int]], a: int, u: int) -> None:
    pairs[0].append(a)
    pairs[1].append(u)


def build_tasks(lowered: Lowered, topology: Topology, cost: CostModel, optimizer: str = "sgd",
                cache: TaskCache | None = None) -> TaskGraph:
    """The task graph of one iteration of ``lowered`` on ``topology`` timed by ``cost``;
    ``cache`` (for this graph, topology and cost model) reuses unchanged ops' blocks."""
    graph, strategy = lowered.graph, lowered.strategy
    if strategy.num_devices > topology.num_devices:
        raise ValueError(f"the plan uses {strategy.num_devices} devices but topology "
                         f"{topology.name!r} has {topology.num_devices}")
    if cache is not None and (cache.topology is not topology or cache.cost is not cost):
        raise ValueError("build_tasks: the TaskCache was made for another topology or cost model")
    traffic = _UPDATE_TRAFFIC.get(optimizer)
    if traffic is None:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(_UPDATE_TRAFFIC)}")
    n = topology.num_devices
    tg = TaskGraph(n, len(topology.links))
    blocks: dict[str, _Block] = {}
    offset: dict[str, int] = {}
    for node in graph:  # lay the blocks out in graph order
        pieces = lowered.pieces[node.name]
        b = cache.blocks.get(node.name) if cache is not None else None
        if b is None or b.pieces is not pieces:
            b = _op_block(node, pieces, graph.needs_grad[node.name], blocks, topology, cost)
            if cache is not None:
                cache.blocks[node.name] = b
        blocks[node.name] = b
        offset[node.name] = len(tg.duration)
        tg.name += b.name
        tg.category += b.category
        tg.duration += b.duration
        tg.resources += b.resources
        tg.device += b.device
        tg.nbytes += b.nbytes
    m = strategy.microbatches
    # Link the blocks: every edge array with the offsets to add to its ends, added at once.
    src, dst, src_off, dst_off = [], [], [], []
    step_t, step_off, step_d, step_j = [], [], [], []
    for op, b in blocks.items():
        off = offset[op]
        for a, u, aoff, uoff in ((*b.local, off, off),
                                 *((a, u, offset[p], off) for p, (a, u) in b.from_producer.items()),
                                 *((a, u, off, offset[p]) for p, (a, u) in b.to_producer.items())):
            src.append(a)
            dst.append(u)
            src_off.append(aoff)
            dst_off.append(uoff)
        step_t.append(b.steps[0])
        step_off.append(off)
        step_d.append(b.steps[1])
        step_j.append(b.steps[2])
    sizes = [len(a) for a in src]
    tg.chunks.append((np.concatenate(src) + np.repeat(src_off, sizes),
                      np.concatenate(dst) + np.repeat(dst_off, sizes)))
    # Each device runs the schedule's order (strategies/schedule.py): per micro-batch its
    # forwards in graph and partition order (a stable sort by device and micro-batch).
    ts = np.concatenate(step_t) + np.repeat(step_off, [len(t) for t in step_t])
    devs, mbs = np.concatenate(step_d), np.concatenate(step_j)
    order = np.lexsort((mbs, devs))
    ts = ts[order]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(devs * m + mbs, minlength=n * m))]).tolist()
    last: dict[int, int] = {}  # each device's last step: its backward pass is over after it
    ws = warmups(lowered)
    for d in sorted(set(devs.tolist())):
        fwd = [ts[bounds[d * m + j]:bounds[d * m + j + 1]] for j in range(m)]
        seq = np.concatenate([fwd[j][::-1] + 1 if back else fwd[j] for back, j in passes(m, ws[d])])
        tg.chunks.append((seq[:-1], seq[1:]))
        last[d] = int(seq[-1])
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
    for d in sorted(last):
        if weight_bytes[d]:
            spec = topology.devices[d]
            u = tg.add(f"update {optimizer} device {d}", UPDATE,
                       traffic * weight_bytes[d] / spec.memory_bandwidth, (d,), d, weight_bytes[d])
            for dep in dict.fromkeys(update_deps[d]):
                tg.edge(dep, u)
    return tg
