"""The task graph of one training iteration, built from the lowering (never re-derived).

Tasks: forward and backward of every partition of every micro-batch (on its device, each
charged the device's ``task_overhead`` of host work where the executor runs it); every transfer
that crosses devices, forward and its mirrored gradient backward (on the links of its route),
each followed by a receive of ``message_overhead`` on the receiving device when that is set; the
small sums op rules ask for, timed and ordered by what waits on each (``_add_reductions``); the
end of the step as the executor runs it (``_link_step``) — the loss sums only the step waits
on, one all-reduce per device set holding replicated trainable shards (a DDP-style bucket) once
every device of the set has finished its backward pass, the loss value's all-reduce when not
every device knows it, and one optimizer update per device.

Delta simulation: the tasks of one op — its partitions, its reductions and the transfers into
it — depend only on the op's lowered pieces (its config and its producers' configs). They are
built as one block with local task ids and references to the producers' tasks, and a
``TaskCache`` keeps each op's block while the op's pieces are the same object (the lowering's
cache hands back the same object for an unchanged op). ``build_tasks`` lays the blocks out in
graph order and then links them (producer references, each device's schedule order, gradient
sync), so a graph built from cached blocks is the one built from scratch, task for task.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simulator.comm import allgather_time, group_sum_time, ring_links, transfer_time
from simulator.cost import CostModel
from simulator.step import UPDATE_TRAFFIC, link_step, member_ends
from simulator.taskgraph import (ALLREDUCE, BACKWARD, CATEGORY, FORWARD, GRAD_TRANSFER, RECV, REDUCE, TRANSFER,
                                  UPDATE, Columns, Segment, TaskGraph)
from simulator.topology import Topology
from strategies.graph import OpNode
from strategies.lowering import BACKWARD as BY_BACKWARD
from strategies.lowering import STEP as BY_STEP
from strategies.lowering import WEIGHT_KINDS, Lowered, OpPieces, ReductionGroup
from strategies.rules import get_rule
from strategies.schedule import passes, warmups

__all__ = ["TaskGraph", "TaskCache", "build_tasks", "FORWARD", "BACKWARD", "TRANSFER", "GRAD_TRANSFER",
           "REDUCE", "ALLREDUCE", "UPDATE", "RECV", "CATEGORY"]


def _links(topology: Topology, src: int, dst: int, offset: int) -> tuple[int, ...]:
    return tuple(offset + l for l in topology.route(src, dst))


class _Block:
    """The tasks of one op, ids local to the block: forward t and backward t + 1 of partition
    k of micro-batch j at t = ``fwd[j][k]``, then its reductions, then the transfers into it."""

    def __init__(self, pieces: OpPieces):
        self.pieces = pieces
        self.cols = Columns()
        self.add = self.cols.add
        self.segment: Segment | None = None
        self.edge_src: list[int] = []
        self.edge_dst: list[int] = []
        self.fwd: list[list[int]] = []
        self.fwd_done: list[list[int]] = []
        """What a consumer's forward waits on: the forward, or the reduction completing it."""
        self.bwd_done: list[list[int]] = []
        self.from_producer: dict[str, tuple[Any, Any]] = {}
        """Producer op -> (its local tasks, ours): the producer's fwd_done[j][k] -> our task."""
        self.to_producer: dict[str, tuple[Any, Any]] = {}
        """Producer op -> (our local tasks, its): our task -> the producer's backward."""
        self.steps: Any = ([], [], [])
        """(forward task, its device, its micro-batch) of every partition, in partition order;
        ``seal`` adds two rows, fwd_done and bwd_done: where each forward and backward step of
        the device's schedule ends, its blocking sum included."""
        self.step_reductions: list[tuple[ReductionGroup, list[int], bool]] = []
        """(group, its members' forward tasks, dynamic) of each sum only the end of the step
        waits on (a loss's; dynamic: its divisor needs the data). Its tasks are made by
        ``step.link_step``, which knows whether it rides a gradient bucket."""
        self.local: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.int64), np.empty(0, np.int64))
        """The edges inside the block (sources, targets)."""

    def edge(self, a: int, b: int) -> None:
        self.edge_src.append(a)
        self.edge_dst.append(b)

    def seal(self) -> "_Block":
        """Freeze the tasks and edges collected so far into arrays (blocks are shared by the cache)."""
        self.segment = Segment(self.cols)
        self.local = (np.asarray(self.edge_src, dtype=np.int64), np.asarray(self.edge_dst, dtype=np.int64))
        self.edge_src, self.edge_dst = [], []  # now in ``local``
        for pairs in (self.from_producer, self.to_producer):
            for op, (a, u) in pairs.items():
                pairs[op] = (np.asarray(a, dtype=np.int64), np.asarray(u, dtype=np.int64))
        done = ([t for ids in d for t in ids] for d in (self.fwd_done, self.bwd_done))
        self.steps = np.asarray([*self.steps, *done], dtype=np.int64).reshape(5, -1)
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
    b = _Block(pieces)
    devices = topology.devices
    op_time = cost.op_time
    runs = node.kind not in WEIGHT_KINDS  # the executor reads weights in place: no host work
    c = b.cols
    names, cats, durs, res, devs, nbytes, esrc, edst = (
        c.name, c.category, c.duration, c.resources, c.device, c.nbytes, b.edge_src, b.edge_dst)
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
    _add_reductions(b, node, pieces.reductions, backward, topology)
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


def _add_reductions(b: _Block, node: OpNode, reductions: tuple[ReductionGroup, ...], backward: bool,
                    topology: Topology) -> None:
    """The sums of ``node``'s reduction groups, by what waits on each (``strategies.lowering
    .gates``), each after its members' forwards, on the links of its ring, and each followed
    on every member device by its ``collective_overhead`` (``step.member_ends``: what waits on
    a sum on device d waits on d's end of it):

    - forward (batch statistics): an all-gather of every member's statistics that the
      partitions' consumers and the device's next step wait on, and in backward (when the op
      has one) a sum of the gradient statistics (``group_sum_time``: the executor's
      ``Group.sum``) that the gradients sent back and the device's next step wait on;
    - backward (a loss whose divisor needs the data, several micro-batches or not on every
      device): an all-gather started without waiting that the loss partitions' backward of that
      micro-batch wait on;
    - step: left to ``step.link_step`` (``b.step_reductions``, with whether its divisor needs
      the data): it rides a gradient bucket or is an all-gather of its own."""
    n = topology.num_devices
    dynamic = node.kind == "loss" and get_rule(node.kind).static_count(node) is None
    for g in reductions:
        j = g.microbatch
        fwd = b.fwd[j]
        if g.gates == BY_STEP:
            b.step_reductions.append((g, [fwd[k] for k in g.partitions], dynamic))
            continue
        device = [p.device for p in b.pieces.partitions[j]]
        links = tuple(n + l for l in ring_links(topology, g.devices))
        label = f"reduce {g.name} {g.op}@mb{j}"
        r = b.add(label, REDUCE, allgather_time(topology, g.devices, g.nbytes), links, g.devices[0], g.nbytes)
        for k in g.partitions:
            b.edge(fwd[k], r)
        ends = member_ends(b.add, b.edge, topology, r, g.devices, label, REDUCE)
        end = dict(zip(g.devices, ends))
        if g.gates == BY_BACKWARD:
            for k in g.partitions:
                b.edge(end[device[k]], fwd[k] + 1)
        else:
            for k in g.partitions:
                b.fwd_done[j][k] = end[device[k]]
            if backward and g.grad_nbytes:
                size = 8 if node.output.dtype == "float64" else 4  # batch statistics' float32
                t = group_sum_time(topology, g.devices, g.grad_nbytes, g.grad_nbytes // size)
                label = f"reduce-grad {g.name} {g.op}@mb{j}"
                rb = b.add(label, REDUCE, t, links, g.devices[0], g.grad_nbytes)
                end = dict(zip(g.devices, member_ends(b.add, b.edge, topology, rb, g.devices, label, REDUCE)))
                for k in g.partitions:
                    b.edge(fwd[k] + 1, rb)
                    b.bwd_done[j][k] = end[device[k]]


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
    traffic = UPDATE_TRAFFIC.get(optimizer)
    if traffic is None:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(UPDATE_TRAFFIC)}")
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
        offset[node.name] = tg.append(b.segment)
    m = strategy.microbatches
    # Link the blocks: every edge array with the offsets to add to its ends, added at once.
    src, dst, src_off, dst_off = [], [], [], []
    steps, step_off = [], []
    for op, b in blocks.items():
        off = offset[op]
        for a, u, aoff, uoff in ((*b.local, off, off),
                                 *((a, u, offset[p], off) for p, (a, u) in b.from_producer.items()),
                                 *((a, u, off, offset[p]) for p, (a, u) in b.to_producer.items())):
            src.append(a)
            dst.append(u)
            src_off.append(aoff)
            dst_off.append(uoff)
        steps.append(b.steps)
        step_off.append(off)
    sizes = [len(a) for a in src]
    tg.chunks.append((np.concatenate(src) + np.repeat(src_off, sizes),
                      np.concatenate(dst) + np.repeat(dst_off, sizes)))
    # Each device runs the schedule's order (strategies/schedule.py): per micro-batch its
    # forwards in graph and partition order (a stable sort by device and micro-batch). A step
    # starts once the one before it is done, a blocking sum in it included (the executor's
    # collectives run inside its forward and backward steps).
    st = np.concatenate(steps, axis=1)
    at = np.repeat(step_off, [x.shape[1] for x in steps])
    devs, mbs = st[1], st[2]
    order = np.lexsort((mbs, devs))
    ts, fd, bd = ((st[r] + at)[order] for r in (0, 3, 4))
    bounds = np.concatenate([[0], np.cumsum(np.bincount(devs * m + mbs, minlength=n * m))]).tolist()
    last: dict[int, int] = {}  # each device's last step: its backward pass is over after it
    ws = warmups(lowered)
    for d in sorted(set(devs.tolist())):
        cut = [slice(bounds[d * m + j], bounds[d * m + j + 1]) for j in range(m)]
        order_d = passes(m, ws[d])
        seq = np.concatenate([ts[cut[j]][::-1] + 1 if back else ts[cut[j]] for back, j in order_d])
        ends = np.concatenate([bd[cut[j]][::-1] if back else fd[cut[j]] for back, j in order_d])
        tg.chunks.append((ends[:-1], seq[1:]))
        last[d] = int(ends[-1])
    link_step(tg, lowered, topology, [(offset[op], b.step_reductions) for op, b in blocks.items()], last,
              optimizer, traffic)
    return tg
