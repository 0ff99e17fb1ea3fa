"""study_search(): an optuna outer loop over the global knobs one per-op MCMC chain cannot move.

Each trial picks the number of devices used, micro-batches, pipeline schedule, the MCMC β (as a
factor of the default 20 / cost(init)) and the initial plan, runs one short chain from it
(``mcmc.run_chain``, with the search's sharding-level, recompute and micro-batch moves) and
reports the best plan's cost (``plan_cost``: ms, penalized when the plan does not fit); the
study's answer is its best trial by ``mcmc.rank`` (any plan that fits before any that does not). The sampler is TPE (Bergstra, Bardenet, Bengio, Kégl, "Algorithms for
Hyper-Parameter Optimization", NeurIPS 2011). The expert baselines are the first trials.
Every trial stores its plan (strategy JSON v1) as a user attribute, so a study kept in a
storage resumes with its best plan.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from simulator.cost import CostModel, get_cost_model
from simulator.presets import get_topology
from simulator.result import SimResult
from simulator.topology import Topology
from soapsearch.api import DEFAULT_TOPOLOGY
from soapsearch.search.api import Evaluator, FoundPlan, best_baselines
from soapsearch.search.moves import MoveRates, Moves
from soapsearch.search.chains import chain_rng
from soapsearch.search.config import SearchConfig, search_config
from soapsearch.search.mcmc import (
    BETA_C,
    Budget,
    ChainStats,
    plan_cost,
    rank,
    run_chain,
    whole,
)
from strategies import OpGraph, PlanError, Strategy, load_strategy
from strategies.baselines import BASELINES, hybrid, pipeline
from strategies.megatron import megatron, megatron_blocks
from strategies.pieces import check_microbatches
from strategies.serialize import strategy_to_json

__all__ = ["StudyResult", "TrialRecord", "open_storage", "study_search"]

INITS = ("data_parallel", "hybrid", "owt", "model_parallel", "pipeline", "random", "zero1", "fsdp", "single_device")
MICROBATCHES = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
BETA_SCALE = (0.1, 10.0)
"""β is drawn log-uniform in this range times the default BETA_C / cost(init) (mcmc.run_chain)."""
DEFAULT_TRIAL_PROPOSALS = 200
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialRecord:
    number: int
    params: dict[str, Any]
    value: float | None
    """plan_cost of the trial's best plan (ms; penalized when it does not fit); None if pruned."""
    iteration_ms: float | None
    proposals: int
    baseline: str | None
    """The expert plan this trial started from when it was one of the enqueued first trials."""


@dataclass
class StudyResult(FoundPlan):
    trials: list[TrialRecord] = field(default_factory=list)
    study: optuna.Study | None = field(default=None, repr=False)

    @property
    def best_params(self) -> dict[str, Any]:
        complete = self.study is not None and any(t.state == optuna.trial.TrialState.COMPLETE
                                                  for t in self.study.trials)
        return dict(self.study.best_params) if complete else {}


def open_storage(storage: Any) -> Any:
    """None, an optuna storage, an RDB URL (``sqlite:///study.db``) or a journal file path
    ending ``.log``/``.jsonl``; anything else is a ValueError naming it."""
    if storage is None or isinstance(storage, optuna.storages.BaseStorage):
        return storage
    text = os.fspath(storage) if isinstance(storage, (str, os.PathLike)) else None
    if text is None:
        raise ValueError(f"storage {storage!r}: expected an 'sqlite:///path.db' URL, a journal "
                         "path ending .log or .jsonl, or an optuna storage")
    if "://" in text:
        return text
    if text.endswith((".log", ".jsonl")):
        try:
            from optuna.storages.journal import JournalFileBackend as backend
        except ImportError:  # optuna < 4.0
            from optuna.storages import JournalFileStorage as backend
        try:
            return optuna.storages.JournalStorage(backend(text))
        except Exception as e:
            raise ValueError(f"storage {text!r}: cannot open the journal file: {e}") from e
    raise ValueError(f"storage {text!r}: expected an 'sqlite:///path.db' URL or a journal path "
                     "ending .log or .jsonl")


def _device_choices(topo: Topology, given: Sequence[int] | None) -> list[int]:
    if given:
        bad = [n for n in given if not 1 <= n <= topo.num_devices]
        if bad:
            raise ValueError(f"num_devices_choices {bad}: each must be in 1..{topo.num_devices} "
                             f"(the devices of {topo.name!r})")
        return sorted(set(given))
    out = [1 << k for k in range(topo.num_devices.bit_length()) if 1 << k <= topo.num_devices]
    return out if out[-1] == topo.num_devices else out + [topo.num_devices]


def _takes(graph: OpGraph, m: int) -> bool:
    """Whether every op keeps the samples of ``m`` micro-batches apart (``check_microbatches``)."""
    try:
        check_microbatches(graph, m)
    except PlanError:
        return False
    return True


class _Trials:
    """The objective, with an Evaluator per device count and candidate configs per (devices,
    micro-batches) shared by all trials (so unchanged ops' lowerings are reused across trials)."""

    def __init__(self, graph: OpGraph, topo: Topology, cost: CostModel, optimizer: str, seed: int,
                 budget: tuple[float | None, int | None], deadline: float | None,
                 device_choices: list[int], microbatch_choices: list[int], precision: str = "model",
                 rates: MoveRates = MoveRates(), reduce_dtype: str = "compute"):
        self.graph, self.topo, self.cost, self.optimizer, self.seed = graph, topo, cost, optimizer, seed
        self.precision, self.reduce_dtype = precision, reduce_dtype
        self.budget, self.deadline = budget, deadline
        self.device_choices, self.microbatch_choices = device_choices, microbatch_choices
        self.inits = INITS + (("megatron",) if megatron_blocks(graph) else ())
        """The initial plans trials choose from (megatron where the graph has transformer
        blocks): a resumed study keeps those it was made with (optuna refuses a categorical
        whose choices changed)."""
        self.rates = rates
        self._evaluators: dict[int, Evaluator] = {}
        self._moves: dict[int, Moves] = {}
        self.plans: dict[int, Strategy] = {}  # trial number -> its best plan (this process)
        self.proposals = 0
        self.scored = 0  # of them, the proposals scored (ChainStats.scored)

    def evaluator(self, n: int) -> Evaluator:
        if n not in self._evaluators:
            self._evaluators[n] = Evaluator(self.graph, self.topo, self.cost, self.optimizer, self.precision,
                                            reduce_dtype=self.reduce_dtype)
        return self._evaluators[n]

    def moves(self, n: int) -> Moves:
        """The moves of a chain on n devices; their ``space(m)`` holds every op's configs, the
        group moves' neighbours and the block moves per count of micro-batches."""
        if n not in self._moves:
            node = self.topo.node_size if self.topo.node_size and self.topo.node_size < n else None
            self._moves[n] = Moves(self.graph, n, self.rates, self.microbatch_choices, node)
        return self._moves[n]

    def candidates(self, n: int, m: int) -> tuple[dict, dict]:
        """Every op's configs and the ops the group moves pair (``neighbor_ops``), per (n, m)."""
        space = self.moves(n).space(m)
        return space.candidates, space.neighbors

    def initial(self, init: str, n: int, m: int, schedule: str, rng: random.Random) -> Strategy:
        g = self.graph
        if init == "random":
            return Strategy.of({op: rng.choice(c) for op, c in self.candidates(n, m)[0].items()},
                               n, m, schedule)
        if init == "pipeline":
            return pipeline(g, n, m, schedule)
        if init == "megatron":  # its configs cut each micro-batch
            return megatron(g, n, microbatches=m).with_microbatches(m, schedule)
        plan = hybrid(g, n, m) if init == "hybrid" else BASELINES[init](g, n)
        return plan.with_microbatches(m, schedule)

    def __call__(self, trial: optuna.Trial) -> float:
        n = trial.suggest_categorical("num_devices", self.device_choices)
        m = trial.suggest_categorical("microbatches", self.microbatch_choices)
        schedule = trial.suggest_categorical("schedule", list(SCHEDULES))
        init = trial.suggest_categorical("init", list(self.inits))
        scale = trial.suggest_float("beta_scale", *BETA_SCALE, log=True)
        rng = chain_rng(self.seed, trial.number)
        try:
            start = self.evaluator(n).planned(self.initial(init, n, m, schedule, rng))
            start.validate(self.graph)
        except PlanError as e:
            raise optuna.TrialPruned(f"no {init} plan with {n} devices, {m} micro-batches: {e}")
        evaluate = self.evaluator(n)
        beta = scale * BETA_C / max(plan_cost(evaluate(start)), 1e-9)
        seconds, proposals = self.budget
        if self.deadline is not None:
            left = self.deadline - time.perf_counter()
            if left <= 0:
                trial.study.stop()
                raise optuna.TrialPruned("the study's time budget is spent")
            seconds = left if seconds is None else min(seconds, left)
        stats = ChainStats()
        try:
            candidates, neighbors = self.candidates(n, m)
            run_chain(start, evaluate, candidates, Budget(seconds, proposals), rng, beta, stats=stats,
                      neighbors=neighbors, blocks=self.moves(n).space(m).blocks, moves=self.moves(n))
        except RuntimeError as e:  # a simulator error ends this chain, not the study
            log.warning("trial %d: chain stopped after %d proposals: %s", trial.number,
                        stats.proposals, str(e)[:200])
            trial.set_user_attr("error", str(e)[:500])
            if stats.best is None:
                return math.nan  # optuna fails the trial
        self.proposals += stats.proposals
        self.scored += stats.scored
        self.plans[trial.number] = stats.best
        trial.set_user_attr("iteration_ms", stats.best_result.iteration_ms)
        trial.set_user_attr("fits", stats.best_result.fits)
        trial.set_user_attr("proposals", stats.proposals)
        trial.set_user_attr("plan", strategy_to_json(stats.best, self.graph, topology=self.topo.name))
        return stats.best_cost


def study_search(graph: OpGraph, *, topology: Topology | str = DEFAULT_TOPOLOGY,
                 config: SearchConfig | None = None, trials: int | None = None,
                 trial_budget_s: float | None = None, trial_proposals: int | None = None,
                 storage: Any = None, study_name: str | None = None,
                 num_devices_choices: Sequence[int] | None = None, verbose: bool = False,
                 **fields: Any) -> StudyResult:
    """Run (or resume, with ``storage`` and ``study_name``) a TPE study of short MCMC chains;
    stop after ``trials`` new trials or ``config.budget_s`` seconds, whichever comes first.
    ``config`` (default ``SearchConfig(budget_s=None)``: no time limit, so ``trials`` bounds
    the study) gives the budget, ``seed``, ``cost_model`` and ``optimizer``, and ``proposals``
    as each trial's (``trial_proposals`` replaces it); keyword arguments named after its fields
    replace them. The trials choose the devices, micro-batches, schedule, β and initial plan
    themselves. Each trial gets ``trial_budget_s`` seconds and/or ``trial_proposals``
    proposals (default: an even share of ``budget_s`` over ``trials``, else 200 proposals).
    Deterministic for a seed when no time limit binds."""
    config = search_config(SearchConfig(budget_s=None) if config is None else config, fields, "study_search")
    budget_s, seed = config.budget_s, config.seed
    if trial_proposals is None:
        trial_proposals = config.proposals
    if budget_s is None and trials is None:
        raise ValueError("study_search needs budget_s or trials (or both)")
    if trials is not None and not (whole(trials) and trials >= 1):
        raise ValueError(f"study_search trials = {trials!r}: must be a whole number >= 1")
    for name, value in (("trial_budget_s", trial_budget_s), ("trial_proposals", trial_proposals)):
        if value is not None:
            Budget(**{"proposals" if name == "trial_proposals" else "seconds": value})  # the same rules as a chain's
    topo = get_topology(topology) if isinstance(topology, (str, os.PathLike)) else topology
    cost = get_cost_model(config.cost_model) if isinstance(config.cost_model, str) else config.cost_model
    if trial_budget_s is None and trial_proposals is None:
        if budget_s is not None and trials:
            trial_budget_s = budget_s / trials
        elif budget_s is not None:
            trial_budget_s = budget_s / 10
        else:
            trial_proposals = DEFAULT_TRIAL_PROPOSALS
    started = time.perf_counter()
    deadline = started + budget_s if budget_s is not None else None
    batch = graph.batch_size
    objective = _Trials(graph, topo, cost, config.optimizer, seed, (trial_budget_s, trial_proposals), deadline,
                        _device_choices(topo, num_devices_choices),
                        [m for m in MICROBATCHES if (not batch or batch % m == 0) and _takes(graph, m)],
                        config.precision, MoveRates.of(config, factorization=False), config.reduce_dtype)
    full = topo.num_devices if num_devices_choices is None else max(objective.device_choices)
    plans, results = best_baselines(graph, full, objective.evaluator(full))

    verbosity = optuna.logging.get_verbosity()
    if not verbose:
        optuna.logging.set_verbosity(logging.WARNING)
    try:
        try:
            study = optuna.create_study(
                storage=open_storage(storage), study_name=study_name, direction="minimize",
                sampler=optuna.samplers.TPESampler(seed=seed), load_if_exists=True)
        except Exception as e:
            raise ValueError(f"storage {storage!r}: cannot open the study: {e}") from e
        _check_same_problem(study, graph, topo)
        made_with = [t.distributions["init"].choices for t in study.trials if "init" in t.distributions]
        if made_with:  # a resumed study keeps the initial plans it was made with
            objective.inits = tuple(made_with[0])
        if not study.trials:  # a fresh study: the experts go first
            for name, plan in plans.items():
                study.enqueue_trial({"num_devices": full, "microbatches": plan.microbatches,
                                     "schedule": plan.schedule, "init": name, "beta_scale": 1.0},
                                    user_attrs={"baseline": name})
        done = len(study.trials)
        study.optimize(objective, n_trials=trials, timeout=budget_s, gc_after_trial=False)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return _result(study, objective, graph, topo, results, done, started, plans)


def _check_same_problem(study: optuna.Study, graph: OpGraph, topo: Topology) -> None:
    attrs = study.user_attrs
    mine = {"fingerprint": graph.fingerprint(), "topology": topo.name}
    if not attrs:
        for k, v in mine.items():
            study.set_user_attr(k, v)
        return
    for k, v in mine.items():
        if attrs.get(k) != v:
            raise ValueError(f"study {study.study_name!r}: {k} is {attrs.get(k)!r} in the storage, "
                             f"{v!r} here; resume a study only for the same model and topology")


def _result(study: optuna.Study, objective: _Trials, graph: OpGraph, topo: Topology,
            results: dict[str, SimResult], done_before: int, started: float,
            plans: dict[str, Strategy] | None = None) -> StudyResult:
    """The best complete trial, or a scored baseline where one ranks before it (a study stopped
    before its enqueued baselines all ran is never worse than any of them)."""
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    expert = min(results, key=lambda k: rank(results[k].fits, plan_cost(results[k])), default=None) if plans else None
    best = min(complete, key=lambda t: (rank(t.user_attrs.get("fits", True), t.value), t.number), default=None)
    if best is None and expert is None:
        raise RuntimeError(f"study {study.study_name!r} has no complete trial and no scored baseline")
    if best is None or (expert is not None and rank(results[expert].fits, plan_cost(results[expert])) < rank(
            best.user_attrs.get("fits", True), best.value)):  # a budget spent before any trial ended: the best expert
        plan = plans[expert]
    else:
        plan = objective.plans.get(best.number) or load_strategy(best.user_attrs["plan"], graph)
    result = objective.evaluator(plan.num_devices)(plan, summary=True)
    records = [TrialRecord(t.number, dict(t.params), t.value, t.user_attrs.get("iteration_ms"),
                           t.user_attrs.get("proposals", 0), t.user_attrs.get("baseline"))
               for t in study.trials if t.state != optuna.trial.TrialState.WAITING]  # enqueued, never run: no params
    return StudyResult(plan, result, graph, topo,
                       baselines={k: r.iteration_ms for k, r in results.items()},
                       baseline_results=results, proposals=objective.proposals, scored=objective.scored,
                       elapsed_s=time.perf_counter() - started, trials=records, study=study)
