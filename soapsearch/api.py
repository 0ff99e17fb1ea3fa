"""The Python door to the simulator: simulate a plan of a traced model on a topology."""

from __future__ import annotations

import os

from simulator.cost import CostModel
from simulator.presets import get_topology
from simulator.result import SimResult, write_trace
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from strategies import OpGraph, Strategy, baseline, load_strategy

__all__ = ["DEFAULT_TOPOLOGY", "TOPOLOGY_HELP", "simulate", "resolve_plan"]

DEFAULT_TOPOLOGY = "p100-4x4"
"""The topology of every command and function that takes one and is not given one: the FlexFlow
paper's cluster (4 nodes of 4 P100 GPUs), where its default, paper-scale models were planned."""
TOPOLOGY_HELP = (f"preset (p100-4x4, k80-16x4, a100-Nx8, h100-Nx8, local-cpu-N) or topology JSON "
                 f"(default {DEFAULT_TOPOLOGY}, the FlexFlow paper's cluster, as for every command)")
"""The --topology help of every command that defaults it."""


def resolve_plan(graph: OpGraph, plan: Strategy | str | os.PathLike, num_devices: int,
                 microbatches: int | None = None) -> Strategy:
    """A Strategy, a baseline name (for ``num_devices`` devices; ``microbatches`` as
    ``strategies.baseline`` defaults them) or a plan JSON path."""
    if isinstance(plan, Strategy):
        return plan
    if isinstance(plan, str) and not plan.endswith(".json") and not os.path.exists(plan):
        return baseline(plan, graph, num_devices, microbatches)
    return load_strategy(plan, graph)


def simulate(graph: OpGraph, plan: Strategy | str | os.PathLike, *,
             topology: Topology | str = DEFAULT_TOPOLOGY, cost_model: CostModel | str = "analytical",
             optimizer: str = "sgd", microbatches: int | None = None,
             trace: str | os.PathLike | None = None, precision: str | None = None,
             bucket_cap_mb: float | None = None, reduce_dtype: str | None = None,
             overlap_grad_reduce: bool | None = None) -> SimResult:
    """Simulated cost of one training iteration of ``plan`` (a Strategy, a baseline name or a
    plan file) for ``graph`` on ``topology``; ``trace`` writes the timeline (Chrome trace);
    ``precision`` (``strategies.strategy.PRECISIONS``), ``reduce_dtype`` (``Strategy.reduce_dtype``)
    ``bucket_cap_mb`` (the gradient buckets' cap, ``Strategy.bucket_cap_mb``) and
    ``overlap_grad_reduce`` (``Strategy.overlap_grad_reduce``) replace the plan's."""
    topo = get_topology(topology) if isinstance(topology, (str, os.PathLike)) else topology
    if not isinstance(topo, Topology):
        raise ValueError(f"topology = {topology!r}: must be a preset name, a topology JSON path or a Topology")
    strategy = resolve_plan(graph, plan, topo.num_devices, microbatches)
    if precision is not None or reduce_dtype is not None:
        strategy = strategy.with_precision(precision or strategy.precision, reduce_dtype)
    if bucket_cap_mb is not None:
        strategy = strategy.with_bucket_cap(bucket_cap_mb)
    if overlap_grad_reduce is not None:
        strategy = strategy.with_overlap_grad_reduce(overlap_grad_reduce)
    if strategy.num_devices > topo.num_devices:
        raise ValueError(f"the plan is for {strategy.num_devices} devices but topology "
                         f"{topo.name!r} has {topo.num_devices}")
    result = simulate_plan(graph, strategy, topo, cost_model, optimizer=optimizer,
                           timeline=trace is not None)
    if trace is not None:
        write_trace(trace, result)
    return result
