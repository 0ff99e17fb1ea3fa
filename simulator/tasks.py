"""The task graph of one training iteration, built from the lowering (never re-derived).

Tasks: forward and backward of every partition of every micro-batch (on its device, each
charged the device's ``task_overhead`` of host work where the executor runs it; a weight op's,
which does no work, holds no device and so delays none of the device's tasks; a recompute
op's backward is charged its forward task's duration again, the recomputation the executor
runs in that step or for it); every transfer
that crosses devices, forward and its mirrored gradient backward where the gradient moves
(``OpGraph.moves_grad``; on the links of its route),
each followed by a receive of ``message_overhead`` (``exchange_overhead`` for a piece the op
also moves the other way) on the receiving device when that is set, and beside it a send on
the sending device where the link holds its sender's host (``Link.send_bandwidth``); the
small sums op rules ask for, timed and ordered by what waits on each (``_add_reductions``); the
end of the step as the executor runs it (``_link_step``) — the loss sums only the step waits
on, one all-reduce per device set holding replicated trainable shards (a DDP-style bucket),
started on each member after the backward step that makes its gradients final there
(``strategies.overlap``) and overlapping the rest of the backward, the loss value's all-reduce when not
every device knows it, and one optimizer update per device.

Delta simulation: the tasks of one op — its partitions, its reductions and the transfers into
it — depend only on the op's lowered pieces (its config and its producers' configs). They are
built as one block with local task ids and references to the producers' tasks, its edges
and schedule steps held as arrays (each end a local id and its block's position). A
``TaskCache`` keeps each op's block while the op's pieces are the same object (the lowering's
cache hands back the same object for an unchanged op), and the ``taskcache.KNOWN`` blocks
built before it by their pieces (a rejected proposal's ops go back to one; a chain's replicas
walk plans of their own in turn). ``build_tasks`` lays the blocks out in graph order and links
them with a few numpy calls over their arrays joined (the cache splices the changed blocks'
into the last graph's): producer references, each device's schedule order, then gradient
sync, so a graph built from cached blocks is the one built from scratch, task for task.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import numpy as np

from simulator.collectives import add_collectives
from simulator.comm import allgather_time, group_sum_time, ring_resources
from simulator.cost import CostModel
from simulator.fold import FoldError
from simulator.memory import MASTER
from simulator.step import UPDATE_TRAFFIC, link_step, member_ends
from simulator.step_order import before_inside, bucket_ready, device_steps, link_schedule
from simulator.symmetry import Copies
from simulator.zero3 import add_gathers
from simulator.taskcache import TaskCache, block_key
from simulator.taskgraph import CATEGORY, INDEX, Columns, Segment, TaskGraph, TaskKind
from simulator.topology import Topology
from simulator.twins import twin_block
from simulator.wires import wire_of
from strategies.graph import OpGraph, OpNode
from strategies.lowered import Gate
from strategies.lowering import WEIGHT_KINDS, Lowered, OpPieces, ReductionGroup, Transfer
from strategies.overlap import bucket_plan
from strategies.rules import get_rule

__all__ = ["TaskGraph", "TaskCache", "TaskKind", "CATEGORY", "build_tasks", "device_steps", "task_seconds"]


class _Block:
    """The tasks of one op, ids local to the block: forward t and backward t + 1 of partition
    k of micro-batch j at t = ``fwd[j][k]``, then its reductions, then the transfers into it.
    ``position``: the op's index in graph order, the block's place in the task graph."""

    def __init__(self, pieces: OpPieces, position: int):
        self.pieces, self.position = pieces, position
        self.cols = Columns()
        self.add = self.cols.add
        self.segment: Segment | None = None
        self.edge_src: list[int] = []
        self.edge_dst: list[int] = []
        self.cross: list[int] = []
        """Edges to or from a producer's tasks, flat: source, its block's position, target, its."""
        self.fwd: list[list[int]] = []
        self.fwd_done: list[list[int]] = []
        """What a consumer's forward waits on: the forward, or the reduction completing it."""
        self.bwd_done: list[list[int]] = []
        self.steps: Any = ([], [], [])
        """(forward task, its device, its micro-batch) of every partition, in partition order;
        ``seal`` adds three rows, fwd_done, bwd_done (where each forward and backward step of
        the device's schedule ends, its blocking sum included) and the block's position."""
        self.step_reductions: list[tuple[ReductionGroup, list[int], bool]] = []
        """(group, its members' forward tasks, dynamic) of each sum only the end of the step
        waits on (a loss's; dynamic: its divisor needs the data). Its tasks are made by
        ``step.link_step``, which knows whether it rides a gradient bucket."""
        self.edges = np.empty((4, 0), dtype=INDEX)
        """Every edge of the block, its own and its producers': rows (source, its block's
        position, target, its); a task's id in the graph is its local id plus its block's first."""
        self.slots: list[int] = []
        """Host tasks with a place in a device's schedule, flat: the task, its block's position,
        the schedule step (its forward or backward task), its block's position, and 1 for a
        receive inside the step (after the step before it) or 0 for a send after it (before the
        step after it)."""
        self.arrays: tuple[np.ndarray, ...] = ()
        """What ``build_tasks`` joins block after block: edges, steps, the segment's duration,
        res_len and res, and ``slots`` as rows."""

    def edge(self, a: int, b: int) -> None:
        self.edge_src.append(a)
        self.edge_dst.append(b)

    def seal(self) -> "_Block":
        """Freeze the tasks and edges collected so far into arrays (blocks are shared by the cache)."""
        self.segment = Segment(self.cols)
        own = len(self.edge_src)
        self.edges = np.empty((4, own + len(self.cross) // 4), dtype=INDEX)
        self.edges[0, :own] = np.fromiter(self.edge_src, INDEX, own)  # fromiter: no nested-list discovery
        self.edges[2, :own] = np.fromiter(self.edge_dst, INDEX, own)
        self.edges[1::2, :own] = self.position
        self.edges[:, own:] = np.fromiter(self.cross, INDEX, len(self.cross)).reshape(-1, 4).T
        self.edge_src, self.edge_dst, self.cross = [], [], []  # ``edges`` holds them
        size = len(self.steps[0])
        steps = np.empty((6, size), dtype=INDEX)
        for r, row in enumerate(self.steps):
            steps[r] = np.fromiter(row, INDEX, size)
        for r, done in ((3, self.fwd_done), (4, self.bwd_done)):  # folded: dicts of copy 0's partitions
            steps[r] = np.fromiter(itertools.chain.from_iterable(d.values() if isinstance(d, dict) else d
                                                                 for d in done), INDEX, size)
        steps[5] = self.position
        self.steps = steps
        slots = np.fromiter(self.slots, INDEX, len(self.slots)).reshape(-1, 5).T
        self.slots = []
        self.arrays = (self.edges, self.steps, self.segment.duration, self.segment.res_len, self.segment.res, slots)
        return self

    def moved(self, pieces: OpPieces, at: int, positions: dict[int, int], delta: int, cols: Columns,
              res: np.ndarray) -> "_Block":
        """This sealed block as another op's at position ``at`` (``simulator.twins``): ``pieces``
        its, every block position ``positions`` maps (its own and its producers') mapped, every
        device ``delta`` on, its tasks ``cols`` (their flat resources ``res``); local ids kept."""
        b = object.__new__(_Block)
        b.__dict__.update(self.__dict__)  # fwd, fwd_done, bwd_done: local ids, the same
        b.pieces, b.position, b.cols, b.add = pieces, at, cols, cols.add
        b.segment = object.__new__(Segment)
        b.segment.__dict__.update(self.segment.__dict__)
        b.segment.cols, b.segment.res = cols, res
        b.edge_src, b.edge_dst, b.cross, b.slots, b.step_reductions = [], [], [], [], []
        edges, steps, duration, res_len, _, slots = self.arrays
        edges, slots, steps = _positions(edges, positions), _positions(slots, positions), steps.copy()
        steps[1] += delta  # rows: task, device, micro-batch, fwd_done, bwd_done, position
        steps[5] = at
        b.edges, b.steps = edges, steps
        b.arrays = (edges, steps, duration, res_len, res, slots)
        return b


def _positions(a: np.ndarray, moved: dict[int, int]) -> np.ndarray:
    """``a`` (a block's ``edges`` or ``slots``: block positions in rows 1 and 3, each one of
    ``moved``'s keys) with its positions mapped by ``moved``."""
    out = a.copy()
    shifts = {new - old for old, new in moved.items()}
    if len(shifts) == 1:  # a layer's op reading its own layer's ops: every position one offset on
        out[1:4:2] += shifts.pop()
        return out
    for r in (1, 3):
        for old, new in moved.items():
            if old != new:
                out[r][a[r] == old] = new
    return out


def _op_block(node: OpNode, pieces: OpPieces, graph: OpGraph, producers: dict[str, _Block],
              position: int, topology: Topology, cost: CostModel, wires: dict,
              keep: frozenset[int] | None = None) -> _Block:
    """``producers``: the blocks of the ops ``node`` reads (their partitions' and reductions'
    local ids depend on their configs only, which ``pieces`` was derived from). ``keep``: the
    devices simulated (a folded plan's copy 0, ``simulator.fold``; None: all); a partition
    elsewhere has no tasks (``fwd``, ``fwd_done`` and ``bwd_done`` are then dicts by partition index).
    Partition times come from ``CostModel.partition_time``'s memo by partition."""
    backward = graph.needs_grad[node.name]
    b = _Block(pieces, position)
    devices = topology.devices
    op_time = cost.partition_time  # the regions the lowering stored on each partition
    runs = node.kind not in WEIGHT_KINDS  # the executor reads weights in place: no host work
    fwd_bwd = (TaskKind.FORWARD, TaskKind.BACKWARD)
    redo = 1 if pieces.recompute else 0  # its forward again, before its backward (docs/design.md, "Recompute")
    c = b.cols
    names, cats, durs, res, devs, nbytes, esrc, edst = (
        c.name, c.category, c.duration, c.resources, c.device, c.nbytes, b.edge_src, b.edge_dst)
    for j, parts in enumerate(pieces.partitions):
        ids = [] if keep is None else {}  # folded: partition index -> its forward, copy 0's only
        for p in parts:  # the hot loop: inlined appends, labels formatted only when shown
            d = p.device
            if keep is not None and d not in keep:
                continue
            f_s, b_s = op_time(node, p, devices[d])
            over = devices[d].task_overhead if runs else 0.0
            t = len(durs)
            if keep is None:
                ids.append(t)
            else:
                ids[p.index] = t
            key = (node.name, p.index, j)
            names += (("fwd",) + key, ("bwd",) + key)
            cats += fwd_bwd
            durs += task_seconds(f_s, b_s, over, backward, redo)
            res += ((d,), (d,)) if runs else ((), ())  # a weight op's steps hold nothing: no work
            devs += (d, d)
            nbytes += (0, 0)
            esrc.append(t)
            edst.append(t + 1)
            b.steps[0].append(t)
            b.steps[1].append(d)
            b.steps[2].append(j)
        b.fwd.append(ids)
        b.fwd_done.append(ids.copy())
        b.bwd_done.append([t + 1 for t in ids] if keep is None else {k: t + 1 for k, t in ids.items()})
    _add_reductions(b, node, pieces.reductions, backward, topology, keep)
    _add_transfers(b, pieces.transfers, producers, topology, wires, graph, keep)
    return b.seal()


def task_seconds(forward: float, backward_s: float, overhead: float, backward: bool, redo: int) -> tuple[float, float]:
    """A partition's forward and backward task durations from its op's times: each task pays the
    device's launch overhead (the backward only where the op has one), and a recomputed op runs
    its forward again before its backward (docs/design.md, "Recompute")."""
    return forward + overhead, backward_s + (overhead if backward else 0.0) + redo * (forward + overhead)


def _add_transfers(b: _Block, transfers: tuple[Transfer, ...], producers: dict[str, _Block],
                   topology: Topology, wires: dict, graph: OpGraph, keep: frozenset[int] | None = None) -> None:
    """Each transfer into the op that crosses devices: its send after the producer's forward
    (or the sum completing it) and before the partition's forward, its gradient's send back
    after the partition's backward where the gradient moves (``OpGraph.moves_grad``: the
    executor sends it only then), each followed by a receive of the receiving device's
    ``message_overhead`` when that is set (its ``exchange_overhead`` when the op also moves a
    piece the other way between the two devices in that micro-batch); where the route's first
    link holds its sender's host (``Link.send_bandwidth``), a send task on the sender beside
    the transfer, after the producer's forward, and one for the gradient after the partition's
    backward. Each receive and send has its place in its device's schedule (``b.slots``,
    chained by ``simulator.step_order.link_schedule``) where the executor spends it: a receive in its reader's step
    (the executor waits on a piece when the step reads it), a send at the end of its writer's
    step. A local read: the same edges, no tasks. Labels are (kind, transfer), formatted only
    when shown. ``keep``: the devices simulated (a transfer between others is skipped; one
    between them and another is ``simulator.fold.FoldError``: the plan's copies exchange pieces)."""
    devices, position = topology.devices, b.position
    c = b.cols
    names, cats, durs, res, devs, nbytes = c.name, c.category, c.duration, c.resources, c.device, c.nbytes
    esrc, edst, cross = b.edge_src, b.edge_dst, b.cross
    if keep is not None:
        mine = [t for t in transfers if t.dst_device in keep]
        if any(t.src_device not in keep for t in mine) or \
                len(mine) != sum(t.src_device in keep for t in transfers):
            raise FoldError(f"a transfer into {b.pieces.partitions[0][0].op!r} crosses copies")
        transfers = tuple(mine)
    received = _received(topology)  # else no receive tasks
    send_kinds = (TaskKind.TRANSFER, TaskKind.GRAD_TRANSFER)
    grads = {src: graph.moves_grad(src, transfers[0].dst_op) for src in producers} if transfers else {}
    crossed = {(t.src_device, t.dst_device, t.microbatch) for t in transfers if not t.local} if received else ()
    crossed_grad = {(t.src_device, t.dst_device, t.microbatch) for t in transfers
                    if not t.local and grads[t.src_op]} if received else ()
    for t in transfers:  # the hot loop of a changed op: inlined appends, as the partitions'
        src_op, src_index, dst_index, j = t.src_op, t.src_index, t.dst_index, t.microbatch
        src_device, dst_device, size = t.src_device, t.dst_device, t.nbytes
        dst_f, dst_b = b.fwd[j][dst_index], b.bwd_done[j][dst_index]
        p = producers[src_op]
        src_f, src_b, at = p.fwd_done[j][src_index], p.fwd[j][src_index] + 1, p.position
        if src_device == dst_device:  # a local read
            cross += (src_f, at, dst_f, position, dst_b, position, src_b, at)
            continue
        key = (src_device, dst_device, size)
        wire = wires.get(key)  # inlined: the hot loop
        if wire is None:
            wire = wire_of(topology, wires, key)
        grad = grads[src_op]
        tf = len(durs)  # the send, then its gradient's (tf + 1) where it moves
        if grad:
            names += (("send", t), ("send-grad", t))
            cats += send_kinds
            durs += (wire.seconds, wire.grad_seconds)
            res += (wire.links, wire.grad_links)
            devs += (src_device, dst_device)
            nbytes += (size, size)
        else:  # the executor sends no gradient back (e.g. the targets')
            b.add(("send", t), TaskKind.TRANSFER, wire.seconds, wire.links, src_device, size)
        if not received:
            recv_f = recv_b = 0.0
        else:  # exchanged: a piece (a gradient) moves the other way in this op too
            to, back = devices[dst_device], devices[src_device]
            recv_f = to.exchange_overhead if (dst_device, src_device, j) in crossed else to.message_overhead
            recv_b = back.exchange_overhead if (dst_device, src_device, j) in crossed_grad else back.message_overhead
        esrc.append(_receive(b, ("recv", t), recv_f, dst_device, tf, dst_f, position) if recv_f else tf)
        edst.append(dst_f)
        cross += (src_f, at, tf, position)
        if wire.send_hold:  # the sender's host copies (Link.send_bandwidth): after the producer, beside the wire
            cross += (src_f, at, _send(b, ("send-host", t), TaskKind.SEND, wire.send_hold, src_device, src_b - 1, at),
                      position)
        if not grad:
            continue
        tb = tf + 1
        cross += (_receive(b, ("recv-grad", t), recv_b, src_device, tb, src_b, at) if recv_b else tb,
                  position, src_b, at)
        esrc.append(dst_b)
        edst.append(tb)
        if wire.grad_send_hold:
            esrc.append(dst_b)
            edst.append(_send(b, ("send-host-grad", t), TaskKind.GRAD_SEND, wire.grad_send_hold, dst_device,
                              dst_f + 1, position))


@functools.lru_cache(maxsize=64)
def _received(topology: Topology) -> bool:
    """Whether some device of ``topology`` spends host work receiving a piece (receive tasks)."""
    return any(d.message_overhead or d.exchange_overhead for d in topology.devices)


def _receive(b: _Block, name: tuple, seconds: float, device: int, wire: int, step: int, at: int) -> int:
    """A receive of ``seconds`` on ``device`` after the ``wire`` task, inside the schedule step
    whose first task is ``step`` of the block at ``at`` (``_Block.slots``); returns it."""
    r = b.add(name, TaskKind.RECV, seconds, (device,), device)
    b.edge(wire, r)
    b.slots += (r, b.position, step, at, 1)
    return r


def _send(b: _Block, name: tuple, category: TaskKind, seconds: float, device: int, step: int, at: int) -> int:
    """A send holding ``device``'s host ``seconds`` at the end of the schedule step whose first
    task is ``step`` of the block at ``at`` (``_Block.slots``); returns it (the caller adds
    what it waits on)."""
    h = b.add(name, category, seconds, (device,), device)
    b.slots += (h, b.position, step, at, 0)
    return h


def _add_reductions(b: _Block, node: OpNode, reductions: tuple[ReductionGroup, ...], backward: bool,
                    topology: Topology, keep: frozenset[int] | None = None) -> None:
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
      the data): it rides a gradient bucket or is an all-gather of its own.

    ``keep``: the devices simulated (``simulator.fold``): a sum timed over its whole group, its
    edges and member ends only on them; a sum none of whose members is kept has no tasks."""
    dynamic = node.kind == "loss" and get_rule(node.kind).static_count(node) is None
    for g in reductions:
        j = g.microbatch
        fwd = b.fwd[j]
        ks, members = g.partitions, g.devices
        if keep is not None:
            ks = [k for k in ks if k in fwd]
            members = [d for d in members if d in keep]
            if not ks:
                continue
        if g.gates == Gate.STEP:
            b.step_reductions.append((g, [b.fwd_done[j][k] for k in ks], dynamic))
            continue
        device = {p.index: p.device for p in b.pieces.partitions[j]}
        links = ring_resources(topology, g.devices)
        label = f"reduce {g.name} {g.op}@mb{j}"
        r = b.add(label, TaskKind.REDUCE, allgather_time(topology, g.devices, g.nbytes), links, g.devices[0], g.nbytes)
        for k in ks:  # after the op's earlier sums (a class-cut loss: max, then sums)
            b.edge(b.fwd_done[j][k], r)
        ends = member_ends(b.add, b.edge, topology, r, g.devices, label, TaskKind.REDUCE, members)
        end = dict(zip(members, ends))
        if g.gates == Gate.BACKWARD:
            for k in ks:
                b.edge(end[device[k]], fwd[k] + 1)
        else:
            for k in ks:
                b.fwd_done[j][k] = end[device[k]]
            if backward and g.grad_nbytes:
                size = 8 if node.output.dtype == "float64" else 4  # batch statistics' float32
                t = group_sum_time(topology, g.devices, g.grad_nbytes, g.grad_nbytes // size)
                label = f"reduce-grad {g.name} {g.op}@mb{j}"
                rb = b.add(label, TaskKind.REDUCE, t, links, g.devices[0], g.grad_nbytes)
                end = dict(zip(members, member_ends(b.add, b.edge, topology, rb, g.devices, label, TaskKind.REDUCE,
                                                   members)))
                for k in ks:
                    b.edge(fwd[k] + 1, rb)
                    b.bwd_done[j][k] = end[device[k]]


def build_tasks(lowered: Lowered, topology: Topology, cost: CostModel, optimizer: str = "sgd",
                cache: TaskCache | None = None, copies: Copies | None = None) -> TaskGraph:
    """The task graph of one iteration of ``lowered`` on ``topology`` timed by ``cost``;
    ``cache`` (for this graph, topology and cost model) reuses unchanged ops' blocks.
    ``copies``: the plan's replica copies (``simulator.symmetry``): only copy 0's tasks are
    built, and each collective over several copies once, timed over its whole group, with the
    edges and member ends of copy 0's members (``simulator.fold``)."""
    strategy = lowered.strategy
    if lowered.copies is not None and copies != lowered.copies:  # copy 0's lowering: its own fold only
        lowered.check_whole("a task graph per device" if copies is None else f"a task graph folded on {copies}")
    if strategy.num_devices > topology.num_devices:
        raise ValueError(f"the plan uses {strategy.num_devices} devices but topology "
                         f"{topology.name!r} has {topology.num_devices}")
    if cache is None:
        cache = TaskCache(topology, cost, counted=False)  # a fresh one builds every block, let go after
    elif cache.topology is not topology or cache.cost is not cost:
        raise ValueError("build_tasks: the TaskCache was made for another topology or cost model")
    traffic = UPDATE_TRAFFIC.get(optimizer)
    if traffic is None:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(UPDATE_TRAFFIC)}")
    if strategy.precision != "model":  # the update reads and writes float32 master and state
        traffic = MASTER * traffic + 1  # (2 bytes per compute-dtype byte), then writes the half copy
    keep = None if copies is None else copies.kept
    tg = TaskGraph(topology.num_devices, len(topology.links))
    tg.copies = copies
    blocks = _blocks(lowered, topology, cost, cache, keep)
    joined = cache.join(blocks)
    edges, steps, *tasks, slots = joined.arrays
    first = tg.place(joined.segments, tuple(tasks), joined.first)
    tg.chunks.append((edges[0] + first[edges[1]], edges[2] + first[edges[3]]))
    position = cache.layout(lowered.graph, keep)[1]
    arrivals = add_collectives(tg, lowered, topology, blocks, first, position, keep, cost)
    gathers, scattered = add_gathers(tg, lowered, topology, blocks, first, position, keep, cache.gathers, cost)
    if gathers.shape[1]:  # level-3 weights (FSDP): their calls sit in the schedules like collectives'
        arrivals = np.concatenate([arrivals, gathers], axis=1)
    last, inside = link_schedule(tg, lowered, steps, first, slots, arrivals)
    for d, ends in scattered.items():  # the update waits on the gradients' reduce-scatters
        last[d] += ends
    if not lowered.strategy.overlap_grad_reduce:
        _sends_done(tg, last)
    step_sums = [(int(first[i]), blocks[i].step_reductions) for i in joined.summing]
    order, issues = bucket_plan(lowered, position, cache.buckets)
    if keep is not None:
        issues = {d: mine for d, mine in issues.items() if d in keep}
    packs = link_step(tg, lowered, topology, step_sums, last, optimizer, traffic, order,
                      bucket_ready(tg, position, blocks, first, issues), keep, cache.step_tasks)
    if packs and len(inside[0]):  # a step's calls and receives follow the packs the host ran before it
        tg.chunks.append(before_inside(*(np.asarray(x, dtype=INDEX) for x in zip(*packs)), *inside))
    return tg


def _sends_done(tg: TaskGraph, last: dict[int, list[int]]) -> None:
    """A plan whose buckets sync after the backward (``strategies.overlap``): each device of
    ``last`` that sends gets one instant task after every send it made (its sender's), which
    its ``last`` (its buckets' packs and its update) then waits on: one edge a send, not one a
    send and pack."""
    kind = np.asarray(tg.category)
    sends: dict[int, list[int]] = {}
    for t in np.flatnonzero((kind == TaskKind.TRANSFER) | (kind == TaskKind.GRAD_TRANSFER)).tolist():
        sends.setdefault(tg.device[t], []).append(t)
    for d, mine in sends.items():
        if d in last:
            done = tg.add(f"sends done device {d}", TaskKind.ALLREDUCE, 0.0, (), d)
            tg.edge_src += mine
            tg.edge_dst += [done] * len(mine)
            last[d].append(done)


def _blocks(lowered: Lowered, topology: Topology, cost: CostModel, cache: TaskCache,
            keep: frozenset[int] | None = None) -> list[_Block]:
    """Every op's block in graph order: the cache's while the op's pieces are the same object,
    else one built before for the same partitions, transfers and reductions (``block_key``),
    else built (and kept in the cache); ``keep``: the devices simulated (None: all)."""
    graph = lowered.graph
    nodes, position, kept, known, was = cache.layout(graph, keep)
    wires = cache.wires
    pieces = list(map(lowered.pieces.__getitem__, position))  # position: the op names in graph order
    for i in list(itertools.compress(range(len(pieces)), map(operator.is_not, pieces, was))):
        mine, p = known[i], pieces[i]
        if kept[i] is not None:
            cache.hold(mine, block_key(kept[i].pieces), kept[i])
        b = cache.reuse(mine, block_key(p))  # held blocks hold their pieces: an id is theirs
        if b is None:
            node = nodes[i]  # in graph order: its producers' blocks are current
            producers = {src: kept[position[src]] for src in node.inputs}
            b = (twin_block(lowered, node, p, producers, i, kept, position, topology, wires)  # its twin's, renamed
                 or _op_block(node, p, graph, producers, i, topology, cost, wires, keep))
        kept[i], was[i] = b, p
    return list(kept)
