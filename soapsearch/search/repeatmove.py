"""The repeated-block move: one proposal that changes op i of every instance of a repeated block
(``strategies.repeats.repeated_blocks``: a transformer's layers, a ResNet stage's bottlenecks)
at once, so that a 96-layer model's layers are searched as one.

A proposal picks a block, an instance r and an op position i, and either

- draws a config of instance r's op i (of the op moves' candidates for the plan's count of
  micro-batches), keeping that op's sharding level and recompute (``moves.keep``), or
- (probability ``COPY``) copies instance r's current configs, all of its ops with their
  sharding levels and recompute,

and gives every instance's op i (every op, for a copy) that config: instances are alike op for
op, so one config fits them all. With ``stages`` (``SearchConfig.repeat_stages``), an instance
whose op i runs on other devices than instance r's (another pipeline stage) keeps its own
devices: it takes the config moved by the difference of the two device sets' first devices,
and keeps its own config where that moved config is not one of its candidates. ``mcmc.run_chain``
makes it with probability ``SearchConfig.repeat_move`` where the graph has repeated blocks and
accepts it by the same Metropolis rule as every proposal.
"""

from __future__ import annotations

import random

from strategies.config import ParallelConfig
from strategies.graph import OpGraph
from strategies.repeats import RepeatedBlock, repeated_blocks
from strategies.strategy import Strategy

__all__ = ["COPY", "RepeatMoves", "replaced"]

COPY = 0.25
"""The probability that a repeated-block move copies one instance's configs to every other."""


class RepeatMoves:
    """The repeated-block moves of one graph on ``num_devices`` devices."""

    def __init__(self, graph: OpGraph, num_devices: int, stages: bool = False):
        self.graph, self.num_devices, self.stages = graph, num_devices, stages
        self.blocks: list[RepeatedBlock] = repeated_blocks(graph) if num_devices > 1 else []
        self._sets: dict[int, dict[str, frozenset[ParallelConfig]]] = {}

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def _placed(self, cfg: ParallelConfig, own: ParallelConfig, source: ParallelConfig, op: str,
                candidates: dict[str, list[ParallelConfig]], m: int) -> ParallelConfig:
        """``cfg`` for an instance whose op runs on ``own`` where the source instance's runs on
        ``source``: moved to its own devices with ``stages`` (``own`` where the moved config is
        no candidate), else as it is."""
        if not self.stages or set(own.devices) == set(source.devices):
            return cfg
        shift = min(own.devices) - min(source.devices)
        devices = tuple(d + shift for d in cfg.devices)
        if not all(0 <= d < self.num_devices for d in devices):
            return own
        moved = ParallelConfig(cfg.degrees, devices, zero=cfg.zero, recompute=cfg.recompute)
        known = self._sets.setdefault(m, {})
        if op not in known:
            known[op] = frozenset(c.with_memory(0, False) for c in candidates[op])
        return moved if moved.with_memory(0, False) in known[op] else own

    def propose(self, current: Strategy, candidates: dict[str, list[ParallelConfig]],
                rng: random.Random) -> Strategy | None:
        """``current`` with op i (or, for a copy, every op) of every instance of one block set
        alike (module docstring); None where nothing changes."""
        block = rng.choice(self.blocks)
        r = rng.randrange(len(block))
        if rng.random() < COPY:
            positions = range(block.length)
            configs = {i: current[block.instances[r][i]] for i in positions}
        else:
            i = rng.randrange(block.length)
            op = block.instances[r][i]
            if len(candidates[op]) < 2:
                return None
            cfg = rng.choice(candidates[op])
            old = current[op]
            if (cfg.zero, cfg.recompute) != (old.zero, old.recompute):
                cfg = cfg.with_memory(old.zero, old.recompute)
            positions, configs = (i,), {i: cfg}
        changed = {}
        for inst in block.instances:
            for i in positions:
                op = inst[i]
                cfg = self._placed(configs[i], current[op], current[block.instances[r][i]], op, candidates,
                                   current.microbatches)
                if cfg != current[op]:
                    changed[op] = cfg
        return replaced(current, changed)


def replaced(current: Strategy, changed: dict[str, ParallelConfig]) -> Strategy | None:
    """``current`` with the configs of ``changed`` (one pass over the plan however many change;
    every other op keeps its config object, which the lowering's cache knows by identity); None
    where there are none."""
    if not changed:
        return None
    if len(changed) <= 4:
        plan = current
        for op, cfg in changed.items():
            plan = plan.replace(op, cfg)
        return plan
    return current.with_configs({op: changed.get(op, cfg) for op, cfg in current.configs})
