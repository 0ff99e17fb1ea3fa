"""The lowering of copy 0 (``strategies.lowering.lower(copies=)``): what it keeps of a replicated
plan and how it makes the records that span copies whole.

A plan replicated over R copies of G devices (``strategies.symmetry``) computes on copy r the
φ_r-image of copy 0's work, so the lowering of copy 0 holds:

- the partitions of copy 0's devices (every non-weight op's; a weight op, in no copy, keeps
  all of its), the transfers and collectives into them, their weight reads: G devices' worth
  (``kept_indices``), a transfer from another copy refused (``CrossCopy``);
- every reduction group holding a partition of copy 0, with its whole member list
  (``reduction_members``: a loss's sum over all R·G devices is one record, as per device);
- every weight shard with its whole holder list: the devices reading it on copy 0 and their
  images φ_r (``expand_holders``; a partition's weight region does not depend on its sample
  coordinate), so the gradient buckets, each all-reduced over every replica, are as per device;
- per-device totals (``DeviceBytes``, ``GradientSync.tensors``) of every device: copy r's
  device the image of its copy-0 device (``expand_totals``).

``Lowered.copies`` names the copies; what needs every device's partitions (the executor, the
per-device simulation, a timeline, export) refuses such a lowering (``Lowered.check_whole``).
"""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import numpy as np

from strategies.config import ParallelConfig
from strategies.members import members
from strategies.region import Box, partition_index
from strategies.symmetry import Copies

__all__ = ["kept_indices", "reduction_members", "expand_holders", "expand_totals"]


@functools.lru_cache(maxsize=4096)
def kept_indices(config: ParallelConfig, keep: frozenset[int]) -> tuple[int, ...]:
    """The partition indices of ``config`` whose device is in ``keep``, ascending."""
    return tuple(k for k, d in enumerate(config.devices) if d in keep)


@functools.lru_cache(maxsize=4096)
def reduction_members(degrees: tuple[int, ...], over: Sequence[int],
                      kept_at: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """The partitions summed together by a reduction over dims ``over`` (partitions equal in
    every other coordinate), each group ascending, groups in the order of their first member;
    ``kept_at`` (None: every partition): only the groups holding one of these, whole."""
    over = frozenset(over)
    if kept_at is None:
        groups: dict[tuple, list[int]] = {}
        for k in range(int(np.prod(degrees))):
            c = partition_index(k, degrees)
            groups.setdefault(tuple(x for i, x in enumerate(c) if i not in over), []).append(k)
        return tuple(map(tuple, groups.values()))
    seen: dict[tuple, tuple[int, ...]] = {}
    ranges = [range(d) if i in over else None for i, d in enumerate(degrees)]
    for k in kept_at:
        c = partition_index(k, degrees)
        key = tuple(x for i, x in enumerate(c) if i not in over)
        if key in seen:
            continue
        members = []
        for combo in itertools.product(*[r if r is not None else (x,) for r, x in zip(ranges, c)]):
            m = 0
            for x, d in zip(combo, degrees):
                m = m * d + x
            members.append(m)
        seen[key] = tuple(sorted(members))
    return tuple(sorted(seen.values()))


def expand_holders(held: dict[Box, set[int]], copies: Copies) -> dict[Box, tuple[int, ...]]:
    """Each weight region's holders on copy 0 with their images in every copy, sorted
    (``strategies.members``: one object per holder set, kept on ``copies``)."""
    images, known = copies.images, copies.image_sets
    out = {}
    for box, devs in held.items():
        key = frozenset(devs)
        got = known.get(key)
        if got is None:
            got = known[key] = members({x for d in devs for x in images.get(d, (d,))})
        out[box] = got
    return out


def expand_totals(totals: Sequence[Sequence[int]], copies: Copies) -> list[tuple[int, ...]]:
    """Every device's (kept, received, received_grad) from copy 0's (``totals``): a device of
    copy r gets its copy-0 image's (a weight op keeps no activations, ``strategies.pieces``, so
    the ops that run outside the copies add nothing)."""
    t = np.asarray(totals, dtype=np.int64)
    rep = copies.rep_array(t.shape[1])
    return [tuple(row) for row in t[:, rep].tolist()]
