"""Task blocks of ops whose pieces are another op's renamed (``Lowered.twins``: one shape, one
config, ``strategies.lowering_shared``) or renamed and moved to devices ``delta`` on (the same
layer in another pipeline stage, ``lowering_shared.relative_key``), copied from that op's
block instead of built again.

An op's block (``simulator.tasks._Block``) is a function of its node, its pieces, its
producers' blocks (the local ids of their forwards and of what completes them), the positions
of its own and its producers' blocks, and the devices and routes its tasks run on. For a twin
of op T the node and the configs are T's up to names and a shift of every device by
``delta``, so the local ids are T's, and where each device d is alike device d + delta (the
same cost key and host overheads) and every wire of T's block, moved, costs what it did (its
route one link for one link), the partitions' and transfers' times are T's too. The twin's
block is T's with the names swapped (``("fwd", op, k, j)``; a transfer's label holds the
twin's own ``Transfer``), every device and link mapped (devices d -> d + delta; a route's links
-> the moved route's) and its block positions mapped (its own; producer i of T -> its producer
i), where its producers' blocks give the same local ids as T's. delta = 0 maps no device or link.
Blocks holding reduction groups (string labels, the sums ``step.link_step`` reads) are built as
before.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from simulator.devices import OVERHEAD_FIELDS
from simulator.taskgraph import INDEX, Columns
from simulator.topology import Topology
from simulator.wires import wire_of
from strategies.graph import OpGraph, OpNode
from strategies.lowered import Lowered, OpPieces

__all__ = ["twin_block"]


def twin_block(lowered: Lowered, node: OpNode, pieces: OpPieces, producers: dict[str, Any], at: int,
               blocks: Sequence[Any], position: dict[str, int], topology: Topology, wires: dict
               ) -> Any | None:
    """``node``'s block (at position ``at``, its producers' blocks ``producers``) copied from
    its twin's, or None where it has none to copy from (module docstring); ``blocks``: each
    position's current block, ``position``: op -> its block's position, ``wires``: the task
    cache's (``simulator.wires``)."""
    twin = lowered.twins.get(node.name)
    if twin is None or pieces.reductions:
        return None
    op, source, delta = twin
    if lowered.pieces.get(op) is not source:
        return None
    t = blocks[position[op]]
    if t is None or t.pieces is not source or t.step_reductions:
        return None
    graph: OpGraph = lowered.graph
    moved = {t.position: at}
    for old, new in zip(graph[op].inputs, node.inputs):
        p, q = blocks[position[old]], producers[new]
        if p is None or p.fwd != q.fwd or p.fwd_done != q.fwd_done:
            return None
        if moved.setdefault(p.position, q.position) != q.position:
            return None
    cols = Columns()
    cols.category, cols.duration, cols.nbytes = t.cols.category, t.cols.duration, t.cols.nbytes
    cols.name = _Names(t.cols.name, node.name, source.transfers, pieces.transfers)
    if not delta:
        cols.resources, cols.device, res = t.cols.resources, t.cols.device, t.segment.res
    else:
        got = _moved_resources(t, source, delta, topology, wires)
        if got is None:
            return None
        cols.resources, cols.device, res = got
    return t.moved(pieces, at, moved, delta, cols, res)


def _moved_resources(t: Any, source: OpPieces, delta: int, topology: Topology, wires: dict
                     ) -> tuple[list, list, np.ndarray] | None:
    """Block ``t``'s tasks' resources, devices and flat resources with every device moved
    ``delta`` on and every wire's links mapped to the moved wire's; None where a device is not
    alike the one it moves to, a moved wire costs other seconds, or a link would map to two."""
    if not _alike(topology, delta):
        return None
    n = topology.num_devices
    to: dict[int, int] = {}  # resource -> its moved resource
    tuples: dict[tuple, tuple] = {}
    for d in set(t.cols.device):
        to[d] = d + delta
        tuples[(d,)] = (d + delta,)
    pairs = {(x.src_device, x.dst_device, x.nbytes) for x in source.transfers if x.src_device != x.dst_device}
    for s, d, size in pairs:
        was, now = wire_of(topology, wires, (s, d, size)), wire_of(topology, wires, (s + delta, d + delta, size))
        if (was.seconds, was.grad_seconds, was.send_hold, was.grad_send_hold) != \
                (now.seconds, now.grad_seconds, now.send_hold, now.grad_send_hold):
            return None
        for a, b in ((was.links, now.links), (was.grad_links, now.grad_links)):
            if len(a) != len(b) or tuples.setdefault(a, b) != b:
                return None
            for x, y in zip(a, b):
                if to.setdefault(x, y) != y:
                    return None
    try:
        resources = list(map(tuples.__getitem__, t.cols.resources))
    except KeyError:  # a task on resources no wire or device names
        return None
    table = np.arange(n + len(topology.links), dtype=INDEX)
    table[np.fromiter(to, INDEX, len(to))] = np.fromiter(to.values(), INDEX, len(to))
    devices = (np.asarray(t.cols.device, dtype=INDEX) + delta).tolist()
    return resources, devices, table[t.segment.res]


@functools.lru_cache(maxsize=256)
def _alike(topology: Topology, delta: int) -> bool:
    """Whether every device d of ``topology`` with d + ``delta`` one of its devices is alike
    that device: the cost key partition times are kept by and the host overheads."""
    devices = topology.devices
    lo, hi = max(0, -delta), len(devices) - max(0, delta)
    return all(devices[d].cost_key == devices[d + delta].cost_key and
               all(getattr(devices[d], f) == getattr(devices[d + delta], f) for f in OVERHEAD_FIELDS)
               for d in range(lo, hi))


class _Names:
    """Labels of a twin's tasks from its op's, made when first read (traces, ``device_steps``; a
    simulation reads none): a partition's (what, op, index, micro-batch) with the twin's op, a
    transfer's (what, transfer) with the twin's transfer (``theirs[i]`` for ``ours[i]``)."""

    __slots__ = ("_source", "_op", "_ours", "_theirs", "_list")

    def __init__(self, source: Sequence, op: str, ours: Sequence, theirs: Sequence):
        self._source, self._op, self._ours, self._theirs = source, op, ours, theirs
        self._list: list | None = None

    def _made(self) -> list:
        if self._list is None:
            op, moved = self._op, dict(zip(map(id, self._ours), self._theirs)).__getitem__
            self._list = [(x[0], op, x[2], x[3]) if len(x) == 4 else (x[0], moved(id(x[1]))) for x in self._source]
            self._source = self._ours = self._theirs = ()  # the list holds what was read of them
        return self._list

    def __iter__(self):
        return iter(self._made())

    def __len__(self) -> int:
        return len(self._list) if self._list is not None else len(self._source)

    def __getitem__(self, i):
        return self._made()[i]
