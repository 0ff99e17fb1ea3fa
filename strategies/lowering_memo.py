"""Pieces across sharding levels (``strategies.lowering_cache``): an op's pieces read the
sharding level (``ParallelConfig.zero``) of its own config and of its weight-op producers' in
one place only, the level each ``WeightRead`` carries (``strategies.pieces.lower_op``: its own
weights at its level, a ``parameter`` or ``constant`` producer's at the larger of the two).
Partitions, transfers, reductions, collective reads and byte totals are the same at every
level. So the pieces of an op lowered once under some levels give its pieces under any other
levels of the same cuts: the same records, the weight reads' levels set again. A search's
micro-batch and global moves that come back to a count under other levels (data parallel,
then FSDP at the same count) lower nothing again, and the task blocks, a function of the
partitions, transfers and reductions (``simulator.tasks``), are found again too."""

from __future__ import annotations

from strategies.graph import OpGraph, OpNode
from strategies.lowered import WEIGHT_KINDS, OpPieces, WeightRead
from strategies.strategy import Strategy

__all__ = ["levels_key", "relevelled"]

_new = tuple.__new__


def levels_key(shape: tuple, strategy: Strategy, node: OpNode) -> tuple:
    """The lowering cache's key of ``node``'s pieces with the sharding levels left out: ``shape``
    (``lowering_cache.update``'s key by shape: the op's shape id, micro-batches, devices, its
    config, its producers', its recompute key, copy 0's devices) with each config's level dropped."""
    config = strategy.__getitem__
    cfg = config(node.name)
    return ("levels", shape[0], shape[1], shape[2], (cfg.degrees, cfg.devices, cfg.recompute),
            tuple((c.degrees, c.devices, c.recompute) for c in map(config, node.inputs)), *shape[5:])


def relevelled(pieces: OpPieces, graph: OpGraph, strategy: Strategy, node: OpNode) -> OpPieces | None:
    """``pieces`` of ``node`` (lowered under other sharding levels, the same cuts) with the weight
    reads' levels of ``strategy``: ``pieces`` itself where they are the same; None where one weight
    would read two levels (an op reading one weight both as its own and through a weight op)."""
    cfg = strategy[node.name]
    level = {w.name: cfg.zero for w in node.weights}
    for x in node.inputs:
        producer = graph[x]
        if producer.kind in WEIGHT_KINDS:
            z = max(cfg.zero, strategy[x].zero)
            if level.setdefault(producer.weights[0].name, z) != z:
                return None
    reads = pieces.weight_reads
    if all(r.zero == level[r.name] for r in reads):
        return pieces
    return pieces._replace(weight_reads=tuple(_new(WeightRead, (*r[:6], level[r.name])) for r in reads))
