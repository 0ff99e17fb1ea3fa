"""search(): the product's main job — a plan for a model on a topology, found by MCMC over SOAP
configs scored by the simulator, with the expert baselines it must beat."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from simulator.cost import CostModel, get_cost_model
from simulator.presets import get_topology
from simulator.result import SimResult
from simulator.simulate import simulate_plan
from simulator.tasks import TaskCache
from simulator.topology import Topology
from soapsearch.search.mcmc import (Budget, ChainStats, candidate_configs, consider, plan_cost,
                                    run_chain)
from soapsearch.trace import trace
from strategies import (OpGraph, PlanError, Strategy, baseline, load_strategy, save_strategy)
from strategies.lowering import lower

__all__ = ["FoundPlan", "SearchResult", "search", "best_baselines", "Evaluator", "save_found"]

PIPELINE_MICROBATCHES = (2, 4, 8)


class Evaluator:
    """Simulates plans of one graph on one topology, reusing each unchanged op's lowering."""

    def __init__(self, graph: OpGraph, topology: Topology, cost: CostModel, optimizer: str = "sgd"):
        self.graph, self.topology, self.cost, self.optimizer = graph, topology, cost, optimizer
        self._cache: dict = {}
        self._tasks = TaskCache(topology, cost)
        self.calls = 0

    def __call__(self, plan: Strategy, summary: bool = False) -> SimResult:
        """Iteration time and memory of ``plan`` (``summary``: also busy times, bytes moved)."""
        self.calls += 1
        if len(self._cache) > 200_000:
            self._cache.clear()
        return simulate_plan(self.graph, lower(self.graph, plan, self._cache), self.topology,
                             self.cost, optimizer=self.optimizer, summary=summary, cache=self._tasks)


@dataclass
class FoundPlan:
    """A plan a search found, simulated with its summary, next to the expert baselines."""

    strategy: Strategy
    result: SimResult
    graph: OpGraph = field(repr=False)
    topology: Topology = field(repr=False)
    baselines: dict[str, float] = field(default_factory=dict)
    """Simulated ms of data parallel, model parallel, OWT and the best pipeline."""
    baseline_results: dict[str, SimResult] = field(default_factory=dict, repr=False)
    proposals: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False

    @property
    def predicted_ms(self) -> float:
        return self.result.iteration_ms

    def save(self, path: str | os.PathLike) -> None:
        """Strategy JSON v1 with the predictions (iteration ms, peak memory, baselines)."""
        save_found(path, self)


@dataclass
class SearchResult(FoundPlan):
    baseline_plans: dict[str, Strategy] = field(default_factory=dict, repr=False)
    history: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds, proposals, best ms) at each improvement."""
    accepted: int = 0


def save_found(path: str | os.PathLike, found: FoundPlan) -> None:
    """Write a search's (or a study's) plan as strategy JSON v1 with its predictions."""
    predicted = {"iteration_ms": found.result.iteration_ms,
                 "peak_memory_bytes": list(found.result.peak_memory_bytes),
                 "fits": found.result.fits, "baselines": dict(found.baselines)}
    save_strategy(path, found.strategy, found.graph, topology=found.topology.name,
                  predicted=predicted)


def best_baselines(graph: OpGraph, num_devices: int, evaluate: Evaluator
                   ) -> tuple[dict[str, Strategy], dict[str, SimResult]]:
    """Each baseline that is valid for this graph, simulated; ``pipeline`` is the best of
    GPipe and 1F1B over 2, 4 and 8 micro-batches."""
    plans: dict[str, Strategy] = {}
    results: dict[str, SimResult] = {}
    for name in ("data_parallel", "model_parallel", "owt"):
        try:
            plans[name] = baseline(name, graph, num_devices)
        except PlanError:
            continue
        results[name] = evaluate(plans[name], summary=True)
    for m in PIPELINE_MICROBATCHES:
        for schedule in ("gpipe", "1f1b"):
            try:
                plan = baseline("pipeline", graph, num_devices, m).with_microbatches(m, schedule)
            except PlanError:
                continue
            res = evaluate(plan, summary=True)
            if "pipeline" not in results or res.iteration_time < results["pipeline"].iteration_time:
                plans["pipeline"], results["pipeline"] = plan, res
    return plans, results


def _accumulate(graph: OpGraph, n: int, evaluate: Evaluator, stats: ChainStats, started: float) -> None:
    """When no expert plan fits: data parallel with gradient accumulation, 1F1B over 2, 4, 8
    micro-batches (one micro-batch's activations held at a time), the fewest that fits
    considered as the answer (it is not a chain's start: the chains keep their micro-batches)."""
    for m in PIPELINE_MICROBATCHES:
        try:
            plan = baseline("data_parallel", graph, n).with_microbatches(m, "1f1b")
        except PlanError:
            continue
        result = evaluate(plan)
        consider(stats, plan, result, plan_cost(result), started)
        if result.fits:
            return


def _initial(item: Any, graph: OpGraph, n: int, rng: random.Random, candidates, microbatches: int,
             schedule: str, baselines: dict[str, Strategy]) -> Strategy:
    if isinstance(item, Strategy):
        return item
    if item == "random":
        return Strategy.of({op: rng.choice(cfgs) for op, cfgs in candidates.items()}, n,
                           microbatches, schedule)
    if item in baselines:
        plan = baselines[item]
        return plan if item == "pipeline" else plan.with_microbatches(microbatches, schedule)
    if isinstance(item, (str, os.PathLike)) and (str(item).endswith(".json") or os.path.exists(item)):
        return load_strategy(item, graph)
    raise PlanError(None, "init", item, "must be a baseline name (data_parallel, model_parallel, "
                    "owt, pipeline), 'random', a plan JSON path or a Strategy")


def search(model: torch.nn.Module | OpGraph, example_inputs: Sequence[Any] | None = None, *,
           topology: Topology | str = "p100-4x4", budget_s: float | None = 60.0,
           proposals: int | None = None, cost_model: CostModel | str = "analytical",
           init: Sequence[Any] = ("data_parallel",), seed: int = 0, microbatches: int = 1,
           schedule: str = "gpipe", beta: float | None = None, optimizer: str = "sgd",
           num_devices: int | None = None, reset_every: int = 500,
           on_step: Callable[[ChainStats, float], None] | None = None) -> SearchResult:
    """Search a plan for ``model`` (with ``example_inputs``) or an OpGraph on ``topology``.
    One MCMC chain per initial plan, the budget split evenly between them; the result is never
    worse than the best initial plan nor than any baseline (they are scored first), and when no
    baseline fits in device memory, data parallel with gradient accumulation is tried too
    (``_accumulate``). Deterministic for a seed under a proposal budget."""
    graph = model if isinstance(model, OpGraph) else trace(model, example_inputs)
    topo = get_topology(topology) if isinstance(topology, (str, os.PathLike)) else topology
    n = num_devices or topo.num_devices
    if n > topo.num_devices:
        raise ValueError(f"num_devices {n} > the {topo.num_devices} devices of {topo.name!r}")
    cost = get_cost_model(cost_model) if isinstance(cost_model, str) else cost_model
    evaluate = Evaluator(graph, topo, cost, optimizer)
    rng = random.Random(seed)
    started = time.perf_counter()
    plans, results = best_baselines(graph, n, evaluate)
    node_size = topo.node_size if topo.node_size and topo.node_size < n else None
    candidates = candidate_configs(graph, n, microbatches, node_size)
    stats = ChainStats()
    for name, plan in plans.items():  # the answer is never worse than an expert's plan
        consider(stats, plan, results[name], plan_cost(results[name]), started)
    if stats.best_result is not None and not stats.best_result.fits:
        _accumulate(graph, n, evaluate, stats, started)
    inits = [_initial(i, graph, n, rng, candidates, microbatches, schedule, plans) for i in init]
    if not inits:
        raise ValueError("search needs at least one initial plan (init)")
    share = Budget(budget_s / len(inits) if budget_s else None,
                   proposals // len(inits) if proposals else None)
    interrupted = False
    try:
        for plan in inits:
            run_chain(plan, evaluate, candidates, share, rng, beta, reset_every, stats, started,
                      on_step=on_step)
    except KeyboardInterrupt:
        interrupted = True
    if stats.best is None:  # interrupted before the first chain scored its start
        stats.best = inits[0]
    best = evaluate(stats.best, summary=True)  # chains score without busy times / bytes moved
    return SearchResult(stats.best, best, graph, topo,
                        baselines={k: r.iteration_ms for k, r in results.items()},
                        baseline_results=results, proposals=stats.proposals,
                        elapsed_s=time.perf_counter() - started, interrupted=interrupted,
                        baseline_plans=plans, history=stats.history, accepted=stats.accepted)
