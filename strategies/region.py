"""Boxes: a region of a tensor as one half-open [start, stop) range per dim."""

from __future__ import annotations

import itertools
import math
from typing import Sequence

__all__ = [
    "Box", "full_box", "box_shape", "box_numel", "intersect", "partition_box", "partition_boxes",
    "partition_index", "slice_box", "shift_box", "index_in",
]

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple([b - a for a, b in box])  # a list first: no generator frame (a hot path of the cost memo)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of one tensor, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def partition_index(k: int, degrees: Sequence[int]) -> tuple[int, ...]:
    """Grid coordinates of partition ``k``: mixed radix over ``degrees``, last dim fastest."""
    coords = []
    for d in reversed(degrees):
        coords.append(k % d)
        k //= d
    return tuple(reversed(coords))


def partition_box(shape: Sequence[int], degrees: Sequence[int], k: int) -> Box:
    """The region partition ``k`` of an even ``degrees`` grid over ``shape`` covers."""
    coords = partition_index(k, degrees)
    return tuple((c * (s // d), (c + 1) * (s // d)) for s, d, c in zip(shape, degrees, coords))


def partition_boxes(shape: Sequence[int], degrees: Sequence[int]) -> list[Box]:
    """All partitions' regions in partition order (``partition_box`` for k = 0..prod-1)."""
    ranges = [[(c * (s // d), (c + 1) * (s // d)) for c in range(d)] for s, d in zip(shape, degrees)]
    return [tuple(b) for b in itertools.product(*ranges)]


def slice_box(box: Box) -> tuple[slice, ...]:
    """The index that cuts ``box`` out of a tensor: ``t[slice_box(box)]``."""
    return tuple(slice(a, b) for a, b in box)


def shift_box(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a tensor that holds only ``origin`` (box within origin)."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def index_in(box: Box, origin: Box) -> tuple[slice, ...] | None:
    """The index that cuts ``box`` out of a tensor holding only ``origin``; None when it is all
    of it (the tensor itself, no view)."""
    return None if box == origin else slice_box(shift_box(box, origin))
