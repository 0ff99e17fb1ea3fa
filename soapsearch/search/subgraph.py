"""The subgraph move: a connected set of ops placed on one device set in one proposal.

An op move changes one op; a group move one op and its neighbours. Neither reaches, from data
parallel, a plan where a whole branch of the graph runs on one device group (OWT's convolutions
on every device and its linears on a few, a stage of a pipeline) without crossing the costly
redistributions between the ops it moves and those it leaves. The subgraph move draws

- a device set of the topology's groups: a size g dividing the devices and one aligned block
  of g devices (or of one device per node, ``strategies.config.device_blocks``), each uniformly;
- one layout for it: g = 1 places every op whole on that device, g > 1 cuts every op alike,
  g ways on its sample dim over the block (data parallel on the group);
- a seed op (uniformly among the ops with a choice of config) and a size k (uniform in
  1..``MAX_OPS``), and grows a connected set of at most k ops from the seed along producer and
  consumer edges (``moves.neighbor_ops``), taking only ops that have that layout among their
  valid configs, in a random breadth-first order.

Every op of the set takes the layout, keeping its sharding level and recompute (``moves.keep``).
Its reverse (the old configs back) is one such move only where they were one layout on one
group, so, as with group moves, the chain is a search, not an exact sampler (``mcmc.py``).
All draws come from the chain's own stream, so a seed and proposal budget give the same plan
with any number of workers; the Evaluator reuses every other op's lowering, so delta simulation
stays exact (tests/search/test_subgraph.py).
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING

from strategies.config import ParallelConfig, device_blocks
from strategies.graph import OpGraph
from strategies.strategy import Strategy

if TYPE_CHECKING:
    from soapsearch.search.moves import Space

__all__ = ["MAX_OPS", "SubgraphMoves"]

MAX_OPS = 8
"""The most ops one subgraph move places."""


class SubgraphMoves:
    """The subgraph moves of one graph on ``num_devices`` devices, for one count of
    micro-batches: ``space`` is that count's ``moves.Space`` (the ops with a choice, each op's
    configs as a set), ``neighbors`` (op -> its producers and consumers with a choice) its
    neighbours."""

    def __init__(self, graph: OpGraph, num_devices: int, space: "Space",
                 neighbors: dict[str, tuple[str, ...]], node_size: int | None = None):
        self.graph, self.space, self.neighbors = graph, space, neighbors
        self.ops = space.ops
        self.groups = [block for g in range(1, num_devices + 1) if num_devices % g == 0
                       for block in device_blocks(g, num_devices, node_size)]

    def layout(self, op: str, devices: tuple[int, ...]) -> ParallelConfig | None:
        """``op`` whole on one device, or cut len(devices) ways on its sample dim over
        ``devices``; None where that is not one of its valid configs."""
        node = self.graph[op]
        degrees = [1] * len(node.dims)
        if len(devices) > 1:
            if node.sample_dim is None:
                return None
            degrees[node.sample_dim] = len(devices)
        cfg = ParallelConfig(tuple(degrees), devices)
        return cfg if cfg in self.space.config_set(op) else None

    def propose(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with a connected set of ops grown from a random op given one layout on
        one random device set (each op keeping its sharding level and recompute); None where
        the seed op cannot take the layout or nothing changes."""
        if not self.ops:
            return None
        devices = rng.choice(self.groups)
        seed = rng.choice(self.ops)
        k = rng.randint(1, MAX_OPS)
        layouts: dict[str, ParallelConfig] = {}
        first = self.layout(seed, devices)
        if first is None:
            return None
        layouts[seed] = first
        frontier, seen = deque([seed]), {seed}
        while frontier and len(layouts) < k:
            op = frontier.popleft()
            nexts = [n for n in self.neighbors.get(op, ()) if n not in seen]
            rng.shuffle(nexts)
            for other in nexts:
                seen.add(other)
                cfg = self.layout(other, devices)
                if cfg is not None and len(layouts) < k:
                    layouts[other] = cfg
                    frontier.append(other)
        plan = current
        for op, cfg in layouts.items():
            old = current[op]
            if (old.zero, old.recompute) != (cfg.zero, cfg.recompute):
                cfg = cfg.with_memory(old.zero, old.recompute)
            if cfg != old:
                plan = plan.replace(op, cfg)
        return None if plan is current else plan
