"""The stage partitioner as an init: the chains start from the best pipelined plans of the
factorization sweep with their stages set by PipeDream's dynamic program over the units'
simulated compute times (``stagemove.restage``), not only from the sweep's even split of the
blocks (``strategies.megatron``: the blocks alone split evenly, the ops before and after them
on the first and last stage). Each restaged plan is scored, considered for the answer and
replaces its plan among the starts where it ranks before it (``mcmc.rank``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.result import SimResult
from soapsearch.search.mcmc import ChainStats, consider, plan_cost, rank
from soapsearch.search.pace import SUMMARY, Pace
from soapsearch.search.stagemove import restage, stage_count
from strategies.errors import PlanError
from strategies.strategy import Strategy

if TYPE_CHECKING:
    from soapsearch.search.api import Evaluator
    from soapsearch.search.globalmove import GlobalMoves

__all__ = ["RESTAGED_STARTS", "restaged_starts"]

RESTAGED_STARTS = 2
"""Pipelined plans of the sweep's ranking restaged as starts, the best first (0: none)."""


def restaged_starts(moves: "GlobalMoves", evaluate: "Evaluator", starts: list[tuple[Strategy, SimResult]],
                    stats: ChainStats, started: float, deadline: float | None, pace: Pace,
                    count: int | None = None) -> list[Strategy]:
    """The plans of ``starts`` (the sweep's timed plans with their results, by rank) with each
    of the ``count`` (default ``RESTAGED_STARTS``) best pipelined ones (not interleaved)
    restaged by ``moves.op_seconds``; the restaged plan scored, considered in ``stats`` and
    remembered, and put in its plan's place where it ranks before it; the list sorted by rank
    again (stable). Ranked by the results given, so no start is simulated again however many
    the sweep timed. A restage predicted to end past ``deadline`` (kind "restage": the op times,
    the dynamic program and the scoring, with a summary's pass after it) is not made."""
    count = RESTAGED_STARTS if count is None else count
    out = list(starts)
    made = 0
    for k, (plan, old) in enumerate(starts):
        if made >= count:
            break
        if plan.schedule == "interleaved":
            continue
        if stage_count(moves.graph, plan, moves.units) == 1:
            continue
        made += 1
        if not pace.fits("restage", deadline, SUMMARY):
            break
        with pace.timed("restage"):
            new = restage(moves.graph, plan, moves.op_seconds, moves.units)
            try:
                result = None if new is None else evaluate(new)
            except PlanError:  # a rule only the lowering checks: no start
                result = None
        if result is None:
            continue
        cost = plan_cost(result)
        consider(stats, new, result, cost, started)
        evaluate.remember(new, result)  # the chain starting from it does not simulate it again
        if rank(result.fits, cost) < rank(old.fits, plan_cost(old)):
            out[k] = (new, result)
    out.sort(key=lambda s: rank(s[1].fits, plan_cost(s[1])))
    return [plan for plan, _ in out]
