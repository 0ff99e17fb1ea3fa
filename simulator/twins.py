"""Task blocks of ops whose pieces are another op's renamed (``Lowered.twins``: one shape, one
config, ``strategies.lowering_shared``), copied from that op's block instead of built again.

An op's block (``simulator.tasks._Block``) is a function of its node, its pieces, its
producers' blocks (the local ids of their forwards and of what completes them) and the
positions of its own and its producers' blocks. For a twin of op T the node and the
configs are T's up to names, so the partitions' times (the same boxes on the same devices),
the transfers' wires and every local id are T's: the twin's block is T's with the names
swapped (``("fwd", op, k, j)``; a transfer's label holds the twin's own ``Transfer``) and its
block positions mapped (its own; producer i of T -> its producer i), where its producers'
blocks give the same local ids as T's. Blocks holding reduction groups (string labels, the
sums ``step.link_step`` reads) are built as before.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from simulator.taskgraph import Columns, Segment
from strategies.graph import OpGraph, OpNode
from strategies.lowered import Lowered, OpPieces

__all__ = ["twin_block"]


def twin_block(lowered: Lowered, node: OpNode, pieces: OpPieces, producers: dict[str, Any], at: int,
               blocks: Sequence[Any], position: dict[str, int]) -> Any | None:
    """``node``'s block (at position ``at``, its producers' blocks ``producers``) copied from
    its twin's, or None where it has none to copy from (module docstring); ``blocks``: each
    position's current block, ``position``: op -> its block's position."""
    twin = lowered.twins.get(node.name)
    if twin is None or pieces.reductions:
        return None
    op, source = twin
    if lowered.pieces.get(op) is not source:
        return None
    t = blocks[position[op]]
    if t is None or t.pieces is not source or t.step_reductions:
        return None
    graph: OpGraph = lowered.graph
    was = graph[op].inputs
    moved = {t.position: at}
    for old, new in zip(was, node.inputs):
        p, q = blocks[position[old]], producers[new]
        if p is None or p.fwd != q.fwd or p.fwd_done != q.fwd_done:
            return None
        if moved.setdefault(p.position, q.position) != q.position:
            return None
    b = object.__new__(type(t))
    b.__dict__.update(t.__dict__)  # what a sealed block holds, then what differs
    b.pieces, b.position = pieces, at
    b.cols = Columns()
    for f in ("category", "duration", "resources", "device", "nbytes"):
        setattr(b.cols, f, getattr(t.cols, f))
    b.cols.name = _names(t.cols.name, node.name, dict(zip(map(id, source.transfers), pieces.transfers)))
    b.add = b.cols.add
    b.segment = object.__new__(Segment)
    b.segment.__dict__.update(t.segment.__dict__)
    b.segment.cols = b.cols
    b.edge_src, b.edge_dst, b.cross, b.slots, b.step_reductions = [], [], [], [], []
    edges, steps, duration, res_len, res, slots = t.arrays
    edges, slots, steps = _moved(edges, moved), _moved(slots, moved), steps.copy()
    steps[5] = at
    b.edges, b.steps = edges, steps
    b.arrays = (edges, steps, duration, res_len, res, slots)
    return b


def _moved(a: np.ndarray, moved: dict[int, int]) -> np.ndarray:
    """``a`` with the block positions in its rows 1 and 3 (each one of ``moved``'s keys) mapped by
    ``moved`` (``_Block``: edges and slots hold positions there)."""
    out = a.copy()
    shifts = {new - old for old, new in moved.items()}
    if len(shifts) == 1:  # a layer's op reading its own layer's ops: every position one offset on
        out[1:4:2] += shifts.pop()
        return out
    for r in (1, 3):
        for old, new in moved.items():
            if old != new:
                out[r][a[r] == old] = new
    return out


def _names(names: list, op: str, transfers: dict[int, Any]) -> list:
    """Labels of a twin's tasks from its op's: a partition's (what, op, index, micro-batch)
    with the twin's op, a transfer's (what, transfer) with the twin's transfer."""
    moved = transfers.__getitem__
    return [(x[0], op, x[2], x[3]) if len(x) == 4 else (x[0], moved(id(x[1]))) for x in names]
