"""The end of a training step as the executor runs it (``runtime.Executor.step``): the loss
sums it waits on, the gradient sync (one all-reduce per gradient bucket: a device set's
replicated trainable shards cut at the plan's cap, DDP-style buckets, each packed into one tensor, started as soon as its gradients are
final on a member (``strategies.overlap``), overlapping the rest of the backward, and copied
back; a level-1 bucket, ``strategies.zero``, reduce-scattered instead; levels 2 and 3 were
reduce-scattered per use, ``simulator.zero3``), the loss value's all-reduce when not every
device knows it (overlapping the update), the optimizer update (of the chunks of sharded state
only), and the all-gathers of the updated level-1 and level-2 chunks. Every collective is
followed, on each member device, by that device's ``collective_overhead`` of host work
(``member_ends``); the step end's are recorded in ``TaskGraph.syncs``, whose overheads
``simulator.stragglers`` scales by how many members arrive together."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from simulator.comm import allgather_time, allreduce_time, collective_time, ring_resources
from simulator.devices import DeviceSpec
from simulator.taskgraph import Columns, Recorded, TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.config import format_devices
from strategies.members import kept_members
from strategies.lowering import BucketKey, Lowered, ReductionGroup, bucket_sums, loss_on_every_device
from strategies.precision import reduce_scale
from strategies.zero import per_use_shards, shard_chunk_bytes, sharded_state, zero_buckets

__all__ = ["COPY_TRAFFIC", "link_step", "member_ends", "UPDATE_TRAFFIC"]

UPDATE_TRAFFIC = {"sgd": 5, "adam": 7}
"""Optimizer update bytes per weight byte (memory-bound: read weight, gradient and state, write
weight and state): SGD with momentum 2 reads + 2 writes + the gradient's read = 5; Adam 7."""
COPY_TRAFFIC = 2
"""Bytes moved per byte copied (read + write): a gradient bucket is packed into one flat tensor
before its all-reduce and copied back after it (``_copy_time``)."""


def member_ends(add: Callable[..., int], edge: Callable[[int, int], None], topology: Topology, collective: int,
                devices: Sequence[int], label: str, category: int,
                simulated: Sequence[int] | None = None) -> list[int]:
    """Where ``collective`` (a task on the links of its ring) ends for each of its ``devices``:
    a task of the device's ``collective_overhead`` on the device, after the collective, when
    that is set, else the collective itself. So a member's next step (or whatever waits on the
    collective there) starts at ``end(collective) + collective_overhead(d)``: the ring formula
    times the wire, the overhead the call's host work and the wait for the member that arrives
    last by the host's jitter (``simulator.stragglers``), which the device pays even when the
    collective itself ran behind its compute.
    ``add`` and ``edge``: a task graph's or a block's (the ids they return); ``simulated``: the
    members to make ends for, in order (a folded plan's in copy 0, ``simulator.fold``; default
    all ``devices``)."""
    ends = []
    for d in devices if simulated is None else simulated:
        over = topology.devices[d].collective_overhead
        if over and len(devices) > 1:
            h = add(f"{label} host device {d}", category, over, (d,), d)
            edge(collective, h)
            ends.append(h)
        else:
            ends.append(collective)
    return ends


def link_step(tg: TaskGraph, lowered: Lowered, topology: Topology,
              step_sums: list[tuple[int, list[tuple[ReductionGroup, list[int], bool]]]], last: dict[int, list[int]],
              optimizer: str, traffic: float, order: list[BucketKey],
              issued: dict[tuple[BucketKey, int], tuple[int, int | None]],
              keep: frozenset[int] | None = None, memo: Recorded | None = None) -> list[tuple[int, int]]:
    """The end of the step as the executor runs it (``runtime.Executor.step``). The loss sums
    gated STEP (``step_sums``: per block with such sums, its first id and its sums with their members'
    forward tasks and whether the divisor needs the data) travel in the gradient bucket of
    their device set where ``strategies.lowering.bucket_sums`` says so (their bytes added to
    it); the others are ring all-gathers of their own, started after the members' forwards.
    Each gradient bucket (``strategies.lowered.split_buckets``: a device set's, dtype's and
    level's shards cut at the plan's ``bucket_cap_mb``) is packed into
    one flat tensor on each member (``_copy_time``) right after the backward step that
    ``strategies.overlap.bucket_issues`` names there and before the next (``issued``: (bucket,
    device) -> that step's end task, the next step's first task or None), so its all-reduce (level 1: reduce-scatter) overlaps the rest of the
    backward on the links it shares with its traffic, in ``order`` (``bucket_order``); a member copies the
    sums back after it (level 0); without ``overlap_grad_reduce`` every pack also waits on the
    device's ``last`` (its sends done). Each device, after its last backward step and the sends after
    it (``last``), its buckets and its STEP sums (it divides its gradients by a dynamic C after
    the sync), runs its optimizer update; and, when the loss is not on every device in every micro-batch,
    one all-reduce of the loss value (a float64) over every device, started when every device
    is that far and overlapping the updates (nothing in them reads it; the step ends when it
    has). Each collective here ends on each member with its ``member_ends``. ``keep``: the
    devices simulated (a folded plan's copy 0, ``simulator.fold``; ``last`` and ``issued``
    name only them): each collective is timed over its group, its member tasks made on them.
    ``memo``: the ``Recorded`` the caller keeps across the graphs of one topology: each
    bucket's tasks recorded once (``_record_bucket``) and laid out again, the edges to the
    steps around them made per graph (the same tasks and edges, in the same order, as recorded
    afresh). Returns (pack, the next step's first task) of each pack before a step."""
    mine = (lambda devs: devs) if keep is None else (lambda devs: kept_members(devs, keep))
    later: dict[int, list[int]] = {d: [] for d in last}  # what only its update waits on
    rides = bucket_sums(lowered, [g for _, sums in step_sums for g, _, _ in sums]) if step_sums else {}
    riders: dict[BucketKey, list] = {}  # gradient bucket -> [bytes, forward tasks] of its sums
    for off, sums in step_sums:
        for g, fwds, _ in sums:
            fwds = [off + f for f in fwds]
            if g in rides:
                entry = riders.setdefault(rides[g], [0, []])
                entry[0] += g.nbytes
                entry[1] += fwds
                continue
            label = f"reduce {g.name} {g.op}@mb{g.microbatch}"
            r = tg.add(label, TaskKind.REDUCE, allgather_time(topology, g.devices, g.nbytes),
                       ring_resources(topology, g.devices), g.devices[0], g.nbytes)
            for f in fwds:
                tg.edge(f, r)
            members = mine(g.devices)
            for e, d in zip(member_ends(tg.add, tg.edge, topology, r, g.devices, label, TaskKind.REDUCE, members),
                            members):
                later[d].append(e)
    state = sharded_state(lowered)
    weight_bytes, tensors = state.updated, state.tensors
    buckets = lowered.gradient_sync.buckets
    sharded = zero_buckets(lowered)
    synced = {d: last[d] + later[d] for d in last}
    memo = Recorded() if memo is None else memo
    memo.bound(MEMO, MEMO_TASKS)
    src, dst = tg.edge_src, tg.edge_dst
    packs: list[tuple[int, int]] = []
    overlapped = lowered.strategy.overlap_grad_reduce
    for key in order:  # levels 0 and 1 (2 and 3: reduce-scattered per use, simulator.zero3)
        if keep is not None and not mine(key.devices):  # a member fold's member m >= 2: member 1's image
            continue
        zb = sharded.get(key)
        extra, fwds = riders.get(key, (0, []))
        wide = reduce_scale(lowered.strategy, key.dtype)  # summed in the plan's reduce dtype (FSDP2's reduce_dtype)
        # padded to n chunks at level 1
        nbytes = buckets[key] * wide + extra if zb is None else zb.chunk_bytes * wide * len(key.devices)
        mkey = (key, nbytes, buckets[key] * wide, zb is not None, keep)
        t = memo.records.get(mkey)
        if t is None:
            t = memo.record(mkey, _record_bucket(topology, key, nbytes, buckets[key] * wide, zb is not None,
                                                 mine(key.devices)))
        base = tg.extend(t.cols)
        for f in fwds:
            src.append(f)
            dst.append(base)
        for p, d in enumerate(t.members, base + 1):  # its pack, between two steps as the executor runs it
            after, before = issued[(key, d)]
            if not overlapped:  # after the device's last step and the sends after it (strategies.overlap)
                src += last[d]
                dst += [p] * len(last[d])
            if before is None:
                src += (after, p)
                dst += (p, base)
            else:
                src += (after, p, p)
                dst += (p, before, base)
                packs.append((p, before))
        src += [base + a for a in t.src]
        dst += [base + b for b in t.dst]
        if t.hosts:
            tg.syncs.append((base, tuple((d, base + h) for d, h in t.hosts),
                             tuple((d, p) for p, d in enumerate(t.members, base + 1)), t.count))
        for d, e in zip(t.members, t.ends):
            synced[d].append(base + e)
    if not loss_on_every_device(lowered):
        everyone = tuple(range(lowered.strategy.num_devices))
        rep = tg.add("allreduce loss", TaskKind.ALLREDUCE, allreduce_time(topology, everyone, _LOSS_BYTES),
                     ring_resources(topology, everyone), 0, _LOSS_BYTES)
        arrivals = [(d, dep) for d in sorted(synced) for dep in dict.fromkeys(synced[d])]
        src += [dep for _, dep in arrivals]
        dst += [rep] * len(arrivals)
        _synced_ends(tg, topology, rep, everyone, "allreduce loss", TaskKind.ALLREDUCE, arrivals, mine(everyone))
    updates = {}
    for d in sorted(last):
        if weight_bytes[d]:
            u = updates[d] = tg.add(f"update {optimizer} device {d}", TaskKind.UPDATE,
                                    _update_time(topology.devices[d], traffic, weight_bytes[d], tensors[d]),
                                    (d,), d, weight_bytes[d])
            deps = dict.fromkeys(synced[d])
            src += deps
            dst += [u] * len(deps)
    chunks = [(zb.key.devices, zb.chunk_bytes, _bucket_name(zb.key)[len("bucket "):]) for zb in sharded.values()]
    chunks += [(s.devices, shard_chunk_bytes(s), f"{s.name} zero2") for s in per_use_shards(lowered) if s.zero == 2]
    _gather_chunks(tg, topology, chunks, updates, mine)
    return packs


MEMO = 4096
"""Gradient buckets' recorded tasks a ``link_step`` memo keeps (``Recorded.bound``: from them it
starts empty)."""
MEMO_TASKS = 1 << 18
"""The tasks those recordings may hold in all (a bucket's grow with its members simulated:
2-3 a member); past them the memo starts empty (speed, never results)."""


class _BucketTasks(NamedTuple):
    """A gradient bucket's step-end tasks (``_record_bucket``), ids local to them: its
    collective 0, member i's pack 1 + i, then the members' overhead tasks and unpacks."""

    cols: Columns
    members: tuple[int, ...]
    """The members simulated, in order."""
    hosts: tuple[tuple[int, int], ...]
    """(member, its overhead task) of the members with one (``member_ends``)."""
    src: list[int]
    dst: list[int]
    """The edges among them past the packs': the collective to the overhead tasks, each
    member's end to its unpack."""
    ends: tuple[int, ...]
    """Each member's last task: what its update waits on."""
    count: int
    """The members each simulated one stands for (``TaskGraph.syncs``)."""


def _record_bucket(topology: Topology, key: BucketKey, nbytes: int, unpacked: int, scattered: bool,
                   members: Sequence[int]) -> _BucketTasks:
    """Bucket ``key``'s tasks: its all-reduce (``scattered``: level 1's reduce-scatter) of
    ``nbytes`` on its ring, each member's pack of them, its member ends and (level 0) its copy
    of the ``unpacked`` bytes back; a pure function of its arguments, so ``link_step`` records
    it once and lays it out again with the edges to the steps it waits on and before."""
    devs = key.devices
    cols, src, dst = Columns(), [], []
    kind = "reduce_scatter" if scattered else "all_reduce"
    label = f"{kind.replace('_', '')} {_bucket_name(key)}"
    cols.add(label, TaskKind.ALLREDUCE, collective_time(topology, kind, devs, nbytes),
             ring_resources(topology, devs), devs[0], nbytes)
    for d in members:
        cols.add(f"pack {label} device {d}", TaskKind.ALLREDUCE, copy_time(topology.devices[d], nbytes), (d,), d)
    ends = member_ends(cols.add, lambda a, b: (src.append(a), dst.append(b)), topology, 0, devs, label,
                       TaskKind.ALLREDUCE, members)
    hosts = tuple((d, e) for d, e in zip(members, ends) if e != 0)
    if not scattered:  # level 0: the sums copied back (level 1: its chunk is the optimizer's gradient)
        done = []
        for d, e in zip(members, ends):
            u = cols.add(f"unpack {label} device {d}", TaskKind.ALLREDUCE, copy_time(topology.devices[d], unpacked),
                         (d,), d)
            src.append(e)
            dst.append(u)
            done.append(u)
        ends = done
    return _BucketTasks(cols, tuple(members), hosts, src, dst, tuple(ends), len(devs) // max(1, len(members)))


def _bucket_name(key: BucketKey) -> str:
    """A bucket in task labels: its devices, its index past the first and its level past 0."""
    return (f"bucket {_devices_label(key.devices)}" + (f" #{key.index}" if key.index else "")
            + (f" zero{key.zero}" if key.zero else ""))


@functools.lru_cache(maxsize=256)
def _devices_label(devices: tuple[int, ...]) -> str:
    """``format_devices``, once per device set (its buckets share it)."""
    return format_devices(devices)


def _gather_chunks(tg: TaskGraph, topology: Topology, chunks, updates: dict[int, int],
                   mine: Callable[[Sequence[int]], Sequence[int]]) -> None:
    """After the members' updates, each level-1 bucket's and then each level-2 shard's updated
    chunks (``chunks``: devices, chunk bytes, label) all-gathered (``strategies.zero``, in
    that order, as ``LocalWeights.gather_chunks``) and copied back into the weights
    (``_copy_time``); ``mine``: a group's members simulated."""
    for devs, chunk, what in chunks:
        members = mine(devs)
        if not members:  # a member fold's member m >= 2: member 1's image
            continue
        label = f"allgather weights {what}"
        ag = tg.add(label, TaskKind.ALLREDUCE, allgather_time(topology, devs, chunk),
                    ring_resources(topology, devs), devs[0], chunk * len(devs))
        for d in members:
            tg.edge(updates[d], ag)
        for d, e in zip(members, _synced_ends(tg, topology, ag, devs, label, TaskKind.ALLREDUCE,
                                              [(d, updates[d]) for d in members], members)):
            unpack = tg.add(f"unpack {label} device {d}", TaskKind.ALLREDUCE,
                            copy_time(topology.devices[d], chunk * len(devs)), (d,), d)
            tg.edge(e, unpack)


def _synced_ends(tg: TaskGraph, topology: Topology, collective: int, devices: Sequence[int],
                 label: str, category: int, arrivals: Sequence[tuple[int, int]],
                 simulated: Sequence[int] | None = None) -> list[int]:
    """``member_ends`` of a step-end collective (for its ``simulated`` members, default all),
    recorded in ``tg.syncs`` with its members' overhead tasks and what it waits on, as (device,
    task) pairs, and the members each stands for (``simulator.stragglers`` scales the overheads
    by the members arriving together)."""
    simulated = devices if simulated is None else simulated
    ends = member_ends(tg.add, tg.edge, topology, collective, devices, label, category, simulated)
    hosts = tuple((d, e) for d, e in zip(simulated, ends) if e != collective)
    if hosts:
        tg.syncs.append((collective, hosts, tuple(arrivals), len(devices) // len(simulated)))
    return ends


_LOSS_BYTES = 8
"""The step's loss value the executor all-reduces when not every device knows it: one float64."""


def copy_time(spec: DeviceSpec, nbytes: int, traffic: float = COPY_TRAFFIC) -> float:
    """Seconds to copy ``nbytes`` on the device, ``traffic * nbytes / memory_bandwidth``
    (``traffic`` bytes moved per byte; ``COPY_TRAFFIC``, read + write): a bucket's gradients
    packed into one flat tensor before its all-reduce and the sums copied back after it, as
    ``shards.LocalWeights.sync_grads`` (and DDP's buckets) do; FSDP2's copies (``zero3``)."""
    return traffic * nbytes / spec.memory_bandwidth


def _update_time(spec: DeviceSpec, traffic: float, nbytes: int, tensors: int) -> float:
    """Seconds of one device's optimizer update: memory-bound traffic plus host work per local
    trainable tensor, ``traffic * nbytes / memory_bandwidth + tensors * task_overhead`` (torch's
    optimizers on CPU step each tensor in turn: their ``foreach`` default is for CUDA-like
    devices only; the executor holds one tensor per weight it reads, ``shards.LocalWeights``)."""
    return traffic * nbytes / spec.memory_bandwidth + tensors * spec.task_overhead
