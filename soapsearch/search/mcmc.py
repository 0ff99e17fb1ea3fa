"""Metropolis–Hastings over strategies (FlexFlow, Jia et al. 2019, section 6).

A proposal gives one random op one random valid config (of the same enumeration as everywhere:
``strategies.config.enumerate_configs``); with probability ``GROUP`` it also gives each of the
op's producers and consumers a random config on the same devices, where it has one (a layout
several ops share, e.g. all on one device, is reached in one move instead of through the costly
redistributions between them that single-op moves must cross; the reverse of such a move is not
always one, so the chain is a search, not an exact sampler). Where the graph has Megatron-shaped
blocks, a proposal is instead, with probability ``blockmove.BLOCK`` (0.1), a block move: one
block's column linears, middle ops and row linear set to one tensor-parallel (or data-parallel)
layout together (``blockmove.py``); before it, where the graph has repeated blocks, a proposal
is with probability ``MoveRates.repeat`` a repeated-block move: op i of every instance (a
transformer's layers) set alike (``repeatmove.py``), and before that, with probability
``MoveRates.factorization``, a global move: every op re-derived from another data × tensor ×
pipeline factorization, or the pipeline stages rebalanced (``globalmove.py``). With the rates of
``moves.MoveRates``, a proposal is instead a sharding-level, recompute or micro-batch move
(``moves.py``); an op, group or block move keeps each op's sharding level and recompute. Every
proposal is accepted with probability min(1, exp(−β · (cost(new) − cost(current)))) (Metropolis
et al. 1953), cost in milliseconds. A plan that does not fit in device memory costs its time ×
(1 + 10 · overflow), overflow being the worst device's peak / capacity − 1, so chains can cross
such plans; a proposal that fits is always accepted from one that does not, and plans are ranked
lexicographically (``rank``): any plan that fits beats any plan that does not, so the best is
one that fits whenever a chain has seen one.

β (per ms) is set from a pilot of proposals at the start (a median-worse proposal accepted with
probability 1/2) and annealed to greedy by the budget's end, over ``REPLICAS`` plans per chain
at different temperatures that exchange plans (parallel tempering); the coldest resets to the
best every ``reset_every`` of its proposals (``run_chain``). With β given, one plan walks at
that constant β and resets to the best every ``reset_every`` proposals. Either way a chain stops
early where its best has not improved for half its proposal budget (or
``SearchConfig.patience`` proposals; 0: never; a time budget alone is spent whole). The coldest
replica starts from the best plan scored before the chain (a baseline that beats the start).
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from simulator.result import SimResult
from simulator.simulate import paused_gc
from soapsearch.search.blockmove import BLOCK, BlockMoves
from soapsearch.search.moves import Moves, Space, candidate_configs, keep, neighbor_ops
from soapsearch.search.pace import SPACE, SUMMARY, Pace
from strategies.config import ParallelConfig
from strategies.errors import PlanError
from strategies.strategy import Strategy

__all__ = ["Budget", "ChainStats", "accept", "annealed", "candidate_configs", "consider", "exchange", "neighbor_ops",
           "pilot_beta", "plan_cost", "rank", "run_chain"]

OVERFLOW_PENALTY = 10.0
GROUP = 0.2
BETA_C = 200.0
"""The default inverse temperature is β = BETA_C / cost(init) per ms, so that under the
Metropolis acceptance rule exp(−β·Δcost) a proposal 0.5 % worse than the start is accepted with
probability 1/e (β·Δcost = 200 · 0.005 = 1), whatever the model's scale. A smaller constant lets
a chain drift through much worse plans, a larger one stalls it at its first local optimum
(the sweep that chose it, over the paper-scale models on p100-4x4: benchmarks/README.md,
search_vs_experts.py). With β given (``SearchConfig.beta``) it is constant; the default sets
it from a pilot (``PILOT``) and anneals it, and this constant is the pilot's fallback."""
PILOT = 32
"""Proposals at the start whose cost increases set the first temperature (their median is
accepted with probability 1/2)."""
ANNEAL = 100.0
"""β at the budget's end / β at its start: geometric annealing (Kirkpatrick, Gelatt & Vecchi
1983) to a greedy walk (a median-worse proposal then accepted with probability 2^-100)."""
REPLICAS = 4
"""Plans a chain walks at once, at temperatures spaced geometrically over ``LADDER``."""
LADDER = 64.0
"""β of the coldest replica / β of the hottest."""
SWEEP = 10
"""Proposals a replica makes in a row (the lowering's cache re-lowers only what changed since
the last plan it lowered, so a replica keeps the turn for a while)."""


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
    scored: int = 0
    """Proposals scored (simulated, or a plan the evaluator kept): ``proposals`` less the draws
    that made no plan (an op drawn its own config, a move with nothing to change, a change that
    cannot be made alike in every copy or an op move off the plan's tensor-parallel members,
    ``symmove.py``)."""
    stopped_early: int = 0
    """Chains that stopped before their budget's end, their best not improved for their
    patience (``run_chain``)."""


@dataclass
class _Replica:
    """One plan a chain holds and walks: the plan, its cost and whether it fits."""

    plan: Strategy
    cost: float
    fits: bool


@paused_gc()
def run_chain(init: Strategy, evaluate: Callable[[Strategy], SimResult],
              candidates: dict[str, list[ParallelConfig]], budget: Budget, rng: random.Random,
              beta: float | None = None, reset_every: int = 500, stats: ChainStats | None = None,
              started: float | None = None, should_stop: Callable[[], bool] = lambda: False,
              on_step: Callable[[ChainStats, float], None] | None = None,
              neighbors: dict[str, tuple[str, ...]] | None = None,
              blocks: BlockMoves | None = None, moves: Moves | None = None,
              replicas: int = REPLICAS, patience: int | None = None, pace: Pace | None = None) -> ChainStats:
    """One chain from ``init``. With ``beta`` (per ms) given, one plan walks at that constant
    inverse temperature (the chain resets it to its best every ``reset_every`` proposals).
    Without (the default), the
    temperature explores: a pilot of ``PILOT`` proposals at ``init`` sets β₀ = ln 2 / the median
    of their cost increases (a median-worse proposal accepted with probability 1/2; BETA_C /
    cost(init) where none is worse), annealed geometrically to ANNEAL · β₀ (greedy) by the
    budget's end; ``replicas`` plans walk at β, β·LADDER^(1/(R−1)), …, β·LADDER, each for
    SWEEP proposals in turn, and after every round adjacent replicas swap plans with
    probability min(1, exp((β_i − β_j)(c_i − c_j))) (parallel tempering, Swendsen & Wang 1986;
    Geyer 1991); the coldest resets to the best every ``reset_every`` proposals. Either
    chain stops early (``stats.stopped_early``) where its best has not improved for ``patience``
    proposals (None: for half its proposal budget, never under seconds alone; 0: never).
    The coldest replica starts from ``stats.best`` where that ranks before ``init`` (the
    search's baselines, or the pilot's best). Deterministic for ``rng``'s seed under a proposal budget. Runs with
    the cyclic collector paused (``paused_gc``). ``candidates`` are the op moves' configs where
    ``moves`` is None (every plan the chain holds then has one count of micro-batches); with
    ``moves``, every plan the chain holds (its start, a reset target, a swapped plan) proposes
    from ``moves.space`` of its own count; ``neighbors`` (op -> its producers and consumers,
    ``neighbor_ops``) enables the group moves, ``blocks`` (where it has any) the block moves;
    ``moves`` the sharding-level, recompute and micro-batch moves at its rates. Under
    ``budget.seconds`` a step predicted to end past them, with a summary's pass after it, does
    not start (``pace.Pace``: a proposal's drawing and scoring, kind "proposal/<move>", and once
    drawn its scoring, kind "score"; the chain's start, never timed, predicted by the steps
    before it); the chain ends there."""
    stats = stats or ChainStats()
    started = time.perf_counter() if started is None else started
    t0 = time.perf_counter()
    pace = Pace() if pace is None else pace
    end = None if budget.seconds is None else t0 + budget.seconds
    if stats.best is not None and not pace.fits("start", end, SUMMARY):  # predicted by the steps before
        return stats  # no room to score the start: the best scored before stands
    result = evaluate(init)  # not timed: a start scored before (the sweep's) takes no time
    consider(stats, init, result, plan_cost(result), started)
    if moves is not None and init.microbatches not in moves.spaces:  # a start at another count
        if not pace.fits(SPACE, end, SUMMARY):
            return stats
        with pace.timed(SPACE):  # its configs share the other counts' (candidates.ConfigSpace)
            moves.space(init.microbatches).ops
    first = Space(candidates, neighbors, blocks)
    rates = moves.rates if moves is not None else None
    cut = tuple(itertools.accumulate((rates.microbatches, rates.zero, rates.recompute, rates.subgraph))
                ) if rates is not None else None
    if cut is not None and not cut[-1]:  # no memory move: op, repeated-block and block moves alone
        cut = None

    def space(m: int) -> Space:  # the op moves' configs for the plan's own micro-batches
        return first if moves is None else moves.space(m)

    def pick(current: Strategy) -> str:
        """The kind of the next proposal from ``current`` (its draws come first)."""
        here = space(current.microbatches)
        u = rng.random() if cut is not None else 1.0
        if cut is not None and u < cut[-1]:
            return ("microbatches" if u < cut[0] else "zero" if u < cut[1]
                    else "recompute" if u < cut[2] else "subgraph")
        if moves is not None and moves.globals and rng.random() < rates.factorization:
            return "global"
        if moves is not None and moves.repeats and rng.random() < rates.repeat:
            return "repeat"
        if here.blocks and rng.random() < BLOCK:
            return "block"
        return "op"

    def propose(current: Strategy, kind: str) -> tuple[Strategy | None, bool]:
        """A proposal of ``kind`` (``pick``) from ``current`` (None: nothing to propose this
        time) and whether it is a block move."""
        here = space(current.microbatches)
        if kind in ("microbatches", "zero", "recompute", "subgraph"):
            return getattr(moves, kind)(current, rng), False
        if kind == "global":
            return moves.globals.propose(current, rng), False
        if kind == "repeat":
            return moves.repeated(current, rng), False
        if kind == "block":
            return here.blocks.propose(current, rng), True
        if not here.ops:
            return None, False
        op = rng.choice(here.ops)
        cfg = keep(current[op], rng.choice(here.candidates[op]))
        if cfg == current[op]:
            return None, False
        proposal = current.replace(op, cfg)
        if here.neighbors and rng.random() < GROUP:
            for other in here.neighbors.get(op, ()):
                same = here.on_devices(other, cfg.devices)
                if same:
                    proposal = proposal.replace(other, keep(current[other], rng.choice(same)))
        return proposal, False

    if moves is not None and moves.symmetric is not None:  # the same change in every copy (symmove.py)
        propose = moves.symmetric.wrap(propose)

    n = 0
    gain_n = 0  # proposals at the last improvement
    stalled = late = False

    def stall() -> bool:
        """The best not improved for ``patience`` proposals (None: half the proposal budget;
        a time budget alone is spent whole, its annealing ending greedy at its end)."""
        if patience is not None:
            return 0 < patience <= n - gain_n
        return budget.proposals is not None and n - gain_n > budget.proposals / 2

    def spent() -> float | None:
        """The budget's fraction used (None: stop now)."""
        nonlocal stalled
        if late or should_stop():
            return None
        elapsed = time.perf_counter() - t0
        used = 0.0
        if budget.seconds is not None:
            if elapsed >= budget.seconds:
                return None
            used = elapsed / budget.seconds
        if budget.proposals is not None:
            if n >= budget.proposals:
                return None
            used = max(used, n / budget.proposals)
        if stall():
            stalled = True
            return None
        return used

    def score(proposal: Strategy) -> tuple[SimResult | None, float]:
        """(its result, its cost); (None, inf) where the lowering refuses the plan (a rule only
        it checks, strategies.zero: each level-2/3 use pairs up): a rejected proposal."""
        nonlocal n, gain_n
        n += 1
        stats.proposals += 1
        stats.scored += 1
        try:
            with pace.timed("score"):
                res = evaluate(proposal)
        except PlanError:
            return None, math.inf
        cost = plan_cost(res)
        if consider(stats, proposal, res, cost, started):
            gain_n = n
        return res, cost

    fixed = beta is not None
    chain = [_Replica(init, plan_cost(result), result.fits)]
    if not fixed:  # the pilot: the spread of cost increases around the start
        worse = []
        for _ in range(PILOT):
            if not (first.ops or cut) or spent() is None:
                break
            kind = pick(init)
            if not pace.fits(f"proposal/{kind}", end, SUMMARY):
                late = True
                break
            t = time.perf_counter()
            proposal, _ = propose(init, kind)
            if proposal is not None and not pace.fits("score", end, SUMMARY):
                late = True
                break
            if proposal is not None:
                _, cost = score(proposal)
                if chain[0].cost < cost < math.inf:
                    worse.append(cost - chain[0].cost)
            pace.record(f"proposal/{kind}", time.perf_counter() - t)
        beta = pilot_beta(worse, chain[0].cost)
        chain += [_Replica(init, chain[0].cost, chain[0].fits) for _ in range(max(1, replicas) - 1)]
        if len(chain) > 1 and stats.best is not init and (moves is not None or
                                                           stats.best.microbatches == init.microbatches):
            # the coldest walks from the best scored so far (a baseline, or the pilot's best)
            chain[-1] = _Replica(stats.best, stats.best_cost, stats.best_result.fits)
    ladder = [1.0] if len(chain) == 1 else [LADDER ** (k / (len(chain) - 1)) for k in range(len(chain))]
    turn, walked, cold = 0, 0, 0  # the replica walking, its proposals this sweep, the coldest's in all
    while first.ops or cut:
        used = spent()
        if used is None:
            break
        b = (beta if fixed else annealed(beta, used)) * ladder[turn]
        me = chain[turn]
        kind = pick(me.plan)
        if not pace.fits(f"proposal/{kind}", end, SUMMARY):  # predicted to end past the budget: the chain ends here
            break
        t = time.perf_counter()
        proposal, block = propose(me.plan, kind)
        if proposal is not None and not pace.fits("score", end, SUMMARY):  # its drawing ran long
            break
        if proposal is not None:
            res, cost = score(proposal)
            if res is not None and accept(res.fits, cost, me.fits, me.cost, b, rng):
                me.plan, me.cost, me.fits = proposal, cost, res.fits
                stats.accepted += 1
                stats.block_accepted += block
        else:
            n += 1
            stats.proposals += 1
        pace.record(f"proposal/{kind}", time.perf_counter() - t)
        walked += 1
        cold += turn == len(chain) - 1
        if reset_every and turn == len(chain) - 1 and cold % reset_every == 0 and stats.best is not None:
            me.plan, me.cost, me.fits = stats.best, stats.best_cost, stats.best_result.fits
        if len(chain) > 1 and walked >= SWEEP:
            walked, turn = 0, (turn + 1) % len(chain)
            if turn == 0:  # a round over: adjacent replicas exchange plans
                exchange(chain, [annealed(beta, used) * x for x in ladder], rng)
        if on_step:
            on_step(stats, me.cost)
    stats.stopped_early += stalled
    return stats


def pilot_beta(worse: list[float], cost: float) -> float:
    """β₀ from the pilot's cost increases (ms): ln 2 / their median, so that a median-worse
    proposal is accepted with probability 1/2; BETA_C / ``cost`` where none was worse."""
    return math.log(2) / statistics.median(worse) if worse else BETA_C / max(cost, 1e-9)


def annealed(beta: float, used: float) -> float:
    """β after the fraction ``used`` of the budget: β · ANNEAL^used (geometric annealing)."""
    return beta * ANNEAL ** used


def exchange(chain: list, betas: list[float], rng: random.Random) -> None:
    """Parallel tempering's swap of the adjacent pairs (i, i+1), the even or the odd ones
    (drawn): each accepted with probability min(1, exp((β_i − β_j)(c_i − c_j))) on ``plan_cost``."""
    for i in range(rng.randrange(2), len(chain) - 1, 2):
        a, b = chain[i], chain[i + 1]
        x = (betas[i] - betas[i + 1]) * (a.cost - b.cost)
        if x >= 0 or rng.random() < math.exp(x):
            chain[i], chain[i + 1] = b, a


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
