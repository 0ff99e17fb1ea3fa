"""Another op's partitions and transfers renamed and moved, made when first read
(``strategies.lowering_shared.renamed``). GPT-3 175B's plan of 96 layers and 128 micro-batches
shares ~2,100 ops' pieces: made at once, their renamed records are 1.3 M tuples, of which a
simulation reads one micro-batch's partitions of some ops (``strategies.schedule``,
``strategies.overlap``) and no transfers (the task graph copies a twin's block instead:
``simulator.twins``).

Each object reads as the tuple it stands for: equal to it, hashed, indexed, sliced, iterated
and pickled as it, its length known without making it. ``MovedPartitions`` makes one
micro-batch's row at a time; ``RenamedTransfers`` all of them at the first read. Renaming one
again renames its source's records once (the names mapped twice, the moves added)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from strategies.lowered import Partition, Transfer

__all__ = ["MovedPartitions", "RenamedTransfers", "moved_partitions", "renamed_transfers", "records"]

_new = tuple.__new__


class _AsTuple(Sequence):
    """A sequence that compares, hashes and pickles as ``tuple(self)``."""

    __slots__ = ()

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (tuple, _AsTuple)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce__(self):
        return tuple, (tuple(self),)

    def __repr__(self) -> str:
        return repr(tuple(self))


class MovedPartitions(_AsTuple):
    """Micro-batch -> ``root``'s partitions of it as op ``op``'s, every device ``delta`` on."""

    __slots__ = ("root", "op", "delta", "_rows")

    def __init__(self, root: tuple[tuple[Partition, ...], ...], op: str, delta: int) -> None:
        self.root, self.op, self.delta = root, op, delta
        self._rows: list = [None] * len(root)

    def __len__(self) -> int:
        return len(self.root)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return tuple(self[i] for i in range(*j.indices(len(self.root))))
        row = self._rows[j]
        if row is None:  # the hot loop: records made as the tuples they are
            op, delta = self.op, self.delta
            row = self._rows[j] = tuple([_new(Partition, (op, k, mb, d + delta, box, ins, ws, out))
                                         for _, k, mb, d, box, ins, ws, out in self.root[j]])
        return row

    def __iter__(self):
        return map(self.__getitem__, range(len(self.root)))


class RenamedTransfers(_AsTuple):
    """``root``'s transfers into op ``op``, each source op's name mapped by ``to`` and every
    device ``delta`` on."""

    __slots__ = ("root", "to", "op", "delta", "_made")

    def __init__(self, root: tuple[Transfer, ...], to: dict[str, str], op: str, delta: int) -> None:
        self.root, self.to, self.op, self.delta = root, to, op, delta
        self._made: tuple[Transfer, ...] | None = None

    def _all(self) -> tuple[Transfer, ...]:
        if self._made is None:
            at, op, delta = self.to.__getitem__, self.op, self.delta
            self._made = tuple([_new(Transfer, (at(src), k, op, q, slot, j, s + delta, d + delta, region, size, partial))
                                for src, k, _, q, slot, j, s, d, region, size, partial in self.root])
        return self._made

    def __len__(self) -> int:
        return len(self.root)

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())


def moved_partitions(rows: Sequence, op: str, delta: int) -> MovedPartitions:
    """``rows`` (an op's partitions by micro-batch) as ``op``'s, every device ``delta`` on."""
    if type(rows) is MovedPartitions:
        return MovedPartitions(rows.root, op, rows.delta + delta)
    return MovedPartitions(tuple(rows), op, delta)


def renamed_transfers(rows: Sequence, to: dict[str, str], op: str, delta: int) -> RenamedTransfers:
    """``rows`` (an op's transfers) into ``op``, source names mapped by ``to``, every device
    ``delta`` on."""
    if type(rows) is RenamedTransfers:
        return RenamedTransfers(rows.root, {a: to[b] for a, b in rows.to.items()}, op, rows.delta + delta)
    return RenamedTransfers(tuple(rows), to, op, delta)


def records(partitions: Sequence) -> int:
    """The partitions an op's rows stand for, over every micro-batch (made or not)."""
    rows = partitions.root if type(partitions) is MovedPartitions else partitions
    return sum(map(len, rows))
