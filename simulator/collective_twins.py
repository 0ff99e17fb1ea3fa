"""A later micro-batch's collectives as *twins* of an op's first micro-batch's
(``simulator.collectives.add_collectives``): each takes its twin's run key, so its steps,
buffer life and regather steps are not found again. ``Twins.key`` judges one collective;
``Twins.run`` every later micro-batch's of an op at once (one comparison an op where every
micro-batch holds the same collectives)."""

from __future__ import annotations

import itertools
import operator
from typing import NamedTuple, Sequence

from strategies.collective_buffers import BufferLife
from strategies.lowered import Collective
from strategies.lowering import Lowered
from strategies.renamed_rows import MovedPartitions

__all__ = ["Twins", "READ"]

READ = operator.itemgetter(1, 2, 3, 4)
"""What a ``CollectiveRead`` reads, but the collective: (dst_op, dst_index, slot, device)."""

_SAME = operator.itemgetter(0, 3, 4, 6, 7, 8)
"""What a twin shares with its collective: all but op, micro-batch and region (kind, devices,
holders, dim, bytes, gradient)."""


class _Twin(NamedTuple):
    """A collective of an op's first micro-batch as later micro-batches' twins read it."""

    collective: Collective
    key: tuple
    reads: list[tuple]
    """Its reads' ``READ``."""
    hidden: float | None
    """The seconds its readers hide where a cost model hides some (compared), else None."""


class Twins:
    """Each op's collectives of its first micro-batch (``Lowered.collectives`` lists an op's
    collectives micro-batch after micro-batch) by their place in it, with their run keys; a
    later micro-batch's collective at the same place is their *twin* where it is the same but
    for its micro-batch and region (kind, devices, holders, dim, bytes, gradient), has the same
    reads (reader op, partition, slot, device), and the ops whose partitions its steps read (its
    first reader's, its own, the op it is called again at) lie on the same devices at the same
    indices in every micro-batch: then its key is the twin's (``_steps_key`` counts micro-batches
    from the collective's), so ``add_collectives`` finds it without its steps, buffer life or
    regather steps. Where a cost model hides part of it behind its readers, the seconds hidden
    are compared too. Anything else: found as the first micro-batch's were."""

    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.op: str | None = None
        self.first: list[_Twin | None] = []  # None: no twin at that place
        self.j0 = self.j = self.at = 0
        self.alike: dict[int, bool] = {}
        """id of an op's partitions (a moved op's: its source's, ``MovedPartitions.root``, which
        the ops renamed from one op share) -> on the same devices and indices in every micro-batch
        (the lowering holds the rows while ``add_collectives`` runs: the ids stay theirs)."""

    def key(self, c: Collective, reads: Sequence, hidden) -> tuple | None:
        """``c``'s (read by ``reads``) twin's key, or None (no twin: ``keep`` it where it is in the
        first micro-batch)."""
        if c.op != self.op:
            self.op, self.first, self.j0, self.j, self.at = c.op, [], c.microbatch, c.microbatch, 0
        elif c.microbatch != self.j:
            self.j, self.at = c.microbatch, 0
        at = self.at
        self.at += 1
        if self.j == self.j0 or at >= len(self.first):
            return None
        twin = self.first[at]
        if twin is None:
            return None
        t, seconds = twin.collective, twin.hidden
        if (c[0] != t[0] or c[3] != t[3] or c[4] != t[4] or c[6:] != t[6:]  # all but op, micro-batch, region
                or list(map(READ, reads)) != twin.reads or (seconds is not None and hidden(reads) != seconds)):
            return None
        return twin.key

    def run(self, cs: list[Collective], reads: list[Sequence], times: int) -> list[tuple] | None:
        """The keys of ``cs`` (read by ``reads``), ``times`` later micro-batches' collectives of the
        op ``key`` saw last, one micro-batch after another, where each is its place's twin
        (``key`` of each gives them: compared by C-level maps over all of them, not one by one);
        None where one is not."""
        first = self.first
        if not first or any(t is None or t.hidden is not None for t in first) or len(cs) != len(first) * times:
            return None
        flat = [r for t in first for r in t.reads]
        if (list(map(_SAME, cs)) != list(map(_SAME, (t.collective for t in first))) * times
                or list(map(len, reads)) != [len(t.reads) for t in first] * times
                or list(map(READ, itertools.chain.from_iterable(reads))) != flat * times):
            return None
        return [t.key for t in first] * times

    def keep(self, c: Collective, reads: Sequence, key: tuple, life: BufferLife, hidden: float | None) -> None:
        """Keep ``c`` (its ``reads``, ``key``, ``life``, the seconds its readers hide where they do) as the
        twin of later micro-batches' collectives at its place: none where the ops whose
        partitions its steps read are not placed alike in every micro-batch."""
        if self.j == self.j0 and self.at == len(self.first) + 1:
            ops = (reads[0].dst_op, c.op) + ((life.regather,) if life.regather is not None else ())
            alike = all(map(self._alike, ops))
            self.first.append(_Twin(c, key, list(map(READ, reads)), hidden) if alike else None)

    def _alike(self, op: str) -> bool:
        rows = self.lowered.partitions[op]
        if type(rows) is MovedPartitions:  # its source's rows, every device moved alike
            rows = rows.root
        got = self.alike.get(id(rows))
        if got is None:
            places = [(p[1], p[3]) for p in rows[0]]  # (index, device)
            got = self.alike[id(rows)] = all([(p[1], p[3]) for p in row] == places for row in rows[1:])
        return got
