"""``alike_readers``: the devices that read level-2 and level-3 weights, grouped by run orders
that read them alike, so a walk over a run order's gathers runs once per class, not per device.

The simulator's gather tasks (``simulator.zero3``: issue positions, a unit's calls) and the
memory model's prefetched bytes (``strategies.prefetch.gathered_bytes``) are functions of a
device's run order (``strategies.schedule.device_order``) through each step's op, pass,
micro-batch and the ``gather_groups`` it reads there, never through the partition index or the
device itself. Two devices whose orders agree on those read the same groups at the same
positions: the replicas of a data-parallel ZeRO plan (16 alike orders on 16 devices) are one
class, its walks made once."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

from strategies.lowering import Lowered
from strategies.memo import per_lowered
from strategies.schedule import Step, device_order
from strategies.zero import gather_groups

__all__ = ["AlikeReaders", "alike_readers"]

_op, _index = attrgetter("op"), attrgetter("index")
_step_kind = itemgetter(0, 1, 3)
"""A ``Step``'s (backward, op, micro-batch): all of it but the partition index."""


class AlikeReaders(NamedTuple):
    """Devices whose run orders read the same ``gather_groups`` at the same positions."""

    devices: tuple[int, ...]
    """The members, ascending."""
    order: list[Step]
    """The first member's run order (``device_order``; callers must not change it)."""
    reads: tuple[tuple[int, ...], ...]
    """Per position of the order, the indices in ``gather_groups`` of the groups its step reads
    (ascending: the order each member calls them), () where it reads none."""


@per_lowered
def alike_readers(lowered: Lowered) -> tuple[AlikeReaders, ...]:
    """The classes of the devices reading some level-2 or level-3 group, in order of their
    first member: devices with equal (op, pass, micro-batch, groups read) at every position of
    their run orders."""
    reads: dict[tuple[int, str, int], tuple[int, ...]] = {}
    for g, u in enumerate(gather_groups(lowered)):
        for d, k in zip(u.devices, u.partitions):
            reads[(d, u.op, k)] = reads.get((d, u.op, k), ()) + (g,)
    if not reads:
        return ()
    holding = {d for d, _, _ in reads}
    get, none = reads.get, ()
    classes: dict[tuple, list] = {}
    for d, order in device_order(lowered).items():
        if d not in holding:
            continue
        each = tuple(map(get, zip(repeat(d), map(_op, order), map(_index, order)), repeat(none)))  # C-level passes
        seen = (each, tuple(map(_step_kind, order)))
        members = classes.get(seen)
        if members is None:
            classes[seen] = [order, d]
        else:
            members.append(d)
    return tuple(AlikeReaders(tuple(members[1:]), members[0], each) for (each, _), members in classes.items())
