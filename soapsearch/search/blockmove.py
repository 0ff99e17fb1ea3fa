"""The block move: one proposal that turns a whole Megatron-shaped block (its column linears,
middle ops and row linear, ``strategies.megatron.megatron_blocks``) to one layout together.

A single-op move cannot reach Megatron's column/row pair: cutting L2 on in_features alone, or L1
on out_features alone, moves the whole activation between layouts and is rejected long before
its partner's move would make it pay. The block move sets every op of the block at once
(``strategies.megatron.block_layout``) to

- t-way tensor parallelism × d-way data parallelism on an aligned group of g = d·t devices
  (t ≥ 2; every aligned group of every size the devices allow, as ``enumerate_configs``
  places a config), or
- back to data parallel (t = 1): on an aligned group, or on the devices of the op that feeds
  the block (its neighbours' layout).

``mcmc.run_chain`` makes it with probability ``BLOCK`` where the graph has blocks, and accepts
or rejects it by the same Metropolis rule as any proposal. The plan changes several ops at
once; the search's Evaluator reuses every other op's lowering and task block as for a group
move, so delta simulation stays exact (tests/search/test_blockmove.py).
"""

from __future__ import annotations

import random

from strategies.config import ParallelConfig
from strategies.graph import OpGraph
from strategies.megatron import Block, block_layout, megatron_blocks
from strategies.strategy import Strategy

__all__ = ["BLOCK", "BlockMoves"]

BLOCK = 0.1
"""The probability that a proposal is a block move (where the graph has blocks)."""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class BlockMoves:
    """The block moves of one graph on ``num_devices`` devices with ``microbatches``
    micro-batches; each block's layouts are made when first drawn and kept."""

    def __init__(self, graph: OpGraph, num_devices: int, microbatches: int = 1):
        self.graph, self.num_devices, self.microbatches = graph, num_devices, microbatches
        self.blocks: list[Block] = megatron_blocks(graph) if num_devices > 1 else []
        self.layouts = [(g // t, t, first) for g in _divisors(num_devices) for t in _divisors(g)
                        for first in range(0, num_devices, g)]
        """(d, t, first device) of every layout: d·t devices from ``first``, aligned."""
        self._made: dict[tuple[int, int, int, int], dict[str, ParallelConfig] | None] = {}

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def layout(self, b: int, d: int, t: int, first: int) -> dict[str, ParallelConfig] | None:
        key = (b, d, t, first)
        if key not in self._made:
            self._made[key] = block_layout(self.graph, self.blocks[b], d, t, self.microbatches, first)
        return self._made[key]

    def _neighbours(self, b: int, current: Strategy) -> tuple[int, int, int] | None:
        """(d, 1, first) of data parallel on the devices of the op feeding block ``b``, where
        they are an aligned run."""
        columns = self.blocks[b][0]
        devices = sorted(set(current[self.graph[columns[0]].inputs[0]].devices))
        g, first = len(devices), devices[0]
        if devices != list(range(first, first + g)) or first % g:
            return None
        return g, 1, first

    def propose(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with one random block given one random layout (each op keeping its
        sharding level and recompute); None where that layout cannot be written for the block
        or changes nothing."""
        b = rng.randrange(len(self.blocks))
        choice = self._neighbours(b, current) if rng.random() < 0.25 else rng.choice(self.layouts)
        configs = self.layout(b, *choice) if choice is not None else None
        if configs is None:
            return None
        plan = current
        for op, cfg in configs.items():
            old = plan[op]
            if (old.zero, old.recompute) != (cfg.zero, cfg.recompute):  # the op keeps its memory choices
                cfg = cfg.with_memory(old.zero, old.recompute)
            if old != cfg:
                plan = plan.replace(op, cfg)
        return None if plan is current else plan
