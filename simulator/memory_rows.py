"""The memory walk's rows of the ops' pieces (``simulator.memory_walks._rows`` without the collectives):
(ops in graph order) x devices, the bytes each op's forward adds, those freed after it, those
recomputed at each op's backward and those freed after it. A search's next plan changes a few
ops: where neither it nor the last plan of the same graph recomputes and every device is
simulated, each op's rows are the sum of its own terms (what it keeps, its dropped or transient
output and the point that frees it, ``strategies.drops.drop_positions``), so the last plan's
rows are patched, the terms of each op whose pieces or drop entry changed taken out and its new
ones put in (integer bytes: the same arrays as built afresh)."""

from __future__ import annotations

import itertools
import operator
from typing import NamedTuple

import numpy as np

from strategies.lowering import Lowered

__all__ = ["Columns", "columns_of", "dropped_rows", "held_rows", "piece_rows"]

Drops = dict[str, list[tuple[tuple[int, ...], int, int]]]
"""``strategies.drops.drop_positions``: dropped op -> [(devices, free_after, recompute_at)]."""

_activations = operator.attrgetter("activations")


class Columns(NamedTuple):
    """A folded lowering's rows (``Lowered.copies``) with one column per representative: the
    devices that stand for others (copy 0's and, under a member fold, its kept members:
    ``Copies.rep_array``), each column the rows of every device that is its image. Every step
    of the memory walk (``simulator.memory_walks``) is a sum or maximum down a column, so it
    gives each device what the walk over every device's column gives it; a walk of 1,024
    devices folded on 32 is 32 columns wide."""

    devices: np.ndarray
    """The representatives, sorted: column i is device ``devices[i]``'s."""
    of: list[int]
    """Device -> its representative's column."""
    at: dict[int, int]
    """Representative -> its column (a device that represents none has no column of its own)."""


def columns_of(lowered: Lowered, n: int) -> Columns | None:
    """``lowered``'s ``Columns`` over ``n`` devices; None where it is not folded (a column a device)."""
    if lowered.copies is None:
        return None
    devices, of = np.unique(lowered.copies.rep_array(n), return_inverse=True)
    return Columns(devices, of.tolist(), dict(zip(devices.tolist(), range(len(devices)))))


def held_rows(ops: list, n: int, columns: Columns | None = None) -> tuple[np.ndarray, list[int]]:
    """What each op keeps, (ops in graph order) x ``n`` devices (``columns``: the
    representatives' columns alone), and the ops that drop or let go of their outputs
    (``dropped_rows``' ``held`` and ``at``)."""
    at = [i for i, p in enumerate(ops) if p.dropped]
    return _matrix(list(map(_activations, ops)), n, columns), at


def _matrix(vectors: list[tuple[int, ...]], n: int, columns: Columns | None) -> np.ndarray:
    """``vectors`` (each one entry a device) as rows of int64: all ``n`` entries, or the
    ``columns`` alone, picked before any is made an array (a fold keeps few of many devices)."""
    if columns is None:
        return np.fromiter(itertools.chain.from_iterable(vectors), np.int64, len(vectors) * n).reshape(-1, n)
    k = len(columns.devices)
    pick = operator.itemgetter(*columns.devices.tolist())
    rows = map(pick, vectors) if k > 1 else ((pick(v),) for v in vectors)
    return np.fromiter(itertools.chain.from_iterable(rows), np.int64, len(vectors) * k).reshape(-1, k)


def dropped_rows(lowered: Lowered, ops: list, held: np.ndarray, at: list[int], columns: Columns | None,
                 drops: Drops, position: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows built afresh from the ops' pieces (``held``: what each op keeps; ``at``: the ops
    that drop or let go of their outputs; ``drops``: their points), without the collectives.
    ``columns``: the representatives ``held``'s columns are; None: every device's, in order."""
    freed, redone = np.zeros_like(held), np.zeros_like(held)  # after an op's forward; at its backward
    if not at:
        return held, freed, redone, held
    dropped = _matrix([ops[i].dropped for i in at], held.shape[1], columns)
    col = None if columns is None else columns.at
    gone = held.copy()
    held[at] += dropped
    redo = [k for k, i in enumerate(at) if ops[i].recompute]
    gone[[at[k] for k in redo]] += dropped[redo]
    names = list(position)
    row = {names[i]: k for k, i in enumerate(at)}
    which, fs, rs = [], [], []  # ops with one point for all their devices (their bytes are 0 elsewhere)
    for name, groups in drops.items():
        k = row[name]
        if len(groups) == 1:
            which.append(k)
            fs.append(groups[0][1])
            rs.append(groups[0][2])
            continue
        for (d,), f, r in groups:
            if col is not None:  # a representative's column stands for the devices it represents
                d = col.get(d)
                if d is None:
                    continue
            freed[f, d] += dropped[k, d]
            if ops[at[k]].recompute:
                redone[r, d] += dropped[k, d]
    np.add.at(freed, fs, dropped[which])
    once = np.array([ops[at[k]].recompute for k in which], dtype=bool)
    np.add.at(redone, np.asarray(rs, dtype=np.int64)[once], dropped[which][once])
    return held, freed, redone, gone


class _Last(NamedTuple):
    """The last rows ``piece_rows`` gave for a graph, with what they were built from."""

    graph: object
    ops: list
    """Each op's pieces, in graph order."""
    drops: Drops
    rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """held, freed, redone, gone: read-only (a patch writes copies)."""
    recompute: bool
    """Whether some op recomputes (no patch from or to such rows)."""


PATCH_SHARE = 16
"""Rows are patched where at most 1 in ``PATCH_SHARE`` of the ops changed, else built afresh (a
full simulation's lowering, or another chain's plan): a patched op costs a few small array
operations, about ten ops' share of building every row again (speed, never results)."""

_LAST: dict[int, _Last] = {}
"""Graph id -> the last rows ``piece_rows`` gave for it (a few graphs: a search asks for one)."""


def piece_rows(lowered: Lowered, ops: list, position: dict[str, int], drops: Drops
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``dropped_rows`` of every device's columns (``lowered.copies`` None), patched from the last
    call's rows of the same graph where neither plan recomputes (``ops``: the pieces in graph
    order, ``position``: op -> index, ``drops``: the plan's drop points). The arrays are
    read-only and may be the last call's."""
    graph, n = lowered.graph, len(lowered.device_bytes.kept)
    last = _LAST.get(id(graph))
    if last is not None and last.graph is graph and not last.recompute and len(last.ops) == len(ops) \
            and last.rows[0].shape[1] == n:
        changed = list(itertools.compress(range(len(ops)), map(operator.is_not, ops, last.ops)))
        if not any(ops[i].recompute for i in changed):
            names = list(position)
            moved = {position[name] for name in drops.keys() | last.drops.keys()
                     if drops.get(name) is not last.drops.get(name)}
            again = moved.union(changed)
            if len(again) * PATCH_SHARE <= len(ops):
                rows = _patched(last, ops, drops, names, sorted(again))
                _keep(graph, ops, drops, rows, False)
                return rows
    held, at = held_rows(ops, n)
    rows = dropped_rows(lowered, ops, held, at, None, drops, position)
    _keep(graph, ops, drops, rows, any(p.recompute for p in ops))
    return rows


def _keep(graph, ops: list, drops: Drops, rows: tuple, recompute: bool) -> None:
    for a in rows:
        a.flags.writeable = False
    if len(_LAST) > 8:
        _LAST.clear()
    _LAST[id(graph)] = _Last(graph, ops, drops, rows, recompute)


def _patched(last: _Last, ops: list, drops: Drops, names: list[str], again: list[int]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``last``'s rows with the terms of the ops at ``again`` taken out (their last pieces and
    drop entries) and put in again (their new ones); no op recomputes, so nothing is redone."""
    if not again:
        return last.rows
    held, freed, redone, gone = (a.copy() for a in last.rows)
    for i in again:
        for sign, p, groups in ((-1, last.ops[i], last.drops.get(names[i])), (1, ops[i], drops.get(names[i]))):
            kept = sign * np.asarray(p.activations, dtype=np.int64)
            held[i] += kept
            gone[i] += kept
            if not p.dropped:
                continue
            dropped = sign * np.asarray(p.dropped, dtype=np.int64)
            held[i] += dropped
            if groups is None:
                continue
            if len(groups) == 1:  # one point for all its devices (its bytes are 0 elsewhere)
                freed[groups[0][1]] += dropped
                continue
            for (d,), f, _ in groups:
                freed[f, d] += dropped[d]
    return held, freed, redone, gone
