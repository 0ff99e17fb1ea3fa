"""The collectives' buffers as rows of the memory model's walk (``simulator.memory._rows``): what
each call leaves a member and its readers' gradients, added and freed at the ops where
``strategies.collective_buffers`` says the executor holds them."""

from __future__ import annotations

import numpy as np

from strategies.collective_buffers import buffer_lives
from strategies.lowering import Lowered
from strategies.region import box_numel

__all__ = ["collective_rows"]


def collective_rows(lowered: Lowered, position: dict[str, int], n: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(ops in graph order) x devices, like ``memory._rows``: the bytes a forward adds at each op
    (a call's result, at its first reader), those freed after each op's forward (a transient
    or gathered-again result, after its last reader), those a backward adds at each op (each
    reader's gradient of the result; a result gathered again, where it is) and those freed after each op's backward (a kept result after its first
    reader's; the readers' gradients after the holder's, where the dual was called). Micro-batch
    0's collectives (every micro-batch's are alike); None where the plan has none."""
    lives = buffer_lives(lowered, microbatch=0)
    if not lives:
        return None
    held, freed, redone, gone = (np.zeros((len(position), n), dtype=np.int64) for _ in range(4))
    for life in lives:
        c = life.collective
        item = c.nbytes // box_numel(c.region)
        first, holder = position[life.first], position[c.op]
        for i, d in enumerate(c.devices):
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
