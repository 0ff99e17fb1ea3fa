"""The exact answer when the space is small (issue 23): every combination of the ops' configs
(``mcmc.candidate_configs``, at the search's micro-batches, each op at ZeRO level 0 without
recompute) simulated, in a reflected mixed-radix Gray code order (Knuth, TAOCP 7.2.1.1,
Algorithm H's order) so that each plan differs from the one before in one op and the lowering's
cache re-lowers that op alone (delta simulation). The best by ``mcmc.rank`` wins, the first in
that order on a tie: deterministic."""

from __future__ import annotations

import math
from typing import Callable, Iterator

from simulator.result import SimResult
from soapsearch.search.mcmc import ChainStats, consider, plan_cost
from soapsearch.search.pace import SUMMARY, Pace
from strategies.config import ParallelConfig
from strategies.strategy import Strategy

__all__ = ["gray_plans", "search_exhaustively", "space_size"]


def space_size(candidates: dict[str, list[ParallelConfig]]) -> int:
    """How many plans the op configs make: the product of each op's count."""
    return math.prod(len(cfgs) for cfgs in candidates.values())


def gray_plans(candidates: dict[str, list[ParallelConfig]], num_devices: int, microbatches: int = 1,
               schedule: str = "gpipe", precision: str = "model") -> Iterator[Strategy]:
    """Every plan of ``candidates`` once, each differing from the one before in one op's config
    (the reflected mixed-radix Gray code: the lowest op that can step in its direction steps,
    every lower one turning round)."""
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    digit = {op: 0 for op in ops}
    up = {op: True for op in ops}
    plan = Strategy.of({op: cfgs[0] for op, cfgs in candidates.items()}, num_devices, microbatches,
                       schedule).with_precision(precision)
    yield plan
    for _ in range(space_size(candidates) - 1):
        for op in ops:
            step = digit[op] + (1 if up[op] else -1)
            if 0 <= step < len(candidates[op]):
                digit[op] = step
                plan = plan.replace(op, candidates[op][step])
                break
            up[op] = not up[op]
        yield plan


def search_exhaustively(candidates: dict[str, list[ParallelConfig]], evaluate: Callable[[Strategy], SimResult],
                        stats: ChainStats, started: float, num_devices: int, microbatches: int, schedule: str,
                        precision: str, deadline: float | None = None, pace: Pace | None = None) -> int:
    """Simulate every plan of ``candidates`` into ``stats`` (``consider``: the best by rank,
    the earliest on a tie), stopping where the next would end past ``deadline``
    (``time.perf_counter()``; ``pace`` predicts it, kind "plan"); the number of plans
    simulated (the answer is exact where it is ``space_size(candidates)``)."""
    count = 0
    pace = Pace() if pace is None else pace
    for plan in gray_plans(candidates, num_devices, microbatches, schedule, precision):
        plan = evaluate.planned(plan)  # the search's reduce dtype, the plan kept as simulated
        if not pace.fits("plan", deadline, SUMMARY):
            break
        with pace.timed("plan"):
            result = evaluate(plan)
        consider(stats, plan, result, plan_cost(result), started)
        count += 1
    stats.proposals += count
    stats.scored += count
    return count
