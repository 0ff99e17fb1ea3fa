"""The collectives' buffers as rows of the memory model's walk (``simulator.memory_walks._rows``): what
each call leaves a member and its readers' gradients, added and freed at the ops where
``strategies.collective_buffers`` says the executor holds them; and the level-0/1 gradient
buckets' flat tensors, added where each member issues them in the last backward pass and held
to the step's sync (``bucket_rows``)."""

from __future__ import annotations

import numpy as np

from simulator.memory_rows import Columns
from strategies.collective_buffers import bucket_buffers, buffer_lives
from strategies.lowering import Lowered
from strategies.overlap import bucket_plan
from strategies.region import box_numel

__all__ = ["collective_rows", "bucket_rows"]


def collective_rows(lowered: Lowered, position: dict[str, int], n: int, columns: Columns | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(ops in graph order) x devices, like ``memory._rows``: the bytes a forward adds at each op
    (a call's result, at its first reader), those freed after each op's forward (a transient
    or gathered-again result, after its last reader), those a backward adds at each op (each
    reader's gradient of the result; a result gathered again, where it is) and those freed after each op's backward (a kept result after its first
    reader's; the readers' gradients after the holder's, where the dual was called). Micro-batch
    0's collectives (every micro-batch's are alike); None where the plan has none. ``columns``:
    the representatives' columns alone (``simulator.memory_rows.Columns``)."""
    lives = buffer_lives(lowered, microbatch=0)
    if not lives:
        return None
    col = None if columns is None else columns.at
    held, freed, redone, gone = (np.zeros((len(position), n if col is None else len(col)), dtype=np.int64)
                                 for _ in range(4))
    for life in lives:
        c = life.collective
        item = c.nbytes // box_numel(c.region)
        first, holder = position[life.first], position[c.op]
        for i, d in enumerate(c.devices):
            d = col.get(d) if col is not None else d
            if d is None:
                continue
            nbytes = box_numel(c.result(i)) * item
            held[first, d] += nbytes
            if life.kept:
                gone[first, d] += nbytes
            else:
                freed[position[life.last], d] += nbytes
            if life.regather is not None:  # gathered again where its first reader is recomputed
                redone[position[life.regather], d] += nbytes
                gone[first, d] += nbytes
            for op, k in life.readers:
                redone[position[op], d] += k * nbytes
                gone[holder, d] += k * nbytes
    return held, freed, redone, gone


def bucket_rows(lowered: Lowered, position: dict[str, int], n: int, columns: Columns | None = None
                ) -> np.ndarray | None:
    """(ops in graph order) x devices: the bytes of the level-0/1 gradient buckets' flat tensors
    (``strategies.collective_buffers.bucket_buffers``) each member issues right after that op's
    backward step in the last micro-batch (``strategies.overlap.bucket_issues``), held until the
    step's sync. Of copy 0's lowering (``Lowered.copies``): copy 0's devices' columns only. None
    where the plan has no such bucket. ``columns``: the representatives' columns alone."""
    sizes = bucket_buffers(lowered)
    if not sizes:
        return None
    _, issues = bucket_plan(lowered, position, _memo(lowered.graph))
    col = None if columns is None else columns.at
    out = np.zeros((len(position), n if col is None else len(col)), dtype=np.int64)
    for d, its in issues.items():
        d = col.get(d) if col is not None else d
        if d is None:
            continue
        for issue in its:
            out[position[issue.after.op], d] += sizes[issue.key]
    return out


_MEMOS: dict[int, tuple[object, dict]] = {}
"""Graph id -> (graph, the ``bucket_plan`` memo kept across its lowerings)."""


def _memo(graph) -> dict:
    hit = _MEMOS.get(id(graph))
    if hit is None or hit[0] is not graph:
        if len(_MEMOS) > 8:
            _MEMOS.clear()
        hit = _MEMOS[id(graph)] = (graph, {})
    return hit[1]
