"""Metropolis–Hastings over strategies (FlexFlow, Jia et al. 2019, section 6).

A proposal gives one random op one random valid config (of the same enumeration as everywhere:
``strategies.config.enumerate_configs``); with probability ``GROUP`` it also gives each of the
op's producers and consumers a random config on the same devices, where it has one (a layout
several ops share, e.g. all on one device, is reached in one move instead of through the costly
redistributions between them that single-op moves must cross; the reverse of such a move is
not always one, so the chain is a search, not an exact sampler). Where the graph has
Megatron-shaped blocks, a proposal is instead, with probability ``blockmove.BLOCK`` (0.1), a
block move: one block's column linears, middle ops and row linear set to one tensor-parallel
(or data-parallel) layout together (``blockmove.py``). With the rates of ``moves.MoveRates``, a
proposal is instead a sharding-level, recompute or micro-batch move (``moves.py``); an op,
group or block move keeps each op's sharding level and recompute. Every proposal is accepted
with probability min(1, exp(−β · (cost(new) − cost(current)))) (Metropolis et al. 1953), cost
in milliseconds. A plan that does not fit in device memory costs its time × (1 + 10 ·
overflow), overflow being the worst device's peak / capacity − 1, so chains can cross such
plans; a proposal that fits is always accepted from one that does not, and plans are ranked
lexicographically (``rank``): any plan that fits beats any plan that does not, so the best is
one that fits whenever a chain has seen one. A chain resets to the best plan every
``reset_every`` proposals, and stops early when the best has not improved for half its budget.
"""

from __future__ import annotations

import math
import numbers
import operator
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from simulator.result import SimResult
from simulator.simulate import paused_gc
from soapsearch.search.blockmove import BLOCK, BlockMoves
from soapsearch.search.moves import Moves, Space, keep, neighbor_ops
from strategies.config import ParallelConfig, enumerate_configs
from strategies.graph import OpGraph
from strategies.strategy import Strategy

__all__ = ["Budget", "ChainStats", "accept", "candidate_configs", "consider", "neighbor_ops", "plan_cost", "rank",
           "run_chain"]

OVERFLOW_PENALTY = 10.0
GROUP = 0.2
BETA_C = 200.0
"""The default inverse temperature is β = BETA_C / cost(init) per ms, so that under the
Metropolis acceptance rule exp(−β·Δcost) a proposal 0.5 % worse than the start is accepted with
probability 1/e (β·Δcost = 200 · 0.005 = 1), whatever the model's scale. A smaller constant lets
a chain drift through much worse plans, a larger one stalls it at its first local optimum
(the sweep that chose it, over the paper-scale models on p100-4x4: benchmarks/README.md,
search_vs_experts.py)."""


def whole(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def positive(value: object) -> bool:
    """A finite real number > 0 (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def plan_cost(result: SimResult) -> float:
    """Milliseconds, penalized when the plan does not fit (see the module docstring)."""
    ms = result.iteration_ms
    if result.fits:
        return ms
    overflow = max(p / c for p, c in zip(result.peak_memory_bytes, result.memory_capacity)) - 1
    return ms * (1 + OVERFLOW_PENALTY * overflow)


@dataclass
class Budget:
    """Stop after ``seconds`` or ``proposals`` (whichever comes first; None: no limit)."""

    seconds: float | None = None
    proposals: int | None = None

    def __post_init__(self) -> None:
        if self.seconds is None and self.proposals is None:
            raise ValueError("a search budget needs seconds or proposals (or both)")
        s, p = self.seconds, self.proposals
        if s is not None and not positive(s):
            raise ValueError(f"budget seconds = {s!r}: must be a finite number > 0")
        if p is not None and not (whole(p) and p >= 1):
            raise ValueError(f"budget proposals = {p!r}: must be a whole number >= 1")


@dataclass
class ChainStats:
    proposals: int = 0
    accepted: int = 0
    best_cost: float = math.inf
    best: Strategy | None = None
    best_result: SimResult | None = None
    history: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since the search started, proposals so far, best ms) at each improvement."""
    ranks: list[tuple[bool, float]] = field(default_factory=list)
    """(fits, cost) of each ``history`` entry: what ``consider`` compared (chains.merge)."""
    block_accepted: int = 0
    """Accepted block moves (``blockmove.py``)."""


def candidate_configs(graph: OpGraph, num_devices: int, microbatches: int,
                      node_size: int | None) -> dict[str, list[ParallelConfig]]:
    """Every valid config of every op (computed once per search)."""
    return {n.name: list(enumerate_configs(n, num_devices, microbatches, node_size)) for n in graph}


@paused_gc()
def run_chain(init: Strategy, evaluate: Callable[[Strategy], SimResult],
              candidates: dict[str, list[ParallelConfig]], budget: Budget, rng: random.Random,
              beta: float | None = None, reset_every: int = 500, stats: ChainStats | None = None,
              started: float | None = None, should_stop: Callable[[], bool] = lambda: False,
              on_step: Callable[[ChainStats, float], None] | None = None,
              neighbors: dict[str, tuple[str, ...]] | None = None,
              blocks: BlockMoves | None = None, moves: Moves | None = None) -> ChainStats:
    """One chain from ``init``. ``beta`` (per ms) defaults to BETA_C / cost(init) (200: a
    proposal 0.5 % worse than the start is accepted with probability 1/e). Runs with the
    cyclic collector paused (``paused_gc``). ``candidates`` are the op moves' configs where
    ``moves`` is None (every plan the chain holds then has one count of micro-batches); with
    ``moves``, every plan the chain holds (its start, a reset target) proposes from
    ``moves.space`` of its own count; ``neighbors`` (op -> its producers and consumers,
    ``neighbor_ops``) enables the group moves, ``blocks`` (where it has any) the block moves;
    ``moves`` the sharding-level, recompute and micro-batch moves at its rates, and the op
    moves' configs for other counts of micro-batches (``moves.Moves.space``)."""
    stats = stats or ChainStats()
    started = time.perf_counter() if started is None else started
    t0 = time.perf_counter()
    current = init
    result = evaluate(current)
    cur_cost, cur_fits = plan_cost(result), result.fits
    beta = BETA_C / max(cur_cost, 1e-9) if beta is None else beta
    consider(stats, current, result, cur_cost, started)
    first = Space(candidates, neighbors, blocks)
    rates = moves.rates if moves is not None else None
    cut = (rates.microbatches, rates.microbatches + rates.zero,
           rates.microbatches + rates.zero + rates.recompute) if rates is not None else None
    if cut is not None and not cut[-1]:  # no memory move: op and block moves alone
        cut = None

    def space(m: int) -> Space:  # the op moves' configs for the plan's own micro-batches
        return first if moves is None else moves.space(m)

    gain_n, gain_t, n = 0, 0.0, 0  # proposals and seconds at the last improvement
    while (first.ops or cut) and not should_stop():
        elapsed = time.perf_counter() - t0
        if budget.seconds is not None and (elapsed >= budget.seconds or elapsed - gain_t > budget.seconds / 2):
            break
        if budget.proposals is not None and (n >= budget.proposals or n - gain_n > budget.proposals / 2):
            break
        n += 1
        stats.proposals += 1
        here = space(current.microbatches)
        u = rng.random() if cut is not None else 1.0
        block = False
        if cut is not None and u < cut[-1]:
            proposal = (moves.microbatches if u < cut[0] else moves.zero if u < cut[1] else moves.recompute)(current, rng)
        elif here.blocks and rng.random() < BLOCK:
            block = True
            proposal = here.blocks.propose(current, rng)
        elif here.ops:
            op = rng.choice(here.ops)
            cfg = keep(current[op], rng.choice(here.candidates[op]))
            proposal = None if cfg == current[op] else current.replace(op, cfg)
            if proposal is not None and here.neighbors and rng.random() < GROUP:
                for other in here.neighbors.get(op, ()):
                    same = here.on_devices.get((other, cfg.devices))
                    if same:
                        proposal = proposal.replace(other, keep(current[other], rng.choice(same)))
        else:
            proposal = None
        if proposal is not None:
            res = evaluate(proposal)
            cost = plan_cost(res)
            if accept(res.fits, cost, cur_fits, cur_cost, beta, rng):
                current, cur_cost, cur_fits = proposal, cost, res.fits
                stats.accepted += 1
                stats.block_accepted += block
                if consider(stats, current, res, cost, started):
                    gain_n, gain_t = n, time.perf_counter() - t0
        if reset_every and n % reset_every == 0 and stats.best is not None:
            current, cur_cost, cur_fits = stats.best, stats.best_cost, stats.best_result.fits
        if on_step:
            on_step(stats, cur_cost)
    return stats


def accept(fits: bool, cost: float, cur_fits: bool, cur_cost: float, beta: float, rng: random.Random) -> bool:
    """The Metropolis rule min(1, exp(−β·(cost − cur_cost))) on ``plan_cost``, except that a
    proposal that fits is always accepted from a plan that does not (the lexicographic rule of
    ``rank``; the other way the penalized cost lets a chain cross plans that do not fit)."""
    if fits and not cur_fits:
        return True
    return cost <= cur_cost or rng.random() < math.exp(-beta * (cost - cur_cost))


def rank(fits: bool, cost: float) -> tuple[bool, float]:
    """The search's order of plans, least first: any plan that fits before any that does not,
    then by cost (``plan_cost``). ``consider``, ``chains.merge`` and the study's best trial use
    it."""
    return (not fits, cost)


def consider(stats: ChainStats, plan: Strategy, result: SimResult, cost: float, started: float) -> bool:
    """Record ``plan`` as the best if it ranks before it (``rank``: fitting plans always beat
    ones that do not)."""
    best = stats.best_result
    better = best is None or rank(result.fits, cost) < rank(best.fits, stats.best_cost)
    if better:
        stats.best, stats.best_cost, stats.best_result = plan, cost, result
        stats.history.append((time.perf_counter() - started, stats.proposals, result.iteration_ms))
        stats.ranks.append((result.fits, cost))
    return better
