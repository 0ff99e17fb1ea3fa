"""Pipeline stages rebalanced by the simulator's own times: the ops cut into units (the ops
before the largest repeated block, each of its instances, the ops after it;
``strategies.repeats``), each unit's compute time per device (``op_seconds``: the durations the
simulator gives the plan's forward and backward tasks, read off its lowering and the cost model
without a simulation), and the units split into the plan's p stages by
``strategies.stages.dp_partition`` (PipeDream's dynamic program: the slowest stage as fast as
it can be). Each op then moves, its cut unchanged, from its stage's aligned group of N/p
devices to its unit's new stage's group.

``restage`` is the global move's rebalancing proposal (``globalmove.GlobalMoves.propose``).
"""

from __future__ import annotations

from typing import Callable

from simulator.cost import CostModel
from simulator.simulate import FOLD_FROM, Lowerings
from simulator.tasks import task_seconds
from simulator.topology import Topology
from soapsearch.search.repeatmove import replaced
from strategies.config import ParallelConfig
from strategies.graph import OpGraph
from strategies.lowered import WEIGHT_KINDS, Lowered
from strategies.repeats import RepeatedBlock, repeated_blocks
from strategies.stages import dp_partition
from strategies.strategy import Strategy

__all__ = ["op_seconds", "pipeline_groups", "restage", "stage_count", "stage_units", "units"]

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


def op_seconds(graph: OpGraph, plan: Strategy, topology: Topology, cost: CostModel,
               lowering_cache: dict | None = None) -> dict[str, float]:
    """Op -> seconds its forward and backward compute tasks take per device that runs them, the
    durations ``simulator.tasks`` gives them (each partition's ``cost.partition_time``, the
    device's ``task_overhead`` where the op runs on the host, a recompute op's forward again in
    its backward), summed over the micro-batches: what a timeline of ``plan`` shows on a
    topology without compute contention (``simulator.contention``, which stretches them there).
    Read off the lowering ``simulate_plan`` makes (copy 0's of a plan replicated over copies of
    alike devices, ``lowering_cache`` reused), no task graph built."""
    fold = plan.num_devices >= FOLD_FROM and len({(d.cost_key, d.task_overhead)
                                                  for d in topology.devices[:plan.num_devices]}) == 1
    # copies alone: members 0 and 1 (simulator.fold_members) would weigh member 0 as half the devices
    return _lowered_seconds(Lowerings(graph, plan, lowering_cache).first(topology, fold, members=False), topology, cost)


def _lowered_seconds(lowered: Lowered, topology: Topology, cost: CostModel) -> dict[str, float]:
    """``op_seconds`` of one lowering: copy 0's devices stand for every copy's (alike devices);
    an op whose pieces are its twin's renamed on its devices (``Lowered.twins``, delta 0) has its twin's tasks
    (``simulator.twins``: the block copied, durations and all)."""
    devices, graph, out = topology.devices, lowered.graph, {}
    for node in graph:
        pieces = lowered.pieces[node.name]
        twin = lowered.twins.get(node.name)
        if twin is not None and not twin[2] and twin[0] in out and lowered.pieces.get(twin[0]) is twin[1]:
            out[node.name] = out[twin[0]]
            continue
        runs = node.kind not in WEIGHT_KINDS  # the executor reads weights in place: no host work
        backward, redo = graph.needs_grad[node.name], 1 if pieces.recompute else 0
        total, ran = 0.0, set()
        for parts in pieces.partitions:
            for p in parts:
                device = devices[p.device]
                f_s, b_s = cost.partition_time(node, p, device)
                over = device.task_overhead if runs else 0.0
                total += sum(task_seconds(f_s, b_s, over, backward, redo))
                ran.add(p.device)
        if ran:
            out[node.name] = total / len(ran)
    return out


def pipeline_groups(plan: Strategy, ops: list[str]) -> int:
    """The most stages p (dividing the devices) such that each of ``ops`` runs within one
    aligned group of N/p devices."""
    n = plan.num_devices
    for p in sorted((p for p in range(1, n + 1) if n % p == 0), reverse=True):
        size = n // p
        if all(min(plan[op].devices) // size == max(plan[op].devices) // size for op in ops):
            return p
    return 1


def stage_units(graph: OpGraph) -> list[list[str]]:
    """``units`` of the largest repeated block (by its ops in all instances)."""
    blocks = repeated_blocks(graph)
    return units(graph, max(blocks, key=lambda b: len(b) * b.length) if blocks else None)


def stage_count(graph: OpGraph, plan: Strategy, cut: list[list[str]] | None = None) -> int:
    """The pipeline stages ``restage`` finds in ``plan`` (``pipeline_groups`` of its computing
    ops; ``cut``: the graph's ``stage_units``, made here where not given)."""
    cut = stage_units(graph) if cut is None else cut
    return pipeline_groups(plan, [op for u in cut for op in u if graph[op].kind not in _LEAF])


def restage(graph: OpGraph, plan: Strategy, seconds: Callable[[Strategy], dict[str, float]],
            cut: list[list[str]] | None = None) -> Strategy | None:
    """``plan`` with its pipeline stages rebalanced (module docstring) by ``seconds`` (a plan's
    ``op_seconds``); None where the plan has one stage, fewer units than stages, or the
    balanced split is the one it has. ``cut``: the graph's ``stage_units``, made here where not given."""
    cut = stage_units(graph) if cut is None else cut
    p = stage_count(graph, plan, cut)
    if p == 1 or len(cut) < p:
        return None
    size = plan.num_devices // p
    per_op = seconds(plan)
    times = [sum(per_op.get(op, 0.0) for op in u) for u in cut]
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
