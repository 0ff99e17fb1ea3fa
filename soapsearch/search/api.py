"""search(): the product's main job — a plan for a model on a topology, found by MCMC over SOAP
configs scored by the simulator, with the expert baselines it must beat."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.result import SimResult
from simulator.simulate import FOLD_FROM
from simulator.topology import Topology
from soapsearch.api import DEFAULT_TOPOLOGY
from soapsearch.search.chains import Chain, Progress, default_workers, run_chains
from soapsearch.search.candidates import ConfigSpace
from soapsearch.search.config import SearchConfig, search_config
from soapsearch.search.evaluator import Evaluator, scored
from soapsearch.search.exhaustive import search_exhaustively, space_size
from soapsearch.search.mcmc import Budget, ChainStats, candidate_configs, consider, neighbor_ops, plan_cost
from soapsearch.search.globalmove import GlobalMoves
from soapsearch.search.symmove import SymmetricMoves
from soapsearch.search.sweep import SWEEP_SHARE, SWEEP_TIMINGS, SWEPT_BASELINES, megatron_lm_factors, swept_starts
from soapsearch.search.moves import MoveRates, Moves, Space, microbatch_choices
from soapsearch.search.pace import SPACE, Pace
from soapsearch.search.stageinit import restaged_starts
from soapsearch.trace import check_scalar_loss, trace
from strategies import (OpGraph, PlanError, Strategy, baseline, load_strategy, save_strategy)
from strategies.baselines import BASELINES, hybrid, megatron_lm
from soapsearch.search.blockmove import BlockMoves
from strategies.megatron import megatron_blocks
from strategies.config import validate_config
from strategies.pieces import check_microbatches

__all__ = ["FoundPlan", "SearchConfig", "SearchResult", "search", "best_baselines", "Evaluator", "save_found",
           "scored"]

PIPELINE_MICROBATCHES = (2, 4, 8)
@dataclass
class FoundPlan:
    """A plan a search found, simulated with its summary, next to the expert baselines."""

    strategy: Strategy
    result: SimResult
    graph: OpGraph = field(repr=False)
    topology: Topology = field(repr=False)
    baselines: dict[str, float] = field(default_factory=dict)
    """Simulated ms of data parallel (or hybrid), model parallel, OWT and the best pipeline."""
    baseline_results: dict[str, SimResult] = field(default_factory=dict, repr=False)
    proposals: int = 0
    """Proposals drawn (the budget's count), ``scored`` of them simulated or known."""
    scored: int = 0
    """Proposals scored: ``proposals`` less the draws that made no plan (``mcmc.ChainStats.scored``)."""
    elapsed_s: float = 0.0
    interrupted: bool = False
    workers: int = 1
    """Chains run side by side (forked processes)."""

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
    """(seconds, proposals of the chain that improved, best ms) at each improvement."""
    accepted: int = 0
    block_accepted: int = 0
    """Accepted block moves (``blockmove.py``): Megatron-shaped blocks turned in one proposal."""
    exhaustive: int = 0
    """Plans simulated by enumerating the op configs' space (``exhaustive.py``); 0: MCMC searched."""
    space: int = 0
    """How many plans that space holds (where enumerated): the answer is exact where
    ``exhaustive`` equals it, else the time budget ran out first."""
    unscored: tuple[str, ...] = ()
    """Baselines the time budget ran out before scoring (not in ``baselines``)."""
    stopped_early: int = 0
    """Chains that stopped before their budget's end, their best not improved for
    ``SearchConfig.patience`` proposals (or half their proposal budget)."""

    @property
    def exact(self) -> bool:
        return self.space > 0 and self.exhaustive == self.space


def save_found(path: str | os.PathLike, found: FoundPlan) -> None:
    """Write a search's (or a study's) plan as strategy JSON v1 with its predictions."""
    predicted = {"iteration_ms": found.result.iteration_ms,
                 "peak_memory_bytes": list(found.result.peak_memory_bytes),
                 "fits": found.result.fits, "baselines": dict(found.baselines)}
    save_strategy(path, found.strategy, found.graph, topology=found.topology.name,
                  predicted=predicted)


def best_baselines(graph: OpGraph, num_devices: int, evaluate: Evaluator, deadline: float | None = None,
                   unscored: list[str] | None = None, only: Sequence[str] | None = None,
                   pace: Pace | None = None) -> tuple[dict[str, Strategy], dict[str, SimResult]]:
    """Each baseline that is valid for this graph, simulated; ``pipeline`` is the best of
    GPipe and 1F1B over 2, 4 and 8 micro-batches; ``hybrid`` (data x tensor parallel) only
    where the batch does not divide by the devices (else it is data parallel); ``zero1`` and
    ``fsdp`` (data parallel with its replicated state sharded) and ``single_device`` (every op
    whole on device 0, where it fits in its memory) on more than one device;
    ``megatron`` and ``megatron_lm`` (the plan Megatron-LM runs, at the degrees
    ``sweep.megatron_lm_factors`` picks) only where the graph has a transformer's blocks
    (``strategies.megatron.megatron_blocks``). A baseline whose scoring would end past
    ``deadline`` (``time.perf_counter()``), as ``pace`` predicts it from the baselines scored
    before (``pace.Pace``, kind "baseline/<name>"), is not scored, the first excepted, and its name
    goes to ``unscored``. ``only``: the baselines of those names alone."""
    plans: dict[str, Strategy] = {}
    results: dict[str, SimResult] = {}
    pace = evaluate.pace if pace is None else pace

    def late(name: str) -> bool:
        """One baseline scored and ``name``'s scoring predicted to end past the deadline:
        ``name`` is left unscored."""
        if not results or pace.fits(f"baseline/{name}", deadline):
            return False
        if unscored is not None and name not in unscored:
            unscored.append(name)
        return True

    names = ["data_parallel", "hybrid", "model_parallel", "owt"] + (
        ["zero1", "fsdp", "single_device"] if num_devices > 1 else [])
    if num_devices > 1 and megatron_blocks(graph):
        names += ["megatron", "megatron_lm"]
    if only is not None:
        names = [name for name in names if name in only]
    for name in names:
        if name == "hybrid" and "data_parallel" in plans:  # it is data parallel then
            continue
        try:
            plans[name] = evaluate.planned(_baseline_plan(name, graph, num_devices, evaluate))
        except PlanError:
            continue
        if late(name):
            del plans[name]
            continue
        with pace.timed(f"baseline/{name}"):
            results[name] = evaluate(plans[name], summary=True)
        if name == "single_device" and not results[name].fits:  # a row only where it fits
            del plans[name], results[name]
    for m in PIPELINE_MICROBATCHES if only is None or "pipeline" in only else ():
        for schedule in ("gpipe", "1f1b"):
            try:
                plan = evaluate.planned(baseline("pipeline", graph, num_devices, m).with_microbatches(m, schedule))
                if late("pipeline"):
                    break
                with pace.timed("baseline/pipeline"):
                    res = evaluate(plan, summary=True)
            except PlanError:  # the batch, or an op that mixes micro-batches (check_microbatches)
                continue
            if "pipeline" not in results or res.iteration_time < results["pipeline"].iteration_time:
                plans["pipeline"], results["pipeline"] = plan, res
    return plans, results


def _baseline_plan(name: str, graph: OpGraph, n: int, evaluate: Evaluator) -> Strategy:
    """The baseline ``name``; ``megatron_lm`` at the tensor × pipeline degrees
    ``sweep.megatron_lm_factors`` picks for this topology (a PlanError where it picks none)."""
    if name != "megatron_lm":
        return baseline(name, graph, n)
    factors = megatron_lm_factors(graph, evaluate.topology, n, evaluate.optimizer, evaluate.precision,
                                  evaluate.reduce_dtype or "compute")
    if factors is None:
        raise PlanError(None, "baseline", name, f"model {graph.name!r} on {n} devices has no transformer layers "
                        "or no data-parallel degree dividing its batch")
    return megatron_lm(graph, n, *factors, precision=evaluate.precision)


def _accumulate(graph: OpGraph, n: int, evaluate: Evaluator, stats: ChainStats, started: float) -> None:
    """When no expert plan fits: data parallel (``hybrid`` where a micro-batch does not divide by
    n) with gradient accumulation, 1F1B over 2, 4, 8 micro-batches (one micro-batch's
    activations held at a time), the fewest that fits considered as the answer (it is not a
    chain's start: the chains keep their micro-batches). It runs past the time budget: a plan
    that fits comes before the budget (at most three more simulations)."""
    for m in PIPELINE_MICROBATCHES:
        try:
            plan = evaluate.planned(hybrid(graph, n, m).with_microbatches(m, "1f1b"))
            result = evaluate(plan)
        except PlanError:
            continue
        consider(stats, plan, result, plan_cost(result), started)
        if result.fits:
            return


def _initial(item: Any, graph: OpGraph, n: int, rng: random.Random, candidates, microbatches: int,
             schedule: str, baselines: dict[str, Strategy], globals_: GlobalMoves | None = None,
             swept: Strategy | None = None) -> Strategy:
    if item == "swept":
        if swept is None:
            raise PlanError(None, "init", item, f"model {graph.name!r} on {n} devices has no factorization "
                            "that fits in device memory within the sweep's share of the budget")
        return swept
    if item == "factorized":
        draws = (globals_.draw(rng) for _ in range(32 if globals_ else 0))
        plan = next((p for p in draws if p is not None), None)
        if plan is None:
            raise PlanError(None, "init", item, f"model {graph.name!r} on {n} devices has no valid factorization")
        return plan
    if item == "random":
        return Strategy.of({op: rng.choice(cfgs) for op, cfgs in candidates.items()}, n,
                           microbatches, schedule)
    if isinstance(item, str) and item in BASELINES:
        try:
            return _expert(item, graph, n, microbatches, schedule, baselines)
        except PlanError as e:  # its own reason why not, naming the init
            raise PlanError(e.op, e.field, e.value, e.rule, f"init {item!r}") from None
    if isinstance(item, Strategy):
        plan, where = item, "init"
    elif isinstance(item, (str, os.PathLike)) and (str(item).endswith(".json") or os.path.exists(item)):
        plan, where = load_strategy(item, graph), f"init {os.fspath(item)}"
    else:
        raise PlanError(None, "init", item, f"must be a baseline name ({', '.join(BASELINES)}), 'random', "
                        "'factorized', 'swept', a plan JSON path or a Strategy")
    if plan.num_devices != n:
        raise PlanError(None, "num_devices", plan.num_devices, f"the search uses {n} devices", where)
    if plan.microbatches != microbatches:  # a chain runs its start's own count (its moves follow it)
        try:
            check_microbatches(graph, plan.microbatches)
            for node in graph:
                validate_config(node, plan[node.name], n, plan.microbatches)
        except PlanError as e:
            raise PlanError(e.op, e.field, e.value, e.rule, where) from None
    return plan


def _expert(item: str, graph: OpGraph, n: int, microbatches: int, schedule: str,
            baselines: dict[str, Strategy]) -> Strategy:
    if item == "hybrid":  # for the chains' micro-batches (data parallel where they divide by n)
        return hybrid(graph, n, microbatches).with_microbatches(microbatches, schedule)
    # the chains' candidates are cut for their own micro-batch count, so an initial plan runs
    # that many (a scored pipeline baseline with another count is rebuilt for it)
    if item in baselines and baselines[item].microbatches == microbatches:
        return baselines[item].with_microbatches(microbatches, schedule)
    return baseline(item, graph, n, microbatches).with_microbatches(microbatches, schedule)


def search(model: torch.nn.Module | OpGraph, example_inputs: Sequence[Any] | None = None, *,
           topology: Topology | str = DEFAULT_TOPOLOGY, config: SearchConfig | None = None,
           on_step: Callable[[Progress], None] | None = None, **fields: Any) -> SearchResult:
    """Search a plan for ``model`` (with ``example_inputs``) or an OpGraph on ``topology``, as
    ``config`` says (default ``SearchConfig()``); keyword arguments named after its fields
    (``budget_s=5, seed=1``) replace them. ``config.chains`` MCMC chains start from
    ``config.init``'s plans, each with its own random stream, ``config.workers`` of them side by
    side in forked processes; the seconds are split evenly between the rounds of ``workers``
    chains, the proposals between the chains. The result is never worse than the best initial
    plan nor than any baseline (they are scored first; with a ``swept`` init, those of its
    space, ``sweep.SWEPT_BASELINES``, then the sweep's factorizations), and when no baseline fits in device
    memory, data parallel (or ``hybrid``) with gradient accumulation is tried too
    (``_accumulate``). Where the op configs make at most ``config.exhaustive_limit`` plans (and
    no more than the proposal budget), every one is simulated instead of MCMC
    (``exhaustive.py``; ``SearchResult.exhaustive`` counts them). Deterministic for a seed under a proposal budget, with any number of
    workers. ``on_step`` gets a ``Progress`` as it goes. The model must return one scalar loss
    (``check_scalar_loss``)."""
    started = time.perf_counter()  # the time budget counts from here: tracing and baselines too
    config = search_config(config, fields)
    budget = Budget(config.budget_s, config.proposals)  # one of them at least
    deadline = None if budget.seconds is None else started + budget.seconds
    microbatches, schedule, seed = config.microbatches, config.schedule, config.seed
    graph = model if isinstance(model, OpGraph) else trace(model, example_inputs)
    check_scalar_loss(graph)
    check_microbatches(graph, microbatches)  # an op that mixes samples across micro-batches: said now
    topo = get_topology(topology) if isinstance(topology, (str, os.PathLike)) else topology
    n = topo.num_devices if config.num_devices is None else config.num_devices
    if n > topo.num_devices:
        raise ValueError(f"search num_devices = {n}: more than the {topo.num_devices} devices of {topo.name!r}")
    cost = get_cost_model(config.cost_model) if isinstance(config.cost_model, str) else config.cost_model
    pace = Pace()  # each kind of step's mean seconds: one that would end past the deadline does not start
    evaluate = Evaluator(graph, topo, cost, config.optimizer, config.precision, summarize_best=True, pace=pace,
                         reduce_dtype=config.reduce_dtype)
    rng = random.Random(seed)
    unscored: list[str] = []
    swept = any(isinstance(i, str) and i == "swept" for i in config.init or ())
    plans, results = best_baselines(graph, n, evaluate, deadline, unscored, SWEPT_BASELINES if swept else None,
                                    pace)
    stats = ChainStats()
    for name, plan in plans.items():  # the answer is never worse than an expert's plan
        consider(stats, plan, results[name], plan_cost(results[name]), started)
    if stats.best_result is not None and not stats.best_result.fits:
        _accumulate(graph, n, evaluate, stats, started)
    done = _Done(evaluate, graph, topo, results, plans, started, unscored)
    if _past(deadline):  # the budget went on the baselines
        return done(stats, False, 1, 0, 0)
    node_size = topo.node_size if topo.node_size and topo.node_size < n else None
    configs = ConfigSpace(graph, n, node_size)  # each op signature's configs, made when first read
    candidates = candidate_configs(graph, n, microbatches, node_size, configs)
    with pace.timed(SPACE):  # a chain's start at another count is predicted by it
        moves = Moves(graph, n, MoveRates.of(config),
                      microbatch_choices(graph, config.microbatch_choices, microbatches), node_size,
                      {microbatches: Space(candidates, neighbor_ops(graph, candidates),
                                           BlockMoves(graph, n, microbatches) or None)}, config.repeat_stages,
                      configs)
    if config.global_move or any(isinstance(i, str) and i in ("factorized", "swept") for i in config.init or ()):
        moves.globals = GlobalMoves(graph, n, moves.choices, config.precision, evaluate) or None
    if n >= FOLD_FROM:  # proposals keep the plan foldable (symmove.py)
        moves.symmetric = SymmetricMoves(graph, evaluate.keeps_members)
    size = space_size(candidates)
    if size <= config.exhaustive_limit and (budget.proposals is None or size <= budget.proposals):
        count = search_exhaustively(candidates, evaluate, stats, started, n, microbatches, schedule,
                                    config.precision, deadline, pace)
        return done(stats, False, 1, count, size)
    if _past(deadline):  # the budget went on the moves' space (candidates.py: one list per op signature)
        return done(stats, False, 1, 0, 0)
    init = ("hybrid",) if config.init is None else config.init  # hybrid: data parallel where n divides the batch
    starts: list[Strategy] = []
    if swept and moves.globals:  # the factorizations timed best-first (sweep.py)
        share = None if deadline is None else time.perf_counter() + SWEEP_SHARE * (deadline - time.perf_counter())
        timed = swept_starts(graph, topo, moves.globals, evaluate, share,
                             None if deadline is not None else SWEEP_TIMINGS, plans, results, stats, started,
                             pace=pace)
        starts = restaged_starts(moves.globals, evaluate, timed, stats, started, deadline, pace)  # stageinit.py
        if not starts and stats.best is not None:  # nothing fit, or nothing was timed, in the sweep's share:
            starts = [stats.best]  # the best plan scored so far (a baseline) starts the chains
        if _past(deadline):
            return done(stats, False, 1, 0, 0)
    inits = [evaluate.planned(_initial(i, graph, n, rng, candidates, microbatches, schedule, plans, moves.globals,
                                       starts[init[:k].count("swept") % len(starts)] if i == "swept" and starts else None))
             for k, i in enumerate(init)]
    count = len(inits) if config.chains is None else config.chains
    if budget.proposals is not None:  # every chain makes a proposal at least
        count = min(count, budget.proposals)
    measures = getattr(cost, "measures", False)
    workers = default_workers(count, measures) if config.workers is None else config.workers
    if workers > 1 and measures:
        raise ValueError(f"search workers = {workers} with a cost model that times kernels: "
                         "chains timing at once would time each other; use workers=1")
    left = None if deadline is None else deadline - time.perf_counter()
    seconds = None if left is None else max(left, 1e-3) / -(-count // workers)  # per round
    work = [Chain(inits[i % len(inits)], seed,  # the proposals handed out, the first chains taking the rest
                  Budget(seconds, None if budget.proposals is None
                         else budget.proposals // count + (i < budget.proposals % count)))
            for i in range(count)]
    stats, interrupted = run_chains(work, evaluate, candidates, stats, started, beta=config.beta,
                                    reset_every=config.reset_every, workers=workers, on_step=on_step,
                                    neighbors=moves.spaces[microbatches].neighbors,
                                    blocks=moves.spaces[microbatches].blocks, moves=moves,
                                    replicas=config.replicas, patience=config.patience, pace=pace)
    if stats.best is None:  # interrupted before the first chain scored its start
        stats.best = inits[0]
    return done(stats, interrupted, min(workers, count), 0, 0)


def _past(deadline: float | None) -> bool:
    """The time budget is spent (``time.perf_counter()`` at or past ``deadline``)."""
    return deadline is not None and time.perf_counter() >= deadline


@dataclass(frozen=True)
class _Done:
    """What a search's result holds besides its stats: the SearchResult made from them."""

    evaluate: Evaluator
    graph: OpGraph
    topo: Topology
    results: dict[str, SimResult]
    plans: dict[str, Strategy]
    started: float
    unscored: list[str]

    def __call__(self, stats: ChainStats, interrupted: bool, workers: int, exhaustive: int,
                 space: int) -> SearchResult:
        best = stats.best_result  # a baseline's, and any plan's that led when scored, has its summary
        if best is None or not best.memory:  # (Evaluator.summarize_best): else simulated again
            best = self.evaluate(stats.best, summary=True)
        return SearchResult(stats.best, best, self.graph, self.topo,
                            baselines={k: r.iteration_ms for k, r in self.results.items()},
                            baseline_results=self.results, proposals=stats.proposals, scored=stats.scored,
                            elapsed_s=time.perf_counter() - self.started, interrupted=interrupted,
                            baseline_plans=self.plans, history=stats.history, accepted=stats.accepted,
                            block_accepted=stats.block_accepted, workers=workers, exhaustive=exhaustive,
                            space=space, unscored=tuple(self.unscored),
                            stopped_early=stats.stopped_early)
