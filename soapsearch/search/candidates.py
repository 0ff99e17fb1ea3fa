"""The op moves' configs: every valid config of an op (``strategies.config.enumerate_configs``'
order), one list per op signature and count of micro-batches, made when first read, so that the
repeated layers of a transformer share one list (GPT-3 175B: 2,123 ops, 21 signatures) and a count
of micro-batches no move reaches enumerates nothing (a count's space, ``moves.Space``, reads
every op's list when it is built)."""

from __future__ import annotations

import math
from typing import Hashable, Iterator, Mapping

from strategies.config import ParallelConfig, degree_grids, device_blocks
from strategies.graph import OpGraph, OpNode
from strategies.repeats import signature

__all__ = ["Candidates", "ConfigSpace", "config_key"]


def config_key(node: OpNode) -> Hashable:
    """What ``degree_grids`` reads of an op: its signature (kind, shapes, dims, attrs, weights,
    the specs it reads; ``strategies.repeats.signature``) and its dims' names."""
    return signature(node), tuple(d.name for d in node.dims)


class ConfigSpace:
    """The configs of one graph's ops on ``num_devices`` devices at any count of micro-batches:
    each (degrees, devices) pair one shared ParallelConfig, each op signature's list made once
    per count (``configs``)."""

    def __init__(self, graph: OpGraph, num_devices: int, node_size: int | None):
        self.graph, self.num_devices, self.node_size = graph, num_devices, node_size
        self._blocks: dict[int, list[tuple[int, ...]]] = {}
        self._made: dict[tuple[tuple[int, ...], tuple[int, ...]], ParallelConfig] = {}
        self._lists: dict[tuple[Hashable, int], list[ParallelConfig]] = {}
        self._keys: dict[str, Hashable] = {}

    def configs(self, op: str, microbatches: int) -> list[ParallelConfig]:
        """``op``'s valid configs at ``microbatches``, the list its signature's ops share (read
        it, never change it)."""
        key = self._keys.get(op)
        if key is None:
            key = self._keys[op] = config_key(self.graph[op])
        out = self._lists.get((key, microbatches))
        if out is None:
            out = self._lists[key, microbatches] = self._enumerate(self.graph[op], microbatches)
        return out

    def _enumerate(self, node: OpNode, microbatches: int) -> list[ParallelConfig]:
        cfgs = []
        for grid in degree_grids(node, self.num_devices, microbatches):
            parts = math.prod(grid)
            blocks = self._blocks.get(parts)
            if blocks is None:
                blocks = self._blocks[parts] = device_blocks(parts, self.num_devices, self.node_size)
            for block in blocks:
                cfg = self._made.get((grid, block))
                if cfg is None:
                    cfg = self._made[grid, block] = ParallelConfig(grid, block)
                cfgs.append(cfg)
        return cfgs

    def at(self, microbatches: int) -> "Candidates":
        """Op -> its configs at ``microbatches``, each list made when first read."""
        return Candidates(self, microbatches)


class Candidates(Mapping[str, list[ParallelConfig]]):
    """Op -> its valid configs at one count of micro-batches, in graph order, each op's list
    made (or taken from an op of its signature) when first read."""

    def __init__(self, space: ConfigSpace, microbatches: int):
        self.space, self.microbatches = space, microbatches

    def __getitem__(self, op: str) -> list[ParallelConfig]:
        if op not in self.space.graph:
            raise KeyError(op)
        return self.space.configs(op, self.microbatches)

    def __iter__(self) -> Iterator[str]:
        return (node.name for node in self.space.graph)

    def __len__(self) -> int:
        return len(self.space.graph)

    def __contains__(self, op: object) -> bool:
        return isinstance(op, str) and op in self.space.graph
