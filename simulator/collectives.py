"""The tasks of a plan's collectives (``strategies.lowered.Collective``), as the executor runs
them: each member calls one at the start of its schedule step that ``strategies.schedule
.collective_steps`` names, and a collective runs once every member has called it (a blocking
collective, torch.distributed's rule) and its inputs are ready.

Forward: a ring all-reduce, reduce-scatter or all-gather (``simulator.comm.collective_time``)
on the links of the group's ring, after every holder's forward and every member's call; each
member's readers of it (every consumer op reading it) wait on the member's end of it
(``step.member_ends``: its ``collective_overhead`` after it). Backward, where the gradient
moves: the dual collective after every reader's backward and every member's call, which the
member's holder partition's backward waits on; under a cost model whose
``input_grad_overlap`` is set (Megatron-LM's asynchronous tensor-parallel communication), that
dual runs beside its readers' parameter-gradient products, so it is charged only what the
shortest of them leaves (``hidden_by_readers``). An all-gather whose readers all recompute,
or one along the sequence (``sequence_gather``) whose readers are all linears, is called again
in the backward (``strategies.collective_buffers``:
``BufferLife.regather``), at the step where its first reader is recomputed or runs its backward,
and its readers' backwards wait on it; where none of them recomputes and ``input_grad_overlap``
is set, it runs beside their input-gradient products (Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication.backward`` starts the all-gather, computes
``grad_output.matmul(weight)``, then waits), so it too is charged what the shortest leaves.

A member's call is an *arrival* of the collective's task in the device's schedule
(``simulator.step_order.link_schedule``'s slots): the collective waits on the step before the
call's step and what the host runs between the two (its sends, the buckets' packs started
there), edges into it, not a task of no duration between (a third of a tensor-parallel plan's
tasks were such calls; a task of no duration and no resource delays nothing, so the times are
the same). Built afresh for every task graph from ``Lowered.collectives`` (a collective shared
by several consumer ops belongs to no one op's block), so delta simulation needs nothing more.
"""

from __future__ import annotations

import itertools
import operator
from typing import NamedTuple, Sequence

import numpy as np

from simulator.collective_twins import READ, Twins
from simulator.comm import collective_time, ring_resources
from simulator.cost import CostModel, has_trainable_params
from simulator.step import member_ends
from simulator.taskgraph import INDEX, TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.collective_buffers import BufferLives, regather_steps
from strategies.lowered import Collective
from strategies.lowering import Lowered
from strategies.schedule import CollectiveSteps

__all__ = ["add_collectives", "hidden_by_readers"]


def add_collectives(tg: TaskGraph, lowered: Lowered, topology: Topology, blocks: Sequence,
                    first: np.ndarray, position: dict[str, int], keep: frozenset[int] | None = None,
                    cost: CostModel | None = None) -> np.ndarray:
    """Add every collective's tasks to ``tg``; ``blocks``, ``first``, ``position``: each op's
    block (``simulator.tasks._Block``), its first task id and its index; ``cost``: the model
    that timed the blocks (its ``input_grad_overlap``; None: no overlap); ``keep``: the devices
    simulated (``simulator.fold``: a collective timed over its group, its member tasks and
    edges on them; one with no member there has no tasks). Returns the arrivals' places in the
    devices' schedules as rows (the collective's task, the call's step's first task), global ids,
    one a member's call.

    One op's collectives (consecutive in ``Lowered.collectives``) that repeat with a period
    alike but for their micro-batch (the same kind, group, holders, bytes, readers, steps and
    regather steps: ``key``; a layer's in every micro-batch) are recorded once a period
    (``_record``: block references by micro-batch) and laid out for every period with numpy
    (``_Run``): the same tasks, edges and arrivals, in the same order, as one by one."""
    if not lowered.collectives:
        return np.empty((2, 0), dtype=INDEX)
    readers = lowered.collective_readers
    overlap = cost is not None and cost.input_grad_overlap
    known = _Known(topology)
    life_of, steps_of = BufferLives(lowered), CollectiveSteps(lowered)
    twins = Twins(lowered)

    def full(c, reads):
        """``c``'s run key and ``_record``'s arguments (``reads``: its readers)."""
        life = life_of(c)
        fwd_steps, bwd_steps = steps_of(c)
        j = c.microbatch
        every = reads
        if keep is not None:
            if not (keep.issuperset(fwd_steps) and keep.issuperset(bwd_steps)):
                fwd_steps = {d: s for d, s in fwd_steps.items() if d in keep}
                bwd_steps = {d: s for d, s in bwd_steps.items() if d in keep}
            reads = [r for r in reads if r.device in keep]
        again = None if life.regather is None else regather_steps(lowered, life)
        beside = again is not None and not any(lowered.strategy[r.dst_op].recompute for r in every)
        hidden = hidden_by_readers(lowered, every, topology, cost) if overlap and (c.grad or beside) else 0.0
        key = (c.kind, c.op, c.devices, c.holders, c.nbytes, c.grad, hidden, tuple(map(READ, reads)),
               _steps_key(fwd_steps, j), _steps_key(bwd_steps, j), again and _steps_key(again, j), beside)
        return key, (life, fwd_steps, bwd_steps, again, reads, keep, known, hidden, position, beside)

    def hidden_of(reads) -> float:
        return hidden_by_readers(lowered, reads, topology, cost)

    run = _Run(tg, blocks, first.tolist(), _record, lambda c: full(c, readers[c])[1])

    def one(c, reads) -> None:
        key = twins.key(c, reads, hidden_of if overlap else None)
        if key is not None:  # its twin's in the op's first micro-batch: the same key, recorded from there if need be
            run.add(c.op, key, c.microbatch, None, c)
            return
        key, args = full(c, reads)
        twins.keep(c, reads, key, args[0], args[7] if overlap and (c.grad or args[9]) else None)
        run.add(c.op, key, c.microbatch, args, c)

    kept = readers.items() if keep is None else [x for x in readers.items() if not keep.isdisjoint(x[0].devices)]
    for _, items in itertools.groupby(kept, _op_of):  # Lowered.collectives' order, an op's at a time
        items = list(items)
        cs, reads = map(list, zip(*items))
        js = list(map(_MICROBATCH, cs))
        k = js.count(js[0])
        if js != sorted(js) or len(js) % k or js[k - 1::k] != js[::k] or len(set(js[::k])) != len(js) // k:
            for c, r in items:  # not micro-batches of as many collectives each, in order: each on its own
                one(c, r)
            continue
        for c, r in items[:k]:  # the first micro-batch: the twins
            one(c, r)
        keys = twins.run(cs[k:], reads[k:], len(js) // k - 1)  # every later micro-batch at once
        if keys is not None:
            run.add_run(keys, js[k:], cs[k:])
            continue
        for c, r in items[k:]:  # else one by one
            one(c, r)
    run.flush()
    src, dst, arrivals = (np.concatenate([np.asarray(x, dtype=INDEX) for x in parts]) if parts else
                          np.empty(0, dtype=INDEX) for parts in (run.src, run.dst, run.arrivals))
    tg.chunks.append((src, dst))  # one chunk of edges (``TaskGraph.chunks``), not lists of ints
    return arrivals.reshape(-1, 2).T


_MICROBATCH = operator.itemgetter(2)


def _op_of(item: tuple) -> str:
    """A ``Lowered.collective_readers`` item's (collective, reads) op: its collective's."""
    return item[0].op


def _steps_key(steps: dict, j: int) -> tuple:
    """Member -> step as (device, backward, op, index, its micro-batch less ``j``)."""
    return tuple([(d, backward, op, index, microbatch - j) for d, (backward, op, index, microbatch) in steps.items()])


class _Known:
    """What a graph's collectives share: each group's ring links and its devices shown, each
    (kind, group, bytes)'s seconds (``_time``)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.rings: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = {}
        self.times: dict[tuple, float] = {}

    def ring(self, devices: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
        got = self.rings.get(devices)
        if got is None:
            got = self.rings[devices] = (ring_resources(self.topology, devices),
                                         ",".join(map(str, devices)))
        return got


class _Recorded(NamedTuple):
    """One collective's tasks, edges and arrivals with its micro-batch left open: names as
    ``str.format`` templates of it; an edge end or an arrival's step as a local task (an int,
    from 0) or a block reference (position, field, partition index, plus, micro-batch offset dj:
    ``first[position] + block.field[micro-batch + dj][index] + plus``)."""

    names: list[str]
    shifts: list[int]
    """Each task's micro-batch less the first collective's (``_merge``): its name's."""
    category: list[int]
    duration: list[float]
    resources: list[tuple[int, ...]]
    device: list[int]
    nbytes: list[int]
    src: list
    dst: list
    arrivals: list


def _record(life, fwd_steps: dict, bwd_steps: dict, again: dict | None, reads: Sequence, keep, known: _Known,
            hidden: float, position: dict[str, int], beside: bool) -> _Recorded:
    """``life``'s collective's tasks (``_Recorded``), as ``add_collectives`` lays them out:
    forward: the collective after every holder's forward and every member's call, each
    simulated member's end of it (``step.member_ends``), before its readers' forwards; again
    where its readers recompute or are linears (less ``hidden`` where ``beside``: beside the
    linears' input-gradient products); backward where the gradient moves."""
    c = life.collective
    topology = known.topology
    members = [(d, q) for d, q in zip(c.devices, c.holders) if keep is None or d in keep]
    simulated = [d for d, _ in members]
    links, shown = known.ring(c.devices)
    out = _Recorded([], [], [], [], [], [], [], [], [], [])
    op = c.op
    name = op.replace("{", "{{").replace("}", "}}")

    def task(label: str, seconds: float, resources: tuple, device: int, nbytes: int) -> int:
        out.names.append(label)
        out.shifts.append(0)
        out.category.append(TaskKind.COLLECTIVE)
        out.duration.append(seconds)
        out.resources.append(resources)
        out.device.append(device)
        out.nbytes.append(nbytes)
        return len(out.names) - 1

    def collective(label: str, seconds: float, before: list, steps: dict) -> dict[int, int]:
        x = task(label, seconds, links, c.devices[0], c.nbytes)
        out.src.extend(before)
        out.dst.extend([x] * len(before))
        for d, s in steps.items():  # each member's call at the start of its step (``step_order.link_schedule``'s slots)
            out.arrivals.append((x, (position[s.op], "fwd", s.index, s.backward, s.microbatch - c.microbatch)))
        ends = member_ends(lambda name, _category, seconds, resources, d: task(name, seconds, resources, d, 0),
                           lambda a, b: (out.src.append(a), out.dst.append(b)), topology, x, c.devices, label,
                           TaskKind.COLLECTIVE, simulated)
        return dict(zip(simulated, ends))

    holder = position[op]
    places = [position[r.dst_op] for r in reads]
    seconds = _time(known.times, topology, c.kind, c.devices, c.nbytes)
    ends = collective(f"{c.kind} {name}@mb{{0}} devices {shown}", seconds,
                      [(holder, "fwd_done", q, 0, 0) for _, q in members], fwd_steps)
    forwards = [(i, "fwd", r.dst_index, 0, 0) for i, r in zip(places, reads)]
    out.src.extend([ends[r.device] for r in reads])
    out.dst.extend(forwards)
    if again is not None:
        steps = {d: s for d, s in again.items() if d in simulated}
        ends = collective(f"{c.kind} again {name}@mb{{0}} devices {shown}",
                          max(0.0, seconds - hidden) if beside else seconds, [], steps)
        out.src.extend([ends[r.device] for r in reads])
        out.dst.extend([(i, "fwd", k, 1, 0) for i, _, k, _, _ in forwards])  # the readers' backwards
    if c.grad:
        seconds = max(0.0, _time(known.times, topology, c.backward_kind, c.devices, c.nbytes) - hidden)
        ends = collective(f"{c.backward_kind} grad {name}@mb{{0}} devices {shown}", seconds,
                          [(i, "bwd_done", r.dst_index, 0, 0) for i, r in zip(places, reads)], bwd_steps)
        out.src.extend([ends[d] for d, _ in members])
        out.dst.extend([(holder, "fwd", q, 1, 0) for _, q in members])
    return out


class _Run:
    """One op's collectives (``add``), laid out on ``tg``'s tail (``flush``) one after another:
    the shortest period their keys and micro-batches repeat with (``_period``) recorded once
    (``record``, on arguments given or ``found``), then each period's tasks; the edges and the
    arrivals' (call, step) ids collected flat (``add_collectives`` adds the edges as one chunk:
    the event loop reads no order among a task's edges)."""

    def __init__(self, tg: TaskGraph, blocks: Sequence, starts: list[int], record, found) -> None:
        self.tg, self.blocks, self.starts, self.record, self.found = tg, blocks, starts, record, found
        self.op: str | None = None
        self.pending: list[tuple[tuple, int, tuple | None, Collective]] = []  # (key, micro-batch, record's arguments, c)
        self.src: list = []
        self.dst: list = []
        self.arrivals: list = []
        """The edges' ends and the arrivals' (call, step) ids, flat, in order: pieces (lists of
        ints, int64 arrays) joined once every collective is laid out."""
        self.local: dict[tuple, np.ndarray] = {}
        """(id of a block's rows, index, dj, micro-batches) -> the local ids ``_refs`` read
        (``blocks`` holds the rows while the run lives: the ids stay theirs)."""

    def add(self, op: str, key: tuple, j: int, args: tuple | None, c: Collective) -> None:
        """``c`` of micro-batch ``j``, its run ``key``; ``args``: ``record``'s arguments, or None:
        ``found(c)`` gives them if its period records it."""
        if op != self.op:
            self.flush()
            self.op = op
        self.pending.append((key, j, args, c))

    def add_run(self, keys: list[tuple], js: list[int], cs: list[Collective]) -> None:
        """``add`` of each of ``cs``, collectives of the op added last, each with its twin's key
        (``keys``) and its micro-batch (``js``)."""
        self.pending.extend(zip(keys, js, itertools.repeat(None), cs))

    def flush(self) -> None:
        """Lay the pending collectives out, period after period."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        keys, js = [p[0] for p in pending], [p[1] for p in pending]
        p = _period(keys, js)
        self.lay(_merge([self.record(*(self.found(c) if args is None else args)) for _, _, args, c in pending[:p]],
                        [j - js[0] for j in js[:p]]), js[::p])

    def lay(self, r: _Recorded, js: list[int]) -> None:
        """``r`` laid out for each micro-batch of ``js`` (its first collective's): its tasks in
        the recorded order from the tail's next id, then its edges and arrivals."""
        tg, tail, n, k = self.tg, self.tg.tail, len(js), len(r.names)
        x = len(tg)
        tail.name += list(zip(r.names * n, (np.add.outer(js, r.shifts).ravel().tolist())))  # labels formatted when shown
        tail.category += r.category * n
        tail.duration += r.duration * n
        tail.resources += r.resources * n
        tail.device += r.device * n
        tail.nbytes += r.nbytes * n
        flat = [end for pair in r.arrivals for end in pair]
        if n == 1:  # one collective: its ids in Python
            j = js[0]
            at = [x + e if type(e) is int else self._ref(e, j) for e in r.src + r.dst + flat]
            e = len(r.src)
            self.src.append(at[:e])
            self.dst.append(at[e:2 * e])
            self.arrivals.append(at[2 * e:])
            return
        firsts = np.arange(x, x + n * k, k, dtype=np.int64)
        known: dict = {}
        for ends, into in ((r.src, self.src), (r.dst, self.dst), (flat, self.arrivals)):
            if not ends:
                continue
            # (collective, end) row-major: collective after collective, as one by one; the local
            # tasks' columns in one sum, each block reference's from its micro-batches' rows
            out = np.empty((n, len(ends)), dtype=np.int64)
            mine = [i for i, e in enumerate(ends) if type(e) is int]
            if mine:
                out[:, mine] = firsts[:, None] + np.array([ends[i] for i in mine], dtype=np.int64)
            if len(mine) < len(ends):
                for i, e in enumerate(ends):
                    if type(e) is not int:
                        got = known.get(e)
                        if got is None:
                            got = known[e] = self._refs(e, js)
                        out[:, i] = got
            into.append(out.ravel())

    def _ref(self, ref: tuple, j: int) -> int:
        """A block reference's task id in micro-batch ``j`` (``_Recorded``)."""
        at, field, index, plus, dj = ref
        return self.starts[at] + getattr(self.blocks[at], field)[j + dj][index] + plus

    def _refs(self, ref: tuple, js: list[int]) -> np.ndarray:
        """``_ref`` in each of the micro-batches ``js``: a block's local ids read once per rows
        object (the twin ops' blocks share theirs, ``simulator.twins``), index and micro-batches."""
        at, field, index, plus, dj = ref
        rows = getattr(self.blocks[at], field)
        key = (id(rows), index, dj, *js)
        got = self.local.get(key)
        if got is None:
            got = self.local[key] = np.fromiter([rows[j + dj][index] for j in js], np.int64, len(js))
        return got + (self.starts[at] + plus)


def _period(keys: list[tuple], js: list[int]) -> int:
    """The fewest leading collectives whose keys, and micro-batches counted from the first's,
    every later period repeats (``len(keys)`` where none fewer)."""
    n = len(keys)
    for p in range(1, n):
        if n % p == 0 and keys[p:] == keys[:n - p]:
            if p == 1:  # one collective a period: nothing counted within it
                return p
            periods = np.asarray(js, dtype=np.int64).reshape(n // p, p)
            if ((periods - periods[:, :1]) == (periods[0] - periods[0, 0])).all():
                return p
    return n


def _merge(parts: list[_Recorded], shifts: list[int]) -> _Recorded:
    """``parts`` (collectives of micro-batches ``shifts`` on from the first's) as one
    ``_Recorded``: their tasks one after another, block references moved to the first's
    micro-batch."""
    if len(parts) == 1 and not shifts[0]:
        return parts[0]
    out = _Recorded(*([] for _ in _Recorded._fields))
    for r, s in zip(parts, shifts):
        base = len(out.names)

        def local(e, base=base, s=s):
            return e + base if type(e) is int else (*e[:4], e[4] + s)

        out.names.extend(r.names)
        out.shifts.extend([x + s for x in r.shifts])
        for field in ("category", "duration", "resources", "device", "nbytes"):
            getattr(out, field).extend(getattr(r, field))
        out.src.extend(map(local, r.src))
        out.dst.extend(map(local, r.dst))
        out.arrivals.extend((local(a), local(b)) for a, b in r.arrivals)
    return out


def hidden_by_readers(lowered: Lowered, reads: Sequence, topology: Topology, cost: CostModel) -> float:
    """Seconds of a collective that one of its readers' backward products hides where it runs
    beside them (``CostModel.input_grad_overlap``): the shortest reader's, half its backward (the
    cost model charges an op with trainable parameters 2F, its input and parameter gradients
    alike, so the same figure sizes the second all-gather beside the input-gradient product and
    the dual beside the parameter-gradient one); 0 where a reader has no parameters (its
    backward has no product to hide the collective behind)."""
    hidden = float("inf")
    for r in reads:
        node = lowered.graph[r.dst_op]
        if not has_trainable_params(node):
            return 0.0
        part = lowered.pieces[r.dst_op].partitions[r.collective.microbatch][r.dst_index]
        hidden = min(hidden, cost.partition_time(node, part, topology.devices[r.device])[1] / 2)
    return 0.0 if hidden == float("inf") else hidden


def _time(known: dict, topology: Topology, kind: str, devices: tuple[int, ...], nbytes: int) -> float:
    """``collective_time``, once per (kind, group, bytes): a layer's collectives repeat in every
    micro-batch."""
    key = (kind, devices, nbytes)
    got = known.get(key)
    if got is None:
        got = known[key] = collective_time(topology, kind, devices, nbytes)
    return got
