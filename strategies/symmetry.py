"""Replica folding: the devices of a plan that run identical work, found from the Strategy.

A plan is R-fold replicated when its devices split into R copies C_0..C_{R-1} of G devices
with bijections φ_r: C_0 -> C_r such that every op's partitions on C_r are the φ_r-images of
those on C_0: cut the op's sample dim (degree s) into R equal runs of s / R coordinates; the
partition at sample coordinate c + r·s/R (other coordinates equal) runs on φ_r of the device of
the one at c. Data parallel (G = 1), Megatron-LM (G = T·P: each data-parallel copy of the
tensor x pipeline grid), FSDP and ZeRO (the level changes only the weight-synchronising
collectives, whose groups are unions of φ-orbits) are of this kind. Copies then compute the
same shapes on their own devices and meet only in collectives over unions of φ-orbits (the
gradient sync, sharded weights' gathers, batch statistics, the loss sums), so one copy's
timeline is every copy's (Calculon and vTrain simulate one representative of identical
workers the same way). ``strategies.lowering.lower(copies=)`` lowers C_0 only and
``simulator.fold`` builds the task graph of C_0 only from this.

Weight ops (``parameter``, ``constant``: a tensor read in place, no work) may run anywhere;
every other op must have a sample dim cut a multiple of R ways, else the plan is 1-fold.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from strategies.config import ParallelConfig
from strategies.graph import OpGraph
from strategies.lowered import WEIGHT_KINDS
from strategies.strategy import Strategy

__all__ = ["Copies", "CrossCopy", "copies_of", "find_copies"]


class CrossCopy(Exception):
    """A plan's pieces break its copies' symmetry (a transfer between two copies): the plan is
    lowered and simulated per device instead (``simulator.fold.FoldError`` is one). ``op``:
    the op whose pieces refused, where one did (its pieces are a function of its config, its
    producers' and the copy set: ``strategies.member_memo`` remembers such a refusal)."""

    def __init__(self, message: str, op: str | None = None):
        super().__init__(message)
        self.op = op


@dataclass(frozen=True)
class Copies:
    """R copies of G devices: ``copies[r][i]`` is φ_r(``copies[0][i]``); copy r runs the
    r-th run of every op's sample coordinates."""

    copies: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        """R, the number of copies."""
        return len(self.copies)

    @property
    def size(self) -> int:
        """G, the devices of one copy."""
        return len(self.copies[0])

    @cached_property
    def kept(self) -> frozenset[int]:
        """C_0's devices: the ones a folded simulation runs."""
        return frozenset(self.copies[0])

    @cached_property
    def representative(self) -> dict[int, int]:
        """Device -> its image in C_0 (φ_r⁻¹ of a device of C_r)."""
        return {d: self.copies[0][i] for copy in self.copies for i, d in enumerate(copy)}

    @cached_property
    def images(self) -> dict[int, tuple[int, ...]]:
        """C_0's device -> (φ_0(d) = d, φ_1(d), ..., φ_{R-1}(d))."""
        return {d: tuple(copy[i] for copy in self.copies) for i, d in enumerate(self.copies[0])}

    @property
    def stands_for(self) -> dict[int, tuple[int, ...]]:
        """Each simulated device -> the devices whose work its partitions stand for (here
        ``images``; a member fold's: its member images' too, ``strategies.lowering_members``)."""
        return self.images

    @cached_property
    def image_sets(self) -> dict[frozenset[int], tuple[int, ...]]:
        """Sets of C_0's devices -> their images in every copy, sorted (``strategies
        .lowering_copies.expand_holders``), filled as they are asked for."""
        return {}

    def rep_array(self, n: int) -> np.ndarray:
        """Device -> its C_0 image as an array over ``n`` devices (a device in no copy: itself)."""
        return _rep_array(self, n)

    def __str__(self) -> str:
        return f"{self.count} copies of {self.size} device(s)"

    def __hash__(self) -> int:  # a key of the lowering cache's entries: hashed once, not per device per lookup
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(self.copies)


@functools.lru_cache(maxsize=32)
def _rep_array(copies: Copies, n: int) -> np.ndarray:
    out = np.arange(n, dtype=np.int64)
    for copy in copies.copies[1:]:
        out[list(copy)] = copies.copies[0]
    out.flags.writeable = False
    return out


def find_copies(graph: OpGraph, strategy: Strategy) -> Copies | None:
    """The most copies ``strategy`` is replicated over (module docstring), None where it is
    1-fold. The candidates are the divisors of the gcd of the non-weight ops' sample degrees,
    tried from the largest; each op's partitions are checked against the maps built so far
    (each config's own images kept: a search's proposals share every unchanged config)."""
    degrees = []
    for node in graph:
        if node.kind in WEIGHT_KINDS:
            continue
        i = node.sample_dim
        if i is None:
            return None
        degrees.append(strategy[node.name].degrees[i])
    g = math.gcd(*degrees) if degrees else 1
    for r in sorted((d for d in range(2, g + 1) if g % d == 0), reverse=True):
        found = copies_of(graph, strategy, r)
        if found is not None:
            return found
    return None


def copies_of(graph: OpGraph, strategy: Strategy, count: int) -> Copies | None:
    """The ``count`` copies of ``strategy`` (φ checked on every non-weight op), or None: copy
    k of ``count`` is the union of copies k·c .. k·c + c - 1 of ``count`` · c."""
    images: dict[int, tuple[int, ...]] = {}  # copy-0 device d -> (φ_0(d) = d, φ_1(d), ...)
    checked: dict[int, tuple] = {}  # id -> the image lists checked (one object per config and sample dim; held: ids stay unique)
    for node in graph:
        if node.kind in WEIGHT_KINDS:
            continue
        config, i = strategy[node.name], node.sample_dim
        if i is None or config.degrees[i] % count:
            return None
        got = _op_images(config, i, count)
        if id(got) in checked:  # another op cut alike: its images are checked
            continue
        checked[id(got)] = got
        for d, mine in got:
            if images.setdefault(d, mine) != mine:
                return None
    if not images:
        return None
    every = [d for mine in images.values() for d in mine]
    if len(set(every)) != len(every):  # the copies are disjoint
        return None
    first = sorted(images)
    return Copies(tuple(tuple(images[d][r] for d in first) for r in range(count)))


@functools.lru_cache(maxsize=4096)  # a config's devices: up to thousands of ints per entry
def _op_images(config: ParallelConfig, sample: int, count: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Each copy-0 device of an op cut by ``config`` with its images in the ``count`` copies:
    the devices of the partitions at sample coordinate c + r·s/count (others alike), r = 0.."""
    grid = np.asarray(config.devices, dtype=np.int64).reshape(config.degrees)
    grid = np.moveaxis(grid, sample, 0).reshape(count, -1)  # row r: copy r's partitions, in copy 0's order
    return tuple(zip(grid[0].tolist(), map(tuple, grid.T.tolist())))
