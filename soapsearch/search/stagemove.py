"""Pipeline stages rebalanced by the simulator's own times: the ops cut into units (the ops
before the largest repeated block, each of its instances, the ops after it;
``strategies.repeats``), each unit's time per device read off a simulated timeline of the
plan, and the units split into the plan's p stages by ``strategies.stages.dp_partition``
(PipeDream's dynamic program: the slowest stage as fast as it can be). Each op then moves, its
cut unchanged, from its stage's aligned group of N/p devices to its unit's new stage's group.

``restage`` is the move (``SearchConfig.restage_move``) and the init (``init="restaged"``:
the megatron pipeline plan rebalanced) that use it.
"""

from __future__ import annotations

from typing import Callable

from simulator.result import SimResult
from soapsearch.search.repeatmove import replaced
from strategies.config import ParallelConfig
from strategies.graph import OpGraph
from strategies.repeats import RepeatedBlock, repeated_blocks
from strategies.stages import dp_partition
from strategies.strategy import Strategy

__all__ = ["op_seconds", "pipeline_groups", "restage", "units"]

_LEAF = {"input", "parameter", "constant"}


def units(graph: OpGraph, block: RepeatedBlock | None) -> list[list[str]]:
    """The ops (leaves with their first reader) in graph order cut into units: the ops before
    ``block``'s first instance, each instance, the ops after its last; every op alone where
    there is no block."""
    order = [n.name for n in graph if n.kind not in _LEAF]
    if block is None:
        out = [[op] for op in order]
    else:
        pos = {op: i for i, op in enumerate(order)}
        first, last = pos[block.instances[0][0]], pos[block.instances[-1][-1]]
        out = [order[:first]] + [list(inst) for inst in block.instances] + [order[last + 1:]]
        out = [u for u in out if u]
    where = {op: k for k, u in enumerate(out) for op in u}
    for node in graph:
        if node.kind in _LEAF:
            readers = [where[u] for u in graph.users(node.name) if u in where]
            out[min(readers) if readers else 0].append(node.name)
    return out


def op_seconds(result: SimResult) -> dict[str, float]:
    """Op -> seconds its forward and backward compute tasks take per device that runs them
    (from ``result``'s timeline: task names ``fwd op[k]@mbM``)."""
    total: dict[str, float] = {}
    devices: dict[str, set[int]] = {}
    for name, device, lane, start, end, category in result.timeline:
        if lane != "compute" or category not in ("forward", "backward", "recompute"):
            continue
        op = name.split(" ", 1)[-1].rsplit("[", 1)[0]
        total[op] = total.get(op, 0.0) + end - start
        devices.setdefault(op, set()).add(device)
    return {op: t / len(devices[op]) for op, t in total.items()}


def pipeline_groups(plan: Strategy, ops: list[str]) -> int:
    """The most stages p (dividing the devices) such that each of ``ops`` runs within one
    aligned group of N/p devices."""
    n = plan.num_devices
    for p in sorted((p for p in range(1, n + 1) if n % p == 0), reverse=True):
        size = n // p
        if all(min(plan[op].devices) // size == max(plan[op].devices) // size for op in ops):
            return p
    return 1


def restage(graph: OpGraph, plan: Strategy, timed: Callable[[Strategy], SimResult]) -> Strategy | None:
    """``plan`` with its pipeline stages rebalanced (module docstring) by ``timed`` (a
    simulation with its timeline); None where the plan has one stage, fewer units than stages,
    or the balanced split is the one it has."""
    blocks = repeated_blocks(graph)
    cut = units(graph, max(blocks, key=lambda b: len(b) * b.length) if blocks else None)
    computing = [op for u in cut for op in u if graph[op].kind not in _LEAF]
    p = pipeline_groups(plan, computing)
    if p == 1 or len(cut) < p:
        return None
    size = plan.num_devices // p
    seconds = op_seconds(timed(plan))
    times = [sum(seconds.get(op, 0.0) for op in u) for u in cut]
    starts, _ = dp_partition(times, p)
    stage_of = [sum(1 for s in starts if s <= k) - 1 for k in range(len(cut))]
    changed: dict[str, ParallelConfig] = {}
    for k, unit in enumerate(cut):
        for op in unit:
            cfg = plan[op]
            shift = (stage_of[k] - min(cfg.devices) // size) * size
            if shift and max(cfg.devices) // size == min(cfg.devices) // size:
                changed[op] = ParallelConfig(cfg.degrees, tuple(d + shift for d in cfg.devices), cfg.zero,
                                             cfg.recompute)
    return replaced(plan, changed)
