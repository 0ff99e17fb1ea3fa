"""``alike_readers``: the devices that read level-2 and level-3 weights, grouped by run orders
that read them alike, so a walk over a run order's gathers runs once per class, not per device.

The simulator's gather tasks (``simulator.zero3``: issue positions, a unit's calls) and the
memory model's prefetched bytes (``strategies.prefetch.gathered_bytes``) are functions of a
device's run order (``strategies.schedule.device_order``) through each step's op, pass,
micro-batch and the ``gather_groups`` it reads there, never through the partition index or the
device itself. Two devices whose orders agree on those read the same groups at the same
positions: the replicas of a data-parallel ZeRO plan (16 alike orders on 16 devices) are one
class, its walks made once.

Each class walks its *reading order*: the steps of its run order that read some group, in run
order. The steps reading nothing are left out, as every walk over the order passes them
unchanged: ``strategies.prefetch.issue_positions`` gives such a step its own position and lets
it end a unit only where its unit differs, and a repeated block's instance is a run of
consecutive ops in graph order (``strategies.repeats``), so no step of another unit falls
between two reading steps of one instance's pass. A run order is its passes
(``schedule.device_passes``) over one sequence of steps per chunk, the device's partitions in
graph order (forwards; a backward reversed); a reading order is the same passes over the
reading steps of those sequences, so a device's is found from its reader ops' partitions
(a few per level-2/3 op) without building its run order."""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np

from strategies.lowering import Lowered
from strategies.memo import per_lowered
from strategies.schedule import Step, chunk_of, device_passes
from strategies.zero import gather_groups

__all__ = ["AlikeReaders", "alike_readers", "step_sums"]

_step = tuple.__new__


class AlikeReaders(NamedTuple):
    """Devices whose run orders read the same ``gather_groups`` at the same reading positions."""

    devices: tuple[int, ...]
    """The members, ascending."""
    order: list[Step]
    """The first member's reading order: the steps of its run order (``device_order``) that
    read some group, in run order (callers must not change it)."""
    reads: tuple[tuple[int, ...], ...]
    """Per position of ``order``, the indices in ``gather_groups`` of the groups its step reads
    (ascending: the order each member calls them)."""
    indices: tuple[Sequence[int], ...]
    """Per member (``devices`` order), the index of its partition at each position of
    ``order``: its own step there is ``order``'s with that index."""


@per_lowered
def alike_readers(lowered: Lowered) -> tuple[AlikeReaders, ...]:
    """The classes of the devices reading some level-2 or level-3 group, in order of their
    first member: devices with equal (op, pass, micro-batch, groups read) at every position of
    their reading orders (module docstring). Kept by what decides them (``_decided``: the
    lowerings of a search's plans that differ in ops reading no level-2/3 weight, or that come
    back to a plan's readers, share one answer; callers must not change it)."""
    groups = gather_groups(lowered)
    if not groups:
        return ()
    chunk, passes = chunk_of(lowered), device_passes(lowered)
    key = _decided(lowered, groups, chunk, passes)
    got = _KEPT.pop(key, None)
    if got is None:
        got = _classes(lowered, groups, chunk, passes)
        if len(_KEPT) >= KEPT:
            del _KEPT[next(iter(_KEPT))]
    _KEPT[key] = got  # the most recently used last
    return got


def step_sums(c: AlikeReaders, *values: np.ndarray) -> list[np.ndarray]:
    """Per position of ``c.order``, the sum of each of ``values`` (int64, an entry per group of
    ``gather_groups``) over the groups its step reads: an array per ``values``."""
    sizes = np.fromiter(map(len, c.reads), np.int64, len(c.reads))
    ends = np.cumsum(sizes)
    flat = np.fromiter(itertools.chain.from_iterable(c.reads), np.int64, int(ends[-1]) if len(ends) else 0)
    out = []
    for v in values:
        sums = np.concatenate(([0], np.cumsum(v[flat])))
        out.append(sums[ends] - sums[ends - sizes])
    return out


KEPT = 64
"""Answers ``alike_readers`` keeps by ``_decided`` (the least recently used going first)."""

_KEPT: dict[tuple, tuple[AlikeReaders, ...]] = {}


def _decided(lowered: Lowered, groups: tuple, chunk, passes: dict) -> tuple:
    """What ``_classes`` reads of a lowering: each group's reader op, partition indices and
    members (in ``gather_groups`` order: the group indices), each reader op's chunk, the order
    of the partition indices of the reader ops of several groups (``_op_reads``' rank), and
    every device's passes."""
    parts = lowered.partitions
    ops = tuple((g.op, g.partitions, g.shards[0].devices) for g in groups)
    several = tuple((a[0], tuple(p.index for p in parts[a[0]][0]))
                    for a, b in zip(ops, ops[1:]) if a[0] == b[0])
    return (ops, several, None if chunk is None else tuple(chunk[op] for op, _, _ in ops),
            tuple((d, tuple(p)) for d, p in passes.items()))


def _classes(lowered: Lowered, groups: tuple, chunk, passes: dict) -> tuple[AlikeReaders, ...]:
    """``alike_readers``' answer, found from the groups."""
    seqs: dict[int, dict[int, tuple[list, list]]] = {}  # device -> chunk -> its reading steps'
    i = 0                                                # (op, groups read), their partition indices
    while i < len(groups):  # one reader op's groups at a time (graph order; they are consecutive)
        op, j = groups[i].op, i + 1
        while j < len(groups) and groups[j].op == op:
            j += 1
        c = chunk[op] if chunk else 0
        for d, reads, ks in _op_reads(lowered, groups, i, j):
            s = seqs.setdefault(d, {}).setdefault(c, ([], []))
            s[0].extend(reads)
            s[1].extend(ks)
        i = j
    classes: dict[tuple, list[int]] = {}
    for d in sorted(seqs):
        key = (tuple(passes[d]), tuple((c, tuple(s[0])) for c, s in sorted(seqs[d].items())))
        classes.setdefault(key, []).append(d)
    out = []
    for (runs, _), members in classes.items():
        first = seqs[members[0]]
        order: list[Step] = []
        each: list[tuple[int, ...]] = []
        for backward, j, c in runs:
            reads, ks = first.get(c, ((), ()))
            steps = zip(reads, ks)
            for (op, gs), k in (reversed(list(steps)) if backward else steps):
                order.append(_step(Step, (backward, op, k, j)))
                each.append(gs)
        out.append(AlikeReaders(tuple(members), order, tuple(each), tuple(_indices(seqs[d], runs) for d in members)))
    return tuple(out)


def _op_reads(lowered: Lowered, groups: tuple, i: int, j: int) -> list:
    """(device, its reading steps of the op of ``groups[i:j]`` as (op, groups read), their
    partition indices) per member, in the order it runs its partitions of the op."""
    u = groups[i]
    if j == i + 1:  # one group: each member reads it through one partition
        reads = ((u.op, (i,)),)
        return [(d, reads, (k,)) for d, k in zip(u.devices, u.partitions)]
    on: dict[int, dict[int, tuple[int, ...]]] = {}
    for g in range(i, j):
        for d, k in zip(groups[g].devices, groups[g].partitions):
            ks = on.setdefault(d, {})
            ks[k] = ks.get(k, ()) + (g,)
    rank = {p.index: r for r, p in enumerate(lowered.partitions[u.op][0])}  # a device runs them in list order
    out = []
    for d, ks in on.items():
        mine = sorted(ks, key=rank.__getitem__)
        out.append((d, tuple((u.op, ks[k]) for k in mine), mine))
    return out


def _indices(seqs: dict[int, tuple[list, list]], runs: tuple) -> list[int]:
    """A member's partition index at each position of its reading order (``seqs``: its reading
    steps per chunk, with their partition indices; ``runs``: its passes)."""
    out: list[int] = []
    for backward, _, c in runs:
        seq = seqs.get(c)
        if seq and seq[1]:
            out += seq[1][::-1] if backward else seq[1]
    return out
