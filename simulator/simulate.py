"""simulate(): one training iteration of a plan, timed on a topology by a cost model."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable

import numpy as np

from simulator.comm_overlap_rate import overlapped_times
from simulator.contention import contended, contended_times
from simulator.stragglers import straggler_durations
from simulator.cost import CostModel, get_cost_model
from simulator.engine import event_times
from simulator.fold import FoldError, Folded, link_maps, task_copies
from simulator.fold_members import fold_members
from simulator.heap import trimmed
from simulator.memory import memory_breakdown, peak_memory
from simulator.presets import get_topology
from simulator.result import SimResult, summarize
from simulator.symmetry import Copies, CrossCopy, copies_of, find_copies
from simulator.taskgraph import TaskGraph
from simulator.tasks import TaskCache, build_tasks
from simulator.topology import Topology
from strategies.graph import OpGraph
from strategies.lowering import Lowered, lower
from strategies.lowering_members import MemberFold
from strategies.member_memo import member_memo
from strategies.strategy import Strategy

__all__ = ["FOLD_FROM", "Lowerings", "simulate_plan", "paused_gc", "run_timeline", "task_graph", "timed_graph"]

FOLD_FROM = 64
"""Devices from which ``simulate_plan`` folds a replicated plan by default. Below, the
per-device graph is small and finding the copies (``symmetry.find_copies``, about 0.5 ms for
ResNet-101's 348 ops) costs a search's proposal (a few ms) as much as folding saves."""


def simulate_plan(graph: OpGraph, strategy: Strategy | Lowered, topology: Topology | str,
                  cost_model: CostModel | str = "analytical", *, optimizer: str = "sgd",
                  timeline: bool = False, summary: bool | Callable[[SimResult], bool] = True,
                  cache: TaskCache | None = None, fold: bool | None = None,
                  lowering_cache: dict | None = None) -> SimResult:
    """Lower ``strategy`` (or take it lowered), build the task graph, run the event simulation
    (again where ``simulator.stragglers`` scales a step-end collective's overhead by the members
    arriving together, then ``simulator.contention``'s passes on devices that slow when
    computing together) and measure memory. Same inputs, same result, bit for bit. ``summary=False`` (for scoring
    many candidates) leaves busy times and bytes moved empty and skips their pass over the
    tasks, and the peak's breakdown by category (``SimResult.memory``); iteration time and peak
    memory are the same. ``summary`` may be a function of that result without its summary that
    says whether to add it, from the same timeline (a search summarizes only a plan that beats
    every one before it: its answer is never simulated again). ``cache`` reuses the task blocks of ops
    whose lowered pieces are unchanged (delta simulation: see ``simulator.tasks``). ``fold``:
    True: a plan replicated over copies of its devices (``simulator.symmetry``) is simulated on
    one copy for all (``simulator.fold``: the same result) unless ``timeline`` asks for every
    device's tasks; False: per device; None: True for plans of ``FOLD_FROM`` devices or more.
    ``lowering_cache``: the cache ``strategies.lowering.lower`` patches from call to call (a
    search's), for every copy set's lowering of ``strategy``. Without ``cache`` nothing of the
    task graph outlives the call: a large one's freed memory goes back to the OS
    (``simulator.heap.trimmed``; with a cache its owner trims after bounding it).

    The cyclic collector is paused meanwhile (tens of thousands of small tuples: it would only
    add pauses); ``_simulated``'s task graph and lowering are let go when it returns, before the
    collector resumes, so its first pass does not walk the millions of records made."""
    with paused_gc():
        result = _simulated(graph, strategy, topology, cost_model, optimizer=optimizer, timeline=timeline,
                            summary=summary, cache=cache, fold=fold, lowering_cache=lowering_cache)
    if cache is None:
        trimmed(result.num_tasks)
    return result


def _simulated(graph, strategy, topology, cost_model, *, optimizer, timeline, summary, cache, fold,
               lowering_cache) -> SimResult:
    """``simulate_plan``'s work, the collector paused and the trim left out."""
    topo = get_topology(topology) if isinstance(topology, str) else topology
    cost = get_cost_model(cost_model) if isinstance(cost_model, str) else cost_model
    plan = strategy.strategy if isinstance(strategy, Lowered) else strategy
    if fold is None:
        fold = plan.num_devices >= FOLD_FROM
    fold = fold and not timeline
    relower = None if isinstance(strategy, Lowered) else Lowerings(graph, plan, lowering_cache)
    lowered = strategy if relower is None else relower.first(topo, fold)
    tg, folded, start, end = timed_graph(lowered, topo, cost, optimizer, cache, fold, relower=relower)
    if relower is not None:
        lowered = relower.last
    if summary is not True:
        peak = peak_memory(lowered, optimizer)
        quick = SimResult(float(end.max(initial=0.0)), (), tuple(peak),
                          tuple(d.memory_bytes for d in topo.devices[:len(peak)]), {}, len(tg))
        if not summary or not summary(quick):
            return quick
    memory = memory_breakdown(lowered, optimizer)
    return summarize(tg, topo, start, end, [m.total for m in memory], timeline, memory,
                     None if folded is None else folded.copies)


class Lowerings:
    """The lowerings ``simulate_plan`` makes of one plan: copy 0's first where the plan is
    replicated (``strategies.lowering_copies``), then, called with other copies (or None: every
    device), the one ``timed_graph`` folds on next; ``last`` is the one simulated. One lowering
    cache for them all (``cache``, else a new one), each copy set's apart."""

    def __init__(self, graph: OpGraph, plan: Strategy, cache: dict | None = None):
        self.graph, self.plan, self.cache = graph, plan, {} if cache is None else cache
        self.last: Lowered | None = None

    def first(self, topology: Topology, fold: bool, members: bool = True) -> Lowered:
        """Where ``fold`` and ``topology`` is not contended: the lowering of members 0 and 1 of
        copy 0 where the plan has alike tensor-parallel members (``members``;
        ``strategies.lowering_members``), else copy 0's where it has copies (``find_copies``),
        else every device's. The members, and a member lowering refused before under the
        refusing op's same configs, are read off the cache's ``strategies.member_memo``."""
        fold = fold and not contended(topology)
        copies = find_copies(self.graph, self.plan) if fold else None
        got = self._members(copies) if members and fold else None
        if isinstance(got, Lowered):
            return got
        return (copies is not None and self(copies)) or self(None)

    def refuses_members(self, topology: Topology) -> bool:
        """Whether the plan has alike tensor-parallel members (``member_fold``) that its lowering
        refuses (``CrossCopy``: a piece crosses them), so that ``first`` would simulate it on
        its copies alone; found by the member lowering alone (kept as ``last`` where it is
        made)."""
        if contended(topology):
            return False
        return isinstance(self._members(find_copies(self.graph, self.plan)), str)

    def _members(self, copies: Copies | None) -> Lowered | str | None:
        """The lowering of members 0 and 1 of copy 0 for all (``strategies.lowering_members``);
        the refusal's line (``why``) where the plan has a member fold its lowering refuses, or
        refused alike before (the cache's ``strategies.member_memo``); None where it has no
        member fold (``why``: ``member_fold``'s line)."""
        memo = member_memo(self.cache)  # what decided the plans before
        members = memo.fold(self.graph, self.plan, copies)
        self.why = members if isinstance(members, str) else None
        if not isinstance(members, MemberFold):
            return None
        self.why = memo.refused(self.graph, self.plan, members)  # an op refused alike before
        got = self(members) if self.why is None else None
        return got if got is not None else self.why

    why: str | None = None
    """Why the plan's members were not folded (``member_fold``'s line, or the lowering's or the
    task graph's ``CrossCopy``); None where they were or no fold was asked for."""

    def __call__(self, copies: Copies | None) -> Lowered | None:
        """The lowering of ``copies``' copy 0 (None: every device); None where the plan's pieces
        cross those copies (``CrossCopy``)."""
        try:
            self.last = lower(self.graph, self.plan, self.cache, copies)
        except CrossCopy as e:
            if isinstance(copies, MemberFold):
                self.why = str(e)
                member_memo(self.cache).refuse(self.graph, self.plan, copies, e)  # not lowered again alike
            return None
        return self.last


def timed_graph(lowered: Lowered, topology: Topology, cost: CostModel, optimizer: str = "sgd",
                cache: TaskCache | None = None, fold: bool = True, phases: dict[str, float] | None = None,
                relower: "Callable[[Copies | None], Lowered | None] | None" = None
                ) -> tuple[TaskGraph, Folded | None, np.ndarray, np.ndarray]:
    """The task graph and its timeline (``task_graph``, ``run_timeline``): folded on the most
    copies where the fold holds on its timeline, else on fewer (``Folded.coarser``), else per
    device. ``phases`` (given): seconds spent building graphs ("tasks") and timing them ("events").
    ``lowered`` may be copy 0's (``Lowered.copies``): ``relower(copies)`` then lowers the plan
    for the fewer copies tried next (None: every device; returns None where it cannot); the
    lowering used is ``TaskGraph.lowered``."""
    def again(copies: Copies | None) -> Lowered:
        if relower is None:
            lowered.check_whole("simulating it per device or on other copies")
        return (copies is not None and relower(copies)) or relower(None)

    tries = [(fold, None)]
    while True:
        t0 = time.perf_counter()
        want, count = tries[-1]
        if isinstance(lowered.copies, MemberFold) and not want:  # its timeline not every member's: its copies'
            if relower is not None:
                relower.why = "the member-folded timeline is not every member's (Folded.holds)"
            want = lowered.copies.count > 1
            lowered = again(_copies_alone(lowered.copies))
        if lowered.copies is not None and (not want or count not in (None, lowered.copies.count)):
            lowered = again(copies_of(lowered.graph, lowered.strategy, count) if want else None)
        try:
            tg, folded = task_graph(lowered, topology, cost, optimizer, cache, want, count)
        except FoldError as e:  # copy 0's lowering that does not fold on this topology: every device's
            members = lowered.copies if isinstance(lowered.copies, MemberFold) else None  # or its copies'
            if members is not None and relower is not None:
                relower.why = str(e)
            lowered = again(None if members is None else _copies_alone(members))
            try:
                tg, folded = task_graph(lowered, topology, cost, optimizer, cache, False)
            except FoldError:  # the member fold's copies that do not fold either: every device's
                lowered = again(None)
                tg, folded = task_graph(lowered, topology, cost, optimizer, cache, False)
        t1 = time.perf_counter()
        times = run_timeline(tg, topology, folded)
        if phases is not None:
            phases["tasks"] = phases.get("tasks", 0.0) + t1 - t0
            phases["events"] = phases.get("events", 0.0) + time.perf_counter() - t1
        if times is not None:
            return (tg, folded, *times)
        fewer = folded.coarser()
        tries.append((fewer is not None, fewer))


def _copies_alone(fold: MemberFold) -> Copies | None:
    """A member fold's copies without its members (None: one copy, every device)."""
    return Copies(fold.copies) if fold.count > 1 else None


def run_timeline(tg: TaskGraph, topology: Topology, folded: Folded | None = None
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """The event loop's start and end of every task, again where ``simulator.stragglers``
    scales a step-end collective's overhead, then ``simulator.contention``'s passes, then
    ``simulator.comm_overlap_rate``'s (compute beside its device's collectives); None
    where ``folded`` (a folded graph's, ``task_graph``) does not hold on a timeline."""
    start, end = event_times(tg)
    base = straggler_durations(tg, topology, end)
    if base is not None:
        if folded is not None and not folded.holds(start, end):
            return None
        start, end = event_times(tg, duration=base)
    start, end = contended_times(tg, topology, start, end, base)
    start, end = overlapped_times(tg, topology, start, end, base)
    return None if folded is not None and not folded.holds(start, end) else (start, end)


def task_graph(lowered: Lowered, topology: Topology, cost: CostModel, optimizer: str = "sgd",
               cache: TaskCache | None = None, fold: bool = True, count: int | None = None
               ) -> tuple[TaskGraph, Folded | None]:
    """The task graph ``simulate_plan`` runs: folded (``fold``) where the plan is replicated
    and its copies own their links (``simulator.fold``), with what the fold needs besides
    (None: per device; ``TaskGraph.copies`` says which copies); its timeline is every copy's
    where ``Folded.holds`` it. ``count``: that many copies (``Folded.coarser``), not the most."""
    copies = None
    if lowered.copies is not None:  # copy 0's lowering: folded on its copies (timed_graph lowers again for others)
        copies = lowered.copies
    elif fold and not contended(topology):
        graph, plan = lowered.graph, lowered.strategy
        copies = find_copies(graph, plan) if count is None else copies_of(graph, plan, count)
    members = isinstance(copies, MemberFold)
    one_copy = members and copies.count == 1  # members folded inside a single copy: no copy maps
    maps = link_maps(topology, copies) if copies is not None and not one_copy else None
    if maps is None and lowered.copies is not None and not one_copy:
        raise FoldError(f"{copies} do not own their links on {topology.name!r}")
    if members:  # members 0 and 1 for all (simulator.fold_members)
        tg = build_tasks(lowered, topology, cost, optimizer, cache, copies)
        return tg, fold_members(tg, topology, copies, maps)
    if maps is not None:
        try:
            tg = build_tasks(lowered, topology, cost, optimizer, cache, copies)
            return tg, task_copies(tg, maps)
        except FoldError:
            if lowered.copies is not None:
                raise
    return build_tasks(lowered, topology, cost, optimizer, cache), None


@contextlib.contextmanager
def paused_gc():
    """No automatic cyclic collection inside (restored after). A search's caches hold hundreds
    of thousands of long-lived, acyclic objects: each full collection walks them all and finds
    no garbage; refcounting frees everything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
