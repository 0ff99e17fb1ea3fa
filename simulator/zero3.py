"""The per-use tasks of level-2 and level-3 sharded weights (``ParallelConfig.zero``;
``strategies.zero.gather_groups``), as the executor runs them: for each use of a group (the
shards a reader op's partition reads on one device set, FSDP2's ``FSDPParamGroup``) and each
micro-batch, after the partition's backward one ring reduce-scatter of the group's gradients
into its chunks' (``simulator.comm``; bytes: n times a member's chunk of the group, the sum of
its chunks of the shards), which only the step end's optimizer update waits on; at level 3
(FSDP2's ``fully_shard``) also one ring all-gather of the group's chunks called at the start
of the partition's forward step, which its forward waits on, and another at the start of its
backward step, which its backward waits on (a reader op with recompute: two there, the first
for the recomputation, which the executor runs with the weights gathered at the step where it
recomputes the op, its own backward step or the one of the last op of its dropped chain,
"Recompute"; under ``fsdp_unit`` "block" one, where that step is in the op's own backward
unit: ``strategies.prefetch.recomputed_in_unit``, as FSDP2 gathers a checkpointed layer once).
Each all-gather is issued ahead, as FSDP2 prefetches (``strategies.prefetch``): a member's call
starts at the start of the previous unit in its run order that all-gathers (a step, or a
repeated block's instance under ``fsdp_unit`` "block", whose groups on one device set are one
all-gather task, ``strategies.prefetch.calls_at``), and only the reader's step waits on it, so
the gather runs beside the steps in between.
A call is an arrival of the all-gather's task at the member's issuing step, as a lowering
collective's (``simulator.collectives``: edges into it, no task of its own). Delta simulation: each group's tasks are recorded once with
their micro-batch and reader block's ids left open (``_Chunk``) and laid out for every
micro-batch of every graph where the group, its phases and its unit's call are the same; the
reader block's ids (``_block_reads``) and the calls' places in the schedules (the issue
positions) are found per graph.
Under a cost model with ``fsdp_copies`` (``CostModel.fsdp_copies``: FSDP2's copies on the
compute stream, PyTorch's ``_fsdp_collectives.py`` as torchtitan's published runs ran it) each
member also pays, on its device, the all-gather's copy-out after each gather (the bytes of the
groups it gathers, read and written, ``COPY_TRAFFIC``), which the reader waits on, and before each
reduce-scatter its copy-in (``fsdp_copy_in_traffic``): the gradients read in the compute dtype,
written in the reduce dtype, then divided in place by the pre-divide factor."""

from __future__ import annotations

import itertools
import weakref
from itertools import repeat
from operator import add, getitem, itemgetter
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from simulator.comm import allgather_time, reduce_scatter_time, ring_resources
from simulator.step import copy_time, member_ends
from simulator.taskgraph import INDEX, Columns, Recorded, TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.config import format_devices
from strategies.lowering import Lowered
from strategies.precision import reduce_scale
from strategies.prefetch import call_key, calls_at, issue_positions, recomputed_in_unit, step_units
from strategies.zero import gather_groups
from strategies.zero_alike import alike_readers, step_sums

__all__ = ["FSDP_COPY_LABELS", "add_gathers", "fsdp_copy_in_traffic"]

FSDP_COPY_LABELS = ("copy-out ", "copy-in ")
"""How the labels of FSDP2's copies start (``CostModel.fsdp_copies``): an all-gather's copy-out,
a reduce-scatter's copy-in."""


def fsdp_copy_in_traffic(gradient_bytes: int, wide: int) -> int:
    """Bytes FSDP2's reduce-scatter copy-in moves through memory for ``gradient_bytes`` of a
    group's gradients in the compute dtype reduced at ``wide`` times their bytes
    (``strategies.precision.reduce_scale``): ``torch.cat`` reads them and writes the flat
    input (1 + wide), then ``_div_if_needed(input, predivide_factor)`` reads and writes it (2 ·
    wide; the factor is at least 2 for any group of 2 or more, ``FSDPParamGroup
    ._init_grad_divide_factors``): (1 + 3·wide) times the gradients' bytes."""
    return (1 + 3 * wide) * gradient_bytes


def add_gathers(tg: TaskGraph, lowered: Lowered, topology: Topology, blocks: Sequence, first: np.ndarray,
                position: dict[str, int], keep: frozenset[int] | None = None, memo: Recorded | None = None,
                cost: Any = None) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Add every level-2 and level-3 use's tasks to ``tg`` (``blocks``, ``first``, ``position`` as
    ``simulator.collectives.add_collectives`` takes them). Returns the arrivals' places in the
    devices' schedules as rows (the all-gather's task, the issuing step's first task), one a
    member's call, and per device the
    reduce-scatters' ends its optimizer update waits on. ``keep``: the devices simulated
    (``simulator.fold``: each collective timed over its group, its member tasks on them).
    ``memo`` (a ``TaskCache``'s): each group's tasks are recorded once (``_Chunk``: its
    micro-batch and its reader block's ids left open) and laid out for every micro-batch of
    every graph where the group and its phases are the same (delta simulation, as the op
    blocks); where a level-3 unit gathers several groups in one call (``fsdp_unit`` "block"),
    the first group's chunk makes the call and the others' refer to its member ends
    (``_Chunk.refs``), so those chunks are recorded per micro-batch (a unit's call names its
    micro-batch). ``cost``: the cost model timing the blocks (its ``fsdp_copies``; None: no
    copies)."""
    copies = cost is not None and cost.fsdp_copies
    groups = gather_groups(lowered)
    ends: dict[int, list[int]] = {}
    if not groups:
        return np.empty((2, 0), dtype=INDEX), ends
    m = lowered.strategy.microbatches
    issue = _issue_tasks(lowered, groups, blocks, first, position, keep) if any(u.zero == 3 for u in groups) else None
    of, calls = (_unit_calls(lowered, groups, keep) if issue is not None and issue.column
                 and lowered.strategy.fsdp_unit == "block" else ({}, {}))
    made: dict = {}  # a unit's call -> its simulated members' ends, by device
    chunks = [u.chunk_bytes for u in groups]
    unit_bytes = {key: sum(chunks[x] for x, _, _ in gathers) for key, gathers in calls.items()}  # each unit call's
    if memo is None:
        memo = Recorded()
    memo.bound(_CHUNKS)

    def chunk(g: int, u, members: list, phases: tuple, wide: int, units: tuple) -> _Chunk:
        """Group ``u``'s chunk for ``units`` (``_unit`` of each phase, or () where no unit call is
        made), recorded where ``memo`` has none."""
        key = (u, phases, keep, units, wide, copies)
        got = memo.records.get(key)
        return got if got is not None else memo.record(
            key, _record(topology, u, members, phases, chunks, calls, units, g, wide, copies))

    at = first.tolist()
    uses = []  # what a group's tasks read alike in every micro-batch, found once
    rows = []  # each use's reader-block local ids, a row a micro-batch (``_block_reads``)
    width = 0  # the reader-block ids a micro-batch's chunks read, all uses together
    starts = []  # each use's reader block's first id, once for each id it reads
    for g, u in enumerate(groups):
        if keep is None:
            members, ks = list(zip(u.devices, u.partitions)), u.partitions
        else:
            members = [(d, k) for d, k in zip(u.devices, u.partitions) if d in keep]
            ks = tuple([k for _, k in members])
        if not members:
            continue
        again = ("recompute",) if lowered.strategy[u.op].recompute else ()  # gathered for its recomputation too
        phases = ("fwd", *again, "bwd") if u.zero == 3 else ()
        wide = reduce_scale(lowered.strategy, u.shards[0].dtype)
        c = None if of else chunk(g, u, members, phases, wide, ())  # no unit call: one for every micro-batch
        i = position[u.op]
        uses.append((g, u, members, phases, wide, c, width))
        rows.append(_block_reads(blocks[i], ks, phases, m))
        starts.append((at[i], (len(phases) + 1) * len(members)))
        width += starts[-1][1]
    laid: list = []  # (chunk, its first id, where its reader-block ids start in ``block_ids``, its refs' ids)
    names: list = []  # each laid chunk's task names, each with its micro-batch
    calls_laid: list = []  # (chunk, its first id, its micro-batch) of each laid chunk that calls
    end_parts: list = []  # the chunks with reduce-scatter ends, in order, and their first ids
    end_bases: list = []
    base = len(tg)

    def lay(c: _Chunk, j: int, start: int) -> None:
        nonlocal base
        for unit, done in c.made:
            made[unit] = {d: t + base for d, t in done.items()}
        laid.append((c, base, start, [made[k][d] for k, d in c.refs] if c.refs else None))
        names.append(zip(c.cols.name, repeat(j)))
        if len(c.call_ids):
            calls_laid.append((c, base, j))
        if len(c.end_ids):
            end_parts.append(c)
            end_bases.append(base)
        base += len(c.cols)

    if uses and not of and m >= MERGED_FROM:  # every micro-batch lays the same chunks: laid as one, once a micro-batch
        one = _merged([(c, start) for *_, c, start in uses])
        for j in range(m):
            lay(one, j, j * width)
    else:
        for j in range(m):
            for g, u, members, phases, wide, c, start in uses:
                if of:
                    c = chunk(g, u, members, phases, wide,
                              tuple(_unit(of.get((g, phase, j)), made, unit_bytes) for phase in phases))
                lay(c, j, j * width + start)
    if end_parts:
        ends = _by_device(end_parts, end_bases)
    tail = tg.tail
    tail.name.extend(itertools.chain.from_iterable(names))  # (template, micro-batch): formatted when shown
    for field in _FIELDS:
        getattr(tail, field).extend(itertools.chain.from_iterable(getattr(c.cols, field) for c, *_ in laid))
    if laid:  # one chunk of edges (``TaskGraph.chunks``), not a list of ints
        at_ids = np.repeat(*np.array(starts, dtype=np.int64).T)
        block_ids = (np.hstack(rows) + at_ids).ravel()  # micro-batch after micro-batch
        tg.chunks.append((_placed([(c.src, *rest) for c, *rest in laid], block_ids).astype(INDEX),
                          _placed([(c.dst, *rest) for c, *rest in laid], block_ids).astype(INDEX)))
    if not calls_laid:
        return np.empty((2, 0), dtype=INDEX), ends
    sizes = [len(c.call_ids) for c, _, _ in calls_laid]
    ids = (np.concatenate([c.call_ids for c, _, _ in calls_laid])
           + np.repeat(np.fromiter((b for _, b, _ in calls_laid), np.int64, len(calls_laid)), sizes))
    columns: dict[int, np.ndarray] = {}  # each chunk's calls' columns of ``issue.values``, found once a chunk
    for c, _, _ in calls_laid:
        if id(c) not in columns:
            columns[id(c)] = np.fromiter(map(issue.column.__getitem__, c.call_steps), np.int64, len(c.call_steps))
    js = np.repeat(np.fromiter((j for _, _, j in calls_laid), np.int64, len(calls_laid)), sizes)
    places = issue.values[js, np.concatenate([columns[id(c)] for c, _, _ in calls_laid])]
    if (places < 0).any():  # a step keyed, but not in this call's micro-batch
        raise RuntimeError(f"add_gathers: {int((places < 0).sum())} calls read a step of no issue place")
    return np.stack([ids, places]).astype(INDEX), ends


def _block_reads(block, ks: tuple[int, ...], phases: tuple, m: int) -> np.ndarray:
    """The reader block's local task ids a group's chunk reads (``_Chunk``: ``_BLOCK`` + its
    place in the micro-batch's row), a row a micro-batch: per phase each member's partition's
    forward (the backward's, ``fwd`` + 1, past the forward phase), then each one's
    backward-done step. Kept per block while it lives (a built block's rows never change)."""
    mine = _READS.get(block)
    if mine is None:
        mine = _READS[block] = {}
    got = mine.get((ks, phases, m))
    if got is None:
        plus = [int(phase != "fwd") for phase in phases]
        got = mine[(ks, phases, m)] = np.array(
            [[block.fwd[j][k] + p for p in plus for k in ks] + [block.bwd_done[j][k] for k in ks] for j in range(m)],
            dtype=np.int64).reshape(m, -1)
    return got


_READS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
"""Block -> (member partition indices, phases, micro-batches) -> ``_block_reads``."""


def _merged(parts: list) -> "_Chunk":
    """Chunks of one micro-batch with no unit call, (chunk, where its reader-block ids start
    in the micro-batch's row) each, as one ``_Chunk``: their tasks one after another, each
    one's own ids moved past those before it and its reader-block places past theirs."""
    if len(parts) == 1 and not parts[0][1]:
        return parts[0][0]
    cols = Columns()
    for field in ("name", *_FIELDS):
        setattr(cols, field, list(itertools.chain.from_iterable(getattr(c.cols, field) for c, _ in parts)))
    own = np.cumsum([0] + [len(c.cols) for c, _ in parts[:-1]])

    def moved(field: str) -> np.ndarray:
        ids = np.concatenate([getattr(c, field) for c, _ in parts])
        sizes = [len(getattr(c, field)) for c, _ in parts]
        return ids + np.where(ids < _BLOCK, np.repeat(own, sizes), np.repeat([x for _, x in parts], sizes))

    call_ids = np.concatenate([c.call_ids + x for (c, _), x in zip(parts, own)])
    return _Chunk(cols, moved("src"), moved("dst"), call_ids,
                  list(itertools.chain.from_iterable(c.call_steps for c, _ in parts)),
                  np.concatenate([c.end_devices for c, _ in parts]),
                  np.concatenate([c.end_ids + x for (c, _), x in zip(parts, own)]), [], [])


_BLOCK = 1 << 40
"""Where a recorded ``_Chunk`` numbers the reader block's tasks it reads (``_BLOCK`` + their
place in ``_block_reads``; its own tasks from 0), each made the graph's id when laid out."""
_MADE = 1 << 50
"""Where a ``_Chunk`` numbers the member ends of a unit's call another chunk made (``_MADE`` +
its place in ``_Chunk.refs``)."""
MERGED_FROM = 2
"""Micro-batches from which, where no unit call is made, a graph's chunks are merged
(``_merged``) and laid out once a micro-batch; below it (one micro-batch: merging would copy
every task once more) each chunk is laid out as recorded. Either way the same tasks, edges and
order."""
_CHUNKS = 1 << 14
"""Recorded chunks a ``TaskCache`` keeps (``Recorded.bound``: from them it starts empty)."""
_FIELDS = ("category", "duration", "resources", "device", "nbytes")
"""The columns laid out as recorded (the names with their micro-batch)."""


class _Chunk(NamedTuple):
    """One level-2/3 group's tasks, recorded by ``_use_tasks`` with their micro-batch and their
    reader block's ids left open: names as ``str.format`` templates of the micro-batch; an edge
    end below ``_BLOCK`` a task of its own, from ``_BLOCK`` the reader block's task at that place
    of ``_block_reads``, from ``_MADE`` a ref."""

    cols: Columns
    src: np.ndarray
    dst: np.ndarray
    call_ids: np.ndarray
    """Each member's call, as the all-gather task it arrives at (one entry a member): its
    place is its issuing step's."""
    call_steps: list
    """The step each call reads, (device, backward, op, partition index), in the same order
    (its micro-batch the one laid out)."""
    end_devices: np.ndarray
    """The device of each member's end of the reduce-scatter, what its optimizer update waits
    on (``end_ids``, in the same order)."""
    end_ids: np.ndarray
    """Those ends' tasks."""
    refs: list
    """(unit call, device) of each end of a call made before it that it waits on (``_MADE``)."""
    made: list
    """(unit call, {device: its end}) of each unit's call it makes (``fsdp_unit`` "block")."""


def _unit(key, made: dict, unit_bytes: dict) -> tuple | None:
    """What a group's tasks read of the unit call ``key`` (None: its own all-gather): the key,
    whether a group before made the call, and its bytes (``unit_bytes``: each call's)."""
    return None if key is None else (key, key in made, unit_bytes[key])


def _record(topology: Topology, u, members: list, phases: tuple, chunks: list, calls: dict, units: tuple,
            g: int, wide: int = 1, copies: bool = False) -> _Chunk:
    """``_use_tasks`` of group ``u`` (index ``g``), recorded as a ``_Chunk``."""
    cols = Columns()
    src: list[int] = []
    dst: list[int] = []
    mine: list = []
    ends: dict[int, list[int]] = {}
    refs: list = []
    made: dict = {}
    simulated = [d for d, _ in members]
    for unit in units:
        if unit is not None and unit[1] and unit[0] not in made:  # made before: its ends are refs
            made[unit[0]] = {d: _MADE + len(refs) + r for r, d in enumerate(simulated)}
            refs += [(unit[0], d) for d in simulated]
    before = set(made)
    keys = [None if unit is None else unit[0] for unit in units] if units else [None] * len(phases)
    _use_tasks(cols.add, lambda a, b: (src.append(a), dst.append(b)), topology, u, members, phases, keys,
               chunks, mine, ends, calls, made, g, wide, copies)
    return _Chunk(cols, np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                  np.fromiter((a for a, _ in mine), np.int64, len(mine)), [step for _, step in mine],
                  np.fromiter((d for d, es in ends.items() for _ in es), np.int64),
                  np.fromiter((e for es in ends.values() for e in es), np.int64), refs,
                  [(k, v) for k, v in made.items() if k not in before])


def _by_device(chunks: list, bases: list) -> dict[int, list[int]]:
    """The reduce-scatters' member ends of ``chunks`` (laid out from ``bases``) per device, each
    device's in the order laid out (one stable sort, not an append an end)."""
    devices = np.concatenate([c.end_devices for c in chunks])
    ids = (np.concatenate([c.end_ids for c in chunks])
           + np.repeat(np.asarray(bases, dtype=np.int64), [len(c.end_ids) for c in chunks]))
    order = np.argsort(devices, kind="stable")
    devices, ids = devices[order], ids[order]
    cuts = np.flatnonzero(np.diff(devices)) + 1
    return dict(zip(devices[np.concatenate(([0], cuts))].tolist(), (x.tolist() for x in np.split(ids, cuts))))


def _placed(laid: list, block_ids: np.ndarray) -> np.ndarray:
    """The edge ends of the chunks laid out, (ends, the chunk's first id, where its reader
    block's ids start in ``block_ids``, the ids of its refs) each, joined as the graph's ids: a
    chunk's own tasks from its first id, its reader block's read from ``block_ids``
    (``_block_reads``), a unit call's ends made before from its refs."""
    ids = np.concatenate([x[0] for x in laid])
    sizes = [len(x[0]) for x in laid]
    out = ids + np.repeat(np.fromiter((x[1] for x in laid), np.int64, len(laid)), sizes)
    reads = (ids >= _BLOCK) & (ids < _MADE)
    out[reads] = block_ids[np.repeat(np.fromiter((x[2] for x in laid), np.int64, len(laid)), sizes)[reads]
                           + ids[reads] - _BLOCK]
    refs = ids >= _MADE
    if refs.any():
        resolved = np.concatenate([np.asarray(x[3] or [0], dtype=np.int64) for x in laid])
        starts = np.cumsum([0] + [len(x[3] or [0]) for x in laid[:-1]])
        out[refs] = resolved[np.repeat(starts, sizes)[refs] + ids[refs] - _MADE]
    return out


def _use_tasks(add: Callable[..., int], edge: Callable[[int, int], None], topology: Topology, u,
               members: list, phases: tuple, keys: Sequence, chunks: list, calls_made: list,
               ends: dict[int, list[int]], calls: dict, made: dict, g: int, wide: int = 1,
               copies: bool = False) -> None:
    """Group ``u``'s tasks in one micro-batch through ``add`` and ``edge`` (a recorder's, names
    ``str.format`` templates of the micro-batch, ``_Chunk``): at level 3 one all-gather per phase
    (or, where ``keys`` names the phase's unit call, that call once: ``calls``, ``made``), each
    member's call of it (``calls_made``: (call, (device, backward, op, partition index))), the
    edges into its partitions' steps (``_BLOCK`` + their place in ``_block_reads``); then the
    reduce-scatter after the members' backwards, its member ends into ``ends``, its bytes
    ``wide`` per gradient byte (``strategies.precision.reduce_scale``: 2 for bf16 summed in float32).
    ``copies``: each member's FSDP2 copy-out after each all-gather and copy-in before the
    reduce-scatter, on its device (``CostModel.fsdp_copies``)."""
    devs = u.devices
    names = _escaped("+".join(s.name for s in u.shards))
    op = _escaped(u.op)
    links = ring_resources(topology, devs)
    simulated = [d for d, _ in members]
    chunk = chunks[g]
    n = len(members)
    for p, (phase, key) in enumerate(zip(phases, keys)):
        backward = phase != "fwd"
        done = made.get(key) if key is not None else None
        if done is None:
            if key is None:
                label, nbytes = f"allgather {phase} {names} {op}@mb{{0}} zero{u.zero}", chunk
                gathered = chunk
            else:  # one call for the unit's groups on this device set
                (_, _, (b, c)), _ = key
                label = f"allgather {phase} block{b}.{c} {format_devices(devs)} @mb{{0}} zero3"
                nbytes = sum(chunks[x] for x, _, _ in calls[key])
                # each group once: a recomputed op's backward call may list it for both its phases
                gathered = sum(chunks[x] for x in dict.fromkeys(x for x, _, _ in calls[key]))
            ag = add(label, TaskKind.COLLECTIVE, allgather_time(topology, devs, nbytes), links, devs[0],
                     nbytes * len(devs))
            for d, k in members:  # the member's call: an arrival of ``ag`` at its issue step
                calls_made.append((ag, (d, backward, u.op, k)))  # ``_issue_tasks``' key, less the micro-batch
            done = dict(zip(simulated, member_ends(add, edge, topology, ag, devs, label, TaskKind.COLLECTIVE,
                                                   simulated)))
            if copies:  # split_with_sizes_copy out of the flat buffer, on the compute stream
                for d in simulated:
                    out = add(f"{FSDP_COPY_LABELS[0]}{label} device {d}", TaskKind.COLLECTIVE,
                              copy_time(topology.devices[d], gathered * len(devs)), (d,), d)
                    edge(done[d], out)
                    done[d] = out
            if key is not None:
                made[key] = done
        for x, d in enumerate(simulated):  # the member's partition's forward (phase 0) or backward
            edge(done[d], _BLOCK + p * n + x)
    label = f"reducescatter grad {names} {op}@mb{{0}} zero{u.zero}"
    summed = u.chunk_bytes * wide * len(devs)  # the group's own chunks, in the plan's reduce dtype
    rs = add(label, TaskKind.COLLECTIVE, reduce_scatter_time(topology, devs, summed), links, devs[0], summed)
    done_b = _BLOCK + len(phases) * n  # the members' backward-done steps
    for x, d in enumerate(simulated):
        if copies:  # torch.cat into the flat input in the reduce dtype, then the pre-divide
            into = add(f"{FSDP_COPY_LABELS[1]}{label} device {d}", TaskKind.COLLECTIVE,
                       copy_time(topology.devices[d], fsdp_copy_in_traffic(u.chunk_bytes * len(devs), wide), 1), (d,), d)
            edge(done_b + x, into)
            edge(into, rs)
        else:
            edge(done_b + x, rs)
    for d, e in zip(simulated, member_ends(add, edge, topology, rs, devs, label, TaskKind.COLLECTIVE, simulated)):
        ends.setdefault(d, []).append(e)


def _escaped(text: str) -> str:
    """``text`` as a literal inside a ``str.format`` template."""
    return text.replace("{", "{{").replace("}", "}}")


class _Issues(NamedTuple):
    """``_issue_tasks``' answer: each step reading level-3 weights, (device, backward, op,
    partition index) (a ``Step``'s fields, the micro-batch apart as ``_Chunk.call_steps`` leaves
    it open) -> its column of ``values``, whose row j holds, for micro-batch j, the first task of
    the step at whose start the all-gathers that step reads are issued (-1: no such step)."""

    column: dict[tuple, int]
    values: np.ndarray


def _issue_tasks(lowered: Lowered, groups: Sequence, blocks: Sequence, first: np.ndarray,
                 position: dict[str, int], keep: frozenset[int] | None = None) -> _Issues:
    """Where each step reading level-3 weights has its all-gathers issued (``_Issues``;
    ``strategies.prefetch.issue_positions``), found once per class of devices reading alike on
    their reading orders (``strategies.zero_alike``); each member then reads its own partition
    indices. Where a member's gathering steps are the same (pass, op, partition index) in every
    micro-batch, as in every schedule here, one micro-batch's steps are keyed and the others
    laid out as rows; else step by step."""
    m = lowered.strategy.microbatches
    at = first.tolist()  # each block's first task, as ints
    level3 = np.array([u.zero == 3 for u in groups], dtype=np.int64)
    column: dict[tuple, int] = {}
    parts: list[np.ndarray] = []  # ``values``' columns, a (m, columns) array per member and class
    width = 0  # the columns so far
    for c in alike_readers(lowered):
        mine = [(d, ks) for d, ks in zip(c.devices, c.indices) if keep is None or d in keep]
        if not mine:
            continue
        gathers = step_sums(c, level3)[0] > 0
        units = step_units(lowered, c.order)
        # only a reading step's gathers are issued (a step of no gather is its own position)
        # per reading step that gathers: its position q, pass, op, micro-batch; its issuer's position
        # p, the issuer block's first task + backward, its forwards (op, pass, micro-batch alike on
        # every member; the partition indices each member's own)
        at_q = np.flatnonzero(gathers)
        if not len(at_q):
            continue
        qs = at_q.tolist()
        positions = issue_positions(gathers, units)
        ps = [positions[q] for q in qs]
        readers, issuers = [c.order[q] for q in qs], [c.order[p] for p in ps]
        backwards, ops, js = (list(map(itemgetter(x), readers)) for x in (0, 1, 3))  # Step's fields
        where = [position[i.op] for i in issuers]
        bases = [at[x] + i.backward for x, i in zip(where, issuers)]
        fwds = [blocks[x].fwd[i.microbatch] for x, i in zip(where, issuers)]
        if m > 1:  # the steps micro-batch after micro-batch (run order within each): pass, op (and
            # each member's partition index)
            by_j = np.argsort(np.array(js, dtype=np.int64), kind="stable")
            steps = np.array([(b, position[op]) for b, op in zip(backwards, ops)], dtype=np.int64)[by_j]
            js_sorted = np.array(js, dtype=np.int64)[by_j]
        for d, ks in mine:  # C-level passes over the positions, one member at a time
            places = np.fromiter(map(add, bases, map(getitem, fwds, map(ks.__getitem__, ps))), np.int64, len(ps))
            kq = list(map(ks.__getitem__, qs))
            if m == 1:  # one micro-batch: its steps, in order, are the row
                keys, row = zip(repeat(d), backwards, ops, kq), places[None]
            elif (per := _per_microbatch(np.column_stack([steps, np.asarray(kq)[by_j]]), js_sorted, m)) is not None:
                first_j = by_j[:per].tolist()  # one micro-batch's steps keyed, every micro-batch a row
                keys = zip(repeat(d), *(map(x.__getitem__, first_j) for x in (backwards, ops, kq)))
                row = places[by_j].reshape(m, per)
            else:  # step by step: a column per step, a row per micro-batch
                cols: dict[tuple, int] = {}
                at_col = [cols.setdefault(key, len(cols)) for key in zip(repeat(d), backwards, ops, kq)]
                keys, row = cols, np.full((m, len(cols)), -1, dtype=np.int64)
                row[js, at_col] = places
            column.update(zip(keys, range(width, width + row.shape[1])))
            parts.append(row)
            width += row.shape[1]
    return _Issues(column, np.concatenate(parts, axis=1) if parts else np.empty((m, 0), dtype=np.int64))


def _per_microbatch(steps: np.ndarray, js: np.ndarray, m: int) -> int | None:
    """How many steps each micro-batch has where ``steps`` (a row each: pass, op, partition
    index; micro-batch after micro-batch, ``js`` theirs) are the same in each of the ``m``
    micro-batches, in the same order; None where not."""
    per, odd = divmod(len(steps), m)
    if odd or not (js == np.repeat(np.arange(m), per)).all() or not (steps.reshape(m, per, -1) == steps[:per]).all():
        return None
    return per


def _unit_calls(lowered: Lowered, groups: Sequence, keep: frozenset[int] | None = None) -> tuple[dict, dict]:
    """Under ``fsdp_unit`` "block": each level-3 gather (group's index in ``groups``, phase,
    micro-batch) of a unit's call -> the call's key, and each such key -> its gathers
    (``strategies.prefetch.calls_at``, the rule the executor runs: a unit's groups on one device
    set move in one all-gather; a group recomputed in its own unit, ``recomputed_in_unit``,
    listed once for its recomputation and backward), found once per class of devices reading alike
    (``strategies.zero_alike``: the same calls). ``keep``: the devices simulated; a call with a
    simulated member is found from its order."""
    keys = [call_key(u) if u.zero == 3 else None for u in groups]  # once per group: its items are keyed by it
    of: dict = {}
    calls: dict = {}
    phases_of = {}
    once = recomputed_in_unit(lowered)
    for c in alike_readers(lowered):
        if keep is not None and not any(d in keep for d in c.devices):
            continue
        each = []
        for s, gs in zip(c.order, c.reads):
            us = [g for g in gs if keys[g] is not None]
            if not us:
                each.append(())
                continue
            phases = phases_of.get((s.op, s.backward))
            if phases is None:
                phases = phases_of[(s.op, s.backward)] = ((("recompute", "bwd") if lowered.strategy[s.op].recompute
                                                          else ("bwd",)) if s.backward else ("fwd",))
            each.append(tuple((g, phase, s.microbatch, keys[g]) for g in us for phase in phases))
        for at in calls_at(each, step_units(lowered, c.order), _last):
            for key, items in at:
                if key[0] != "own":
                    gathers = [x[:3] for x in items]  # a recomputation in its own unit: gathered once
                    calls.setdefault(key, [x for x in gathers if x[1] != "recompute" or groups[x[0]].op not in once])
                    of.update(dict.fromkeys(gathers, key))
    return of, calls


def _last(item: tuple):
    """The call key ``_unit_calls`` carries last in each gather."""
    return item[-1]
