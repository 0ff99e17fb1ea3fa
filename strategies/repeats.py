"""Repeated blocks of an OpGraph: maximal runs of one sequence of ops (kinds, shapes, attrs and
weight shapes, wired alike) that follow one another in graph order, as a transformer's layers
or a ResNet stage's bottlenecks do. Instance k's op i is the op that plays op i's part in
instance k, so a plan can give every instance's op i the same config (the search's repeated
move) and a stage partitioner can cut the layers as a sequence of equal units.

Found by periods: for a block length L, ops j and j + L with the same signature (``_keys``)
mark a run; a run of r ≥ L such positions holds ⌊(r + L) / L⌋ instances from its first op. The
runs are kept greedily, most ops covered first (the shorter block on a tie: a block of 2L
repeats a block of L), each disjoint from those kept, and only where every instance reads
its own ops at the same positions (``_wired_alike``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np

from strategies.graph import OpGraph, OpNode

__all__ = ["RepeatedBlock", "repeated_blocks", "signature"]

_LEAF = {"input", "parameter", "constant"}


@dataclass(frozen=True)
class RepeatedBlock:
    """``instances[k][i]``: op i of instance k (graph order within an instance, instances in
    graph order)."""

    instances: tuple[tuple[str, ...], ...]

    @property
    def length(self) -> int:
        return len(self.instances[0])

    def __len__(self) -> int:
        return len(self.instances)

    def position(self, op: str) -> tuple[int, int] | None:
        """(instance, index in it) of ``op``; None where the block does not hold it."""
        for k, inst in enumerate(self.instances):
            if op in inst:
                return k, inst.index(op)
        return None


def signature(node: OpNode) -> Hashable:
    """What two ops must share to play the same part: kind, output spec, dims, attrs, weights
    and the specs they read (``strategies.lowering_shared`` adds the dims' names and the wiring)."""
    return (node.kind, node.output.shape, node.output.dtype, tuple((d.size, d.role) for d in node.dims),
            repr(sorted(node.attrs.items(), key=lambda kv: kv[0])),
            tuple((w.role, w.spec.shape, w.spec.dtype, w.trainable) for w in node.weights),
            tuple((s.shape, s.dtype) for s in node.input_specs))


def _keys(nodes: list[OpNode]) -> np.ndarray:
    ids: dict[Hashable, int] = {}
    return np.array([ids.setdefault(signature(n), len(ids)) for n in nodes], dtype=np.int64)


def _wired_alike(graph: OpGraph, pos: dict[str, int], instances: list[tuple[str, ...]]) -> bool:
    """Every instance's op i reads, input by input, the op at the same offset from its
    instance's first op where that is within the instance or the one before it (a layer reads
    the previous layer's output), or an op further out in all of them."""
    def wiring(inst: tuple[str, ...]) -> list[tuple]:
        start, size = pos[inst[0]], len(inst)
        return [tuple(pos[x] - start if x in pos and -size <= pos[x] - start < size else None
                      for x in graph[op].inputs) for op in inst]
    first = wiring(instances[0])
    return all(wiring(inst) == first for inst in instances[1:])


def repeated_blocks(graph: OpGraph, min_ops: int = 2) -> list[RepeatedBlock]:
    """The repeated blocks of ``graph`` (module docstring) of ``min_ops`` ops or more, inputs,
    parameters and constants left out (they compute nothing to plan), most ops covered first."""
    nodes = [n for n in graph if n.kind not in _LEAF]
    names = [n.name for n in nodes]
    pos = {x: i for i, x in enumerate(names)}
    keys = _keys(nodes)
    n = len(nodes)
    found: list[tuple[int, int, int, int]] = []  # (-covered, length, run's first op, its end)
    for length in range(min_ops, n // 2 + 1):
        same = np.concatenate(([False], keys[:-length] == keys[length:], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for a, b in zip(edges[0::2], edges[1::2]):  # runs [a, b) of j with keys[j] == keys[j + L]
            count = (b - a + length) // length
            if count >= 2:
                found.append((-count * length, length, int(a), int(b) + length))
    taken = np.zeros(n, dtype=bool)
    blocks = []
    for _, length, start, end in sorted(found):
        if taken[start:end].any():
            continue
        # the phase: the instances may start at any of the run's first ``length`` ops; the most
        # instances, then the earliest start, whose instances are wired alike
        for shift in sorted(range(length), key=lambda s: (-((end - start - s) // length), s)):
            k = (end - start - shift) // length
            if k < 2:
                break
            first = start + shift
            instances = [tuple(names[first + j * length:first + (j + 1) * length]) for j in range(k)]
            if _wired_alike(graph, pos, instances):
                taken[first:first + k * length] = True
                blocks.append(RepeatedBlock(tuple(instances)))
                break
    return blocks
