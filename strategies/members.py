"""Long device tuples that hash once.

A replicated plan's configs, weight shards, gradient buckets and their rings name the same
device set of thousands of devices in many dictionary keys (``ParallelConfig`` in the lowering's
caches, ``BucketKey``, the simulator's per-bucket maps); a tuple rehashes every element on each
lookup. ``Hashed`` equals the plain tuple and hashes to the same value, computed on first use
and kept (ints only: the same value in every process); ``Members`` is a sorted one.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

__all__ = ["Hashed", "Members", "hashed", "kept_members", "members"]

LONG = 64
"""Tuples from this length are kept as ``Hashed`` by ``hashed`` and ``members``; shorter ones
hash faster than a Python-level ``__hash__`` call."""


class Hashed(tuple):
    """A tuple of devices whose hash is computed once."""

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = h = tuple.__hash__(self)
            return h


class Members(Hashed):
    """A sorted ``Hashed``."""

    def array(self) -> np.ndarray:
        """The devices as an int64 array, made once (read-only)."""
        try:
            return self._array
        except AttributeError:
            self._array = a = np.array(self, dtype=np.int64)
            a.flags.writeable = False
            return a


def hashed(devices) -> tuple[int, ...]:
    """``devices`` as a tuple, ``Hashed`` where they are many."""
    if isinstance(devices, Hashed):
        return devices
    got = tuple(devices)
    return Hashed(got) if len(got) >= LONG else got


def members(devices) -> tuple[int, ...]:
    """``devices`` sorted, as ``Members`` where they are many, else a plain tuple; ``Members``
    given are returned as they are."""
    if isinstance(devices, Members):
        return devices
    got = tuple(sorted(devices))
    return Members(got) if len(got) >= LONG else got


def kept_members(devices: tuple[int, ...], keep) -> list[int]:
    """The members of ``devices`` in ``keep`` (a set: a folded plan's copy 0), in ``devices``'
    order; ``Members`` (sorted) with few kept are searched by bisection, not walked."""
    if isinstance(devices, Members) and len(keep) * 16 < len(devices):
        at = [(bisect_left(devices, d), d) for d in keep]
        return sorted(d for i, d in at if i < len(devices) and devices[i] == d)
    return [d for d in devices if d in keep]
