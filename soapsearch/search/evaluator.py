"""The search's scorer: an ``Evaluator`` simulates plans of one graph on one topology, reusing
each unchanged op's lowering and task blocks (the delta simulation, docs/design.md "Search")
and keeping recent results by plan."""

from __future__ import annotations

import dataclasses
import time

from simulator.cost import CostModel
from simulator.heap import trimmed
from simulator.result import SimResult
from simulator.simulate import FOLD_FROM, Lowerings, simulate_plan
from simulator.tasks import TaskCache
from simulator.topology import Topology
from soapsearch.search.mcmc import plan_cost, rank
from soapsearch.search.pace import Pace
from strategies import OpGraph, PlanError, Strategy
from strategies.lowering_bytes import LoweringCache

__all__ = ["SEEN", "Evaluator", "scored"]

SEEN = 64
"""Results an ``Evaluator`` keeps by plan (``Evaluator._seen``)."""

class Evaluator:
    """Simulates plans of one graph on one topology, reusing each unchanged op's lowering."""

    def __init__(self, graph: OpGraph, topology: Topology, cost: CostModel, optimizer: str = "sgd",
                 precision: str = "model", summarize_best: bool = False, pace: Pace | None = None,
                 reduce_dtype: str | None = None):
        self.graph, self.topology, self.cost, self.optimizer = graph, topology, cost, optimizer
        self.precision = precision
        self.reduce_dtype = reduce_dtype if precision != "model" else None
        """What its plans sum gradients in (``Strategy.reduce_dtype``; ``planned``); None: each
        plan's own (a search sets its ``SearchConfig.reduce_dtype``)."""
        self.summarize_best = summarize_best
        """Every result that ranks before each one returned before (``mcmc.rank``) comes with
        its summary, made from its own timeline: a search's answer is never simulated again."""
        self.best: tuple[bool, float] | None = None
        """The rank of the best result returned so far."""
        self.pace = Pace() if pace is None else pace
        """Where the seconds of each summary's pass go (kind "summary")."""
        self.lowering_cache = LoweringCache()
        """The cache ``strategies.lowering.lower`` reuses across this search's plans (the sweep's
        trials read it through ``scratch.Scratch``), bounded by bytes (``LOWERING_BYTES``: the
        oldest entries go first, before a simulation), so a search's memory stays bounded
        however many plans it scores."""
        self._tasks = TaskCache(topology, cost)
        self.calls = 0
        self._seen: dict[Strategy, tuple[bool, SimResult]] = {}
        """The results of the last ``SEEN`` plans simulated, by value (the least recently used
        going first), each with whether it holds its summary: a micro-batch or global move back
        to a plan simulated before (the same simulation, the same result) is not simulated again, nor
        is a chain's start taken from the sweep's plans (``remember``). Only the leader's result
        keeps its summary (busy times, bytes moved, each device's memory breakdown: megabytes at
        1,024 devices); the others are kept ``scored``, as a scoring without one returns them."""
        self._leader: Strategy | None = None
        """The plan whose result ranked first when it was simulated (``_leads``): the one
        ``_seen`` keeps with its summary (a search's answer is not simulated again)."""

    def remember(self, plan: Strategy, result: SimResult) -> None:
        """``plan``'s ``result`` returned when ``plan`` is asked again without a summary or
        timeline (with one too where ``result`` is the summarized one kept already)."""
        plan = self.planned(plan)
        seen = self._seen.get(plan)
        self._keep(plan, seen is not None and seen[0] and seen[1] is result, result)

    def _keep(self, plan: Strategy, summarized: bool, result: SimResult) -> None:
        """``plan``'s ``result`` the most recently used of the last ``SEEN``; with its summary
        only where ``plan`` is the leader (``_leader``), else as a scoring returns it
        (``scored``: what the search reads of it)."""
        if not summarized or plan != self._leader:
            summarized, result = False, scored(result)
        self._seen.pop(plan, None)
        self._seen[plan] = (summarized, result)
        if len(self._seen) > SEEN:
            del self._seen[next(iter(self._seen))]

    def _lead(self, plan: Strategy) -> None:
        """``plan`` the leader: the leader before it keeps only its ``scored`` result."""
        old, self._leader = self._leader, plan
        seen = None if old is None or old == plan else self._seen.get(old)
        if seen is not None and seen[0]:
            self._seen[old] = (False, scored(seen[1]))  # its place in the order kept

    def __call__(self, plan: Strategy, summary: bool = False, timeline: bool = False) -> SimResult:
        """Iteration time and memory of ``plan`` (``summary``, or ``summarize_best`` and the
        best so far: also busy times, bytes moved; ``timeline``: every task's times)."""
        plan = self.planned(plan)
        seen = None if timeline else self._seen.get(plan)
        if seen is not None:
            self._keep(plan, *seen)
            if seen[0] or not summary:  # a plan returned before never leads (``_leads``) again
                return seen[1]
        self.calls += 1
        self.lowering_cache.trim()  # the sweep and the stage moves lower through it between calls
        before = self.best
        made: list[float] = []  # when a summary was asked for: its pass is timed

        def wanted(quick: SimResult) -> bool:
            if not (summary or (self.summarize_best and self._leads(quick))):
                return False
            made.append(time.perf_counter())
            return True

        result = simulate_plan(self.graph, plan, self.topology, self.cost, optimizer=self.optimizer,
                               summary=wanted, timeline=timeline, cache=self._tasks,
                               lowering_cache=self.lowering_cache)
        if made:
            self.pace.record("summary", time.perf_counter() - made[0])
        self.lowering_cache.trim()  # a lowering past the bound is not held while the next is made
        self._tasks.trim()
        trimmed(result.num_tasks)  # a large simulation's freed pages back to the OS (simulator.heap)
        self._leads(result)
        if self.best != before:  # it leads: the one result kept with its summary
            self._lead(plan)
        if not timeline:
            self._keep(plan, bool(summary or made), result)
        return result

    def keeps_members(self, plan: Strategy) -> bool:
        """Whether ``plan``'s lowering keeps its alike tensor-parallel members where it has
        them (``Lowerings.refuses_members``), read by lowering members 0 and 1 alone through
        this search's lowering cache: a plan it keeps is simulated from that lowering, one it
        refuses would be lowered and simulated again on its copies (``symmove``'s op moves
        make no such proposal). True where the lowering refuses the plan itself (``PlanError``:
        its scoring refuses it as before)."""
        plan = self.planned(plan)
        if plan.num_devices < FOLD_FROM or plan in self._seen:  # unfolded, or simulated already
            return True
        try:
            return not Lowerings(self.graph, plan, self.lowering_cache).refuses_members(self.topology)
        except PlanError:
            return True

    def _leads(self, result: SimResult) -> bool:
        """``result`` ranks before every result returned before (it is the best now)."""
        key = rank(result.fits, plan_cost(result))
        if self.best is not None and key >= self.best:
            return False
        self.best = key
        return True

    def planned(self, plan: Strategy) -> Strategy:
        """``plan`` in the search's precision and reduce dtype (a baseline or initial plan is made
        in "model"; with ``reduce_dtype`` None, a mixed-precision plan keeps its own)."""
        if plan.precision == self.precision and self.reduce_dtype in (None, plan.reduce_dtype):
            return plan
        return plan.with_precision(self.precision, self.reduce_dtype)


def scored(result: SimResult) -> SimResult:
    """``result`` as ``simulate_plan(..., summary=False)`` returns it: iteration time, peak
    memory, capacities and task count, no busy times, bytes moved, breakdown or timeline."""
    if not (result.busy_time or result.bytes_moved or result.timeline or result.memory):
        return result
    return dataclasses.replace(result, busy_time=(), bytes_moved={}, timeline=(), memory=())
