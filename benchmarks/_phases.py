"""Where a search's time goes, by kind of proposal: ``delta_time.py --search S --phases``.

Wraps the steps ``simulator.simulate.simulate_plan`` calls (lowering, task graph, event loop,
memory) and the search's ``Evaluator`` for the length of one search, timing each evaluated
plan by phase, and the time between two evaluations (the chain's proposing and accepting,
"accept"). A plan's kind is found from the nearest of the last plans evaluated (fewest ops
changed): "micro-batch" (another count or schedule), "one-op", "block" (2 to 1/4 of the
ops), "global" (more); and whether it shards weights at level 2 or 3 ("zero") or not ("dp")."""

from __future__ import annotations

import collections
import contextlib
import time

import simulator.simulate as simulate
from soapsearch.search.api import Evaluator

PHASES = ("lower", "tasks", "events", "memory", "accept", "total")
_WRAPPED = {"lower": "lower", "task_graph": "tasks", "run_timeline": "events", "peak_memory": "memory",
            "memory_breakdown": "memory", "summarize": "memory"}
_RECENT = 8
"""Plans evaluated last that a plan's kind is found against."""


def kind(plan, recent: list) -> str:
    """``plan``'s kind of proposal against the nearest of ``recent`` (see the module docstring)."""
    level = "zero" if any(c.zero >= 2 for _, c in plan.configs) else "dp"
    best = None
    for other in recent:
        if (other.microbatches, other.schedule) != (plan.microbatches, plan.schedule):
            continue
        changed = sum(a is not b and a != b for (_, a), (_, b) in zip(plan.configs, other.configs))
        best = changed if best is None else min(best, changed)
    if best is None:
        what = "micro-batch" if recent else "start"
    elif best <= 1:
        what = "one-op" if best else "same"
    else:
        what = "block" if best <= len(plan.configs) // 4 else "global"
    return f"{what}/{level}"


@contextlib.contextmanager
def phase_clock():
    """Yields {kind: {phase: [seconds of each plan]}}, filled while inside."""
    rows: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    now: dict[str, float] = {}
    recent: list = []
    last_end = [None]
    saved = {name: getattr(simulate, name) for name in _WRAPPED}
    call = Evaluator.__call__

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                now[_WRAPPED[name]] = now.get(_WRAPPED[name], 0.0) + time.perf_counter() - t0
        return wrapper

    def evaluate(self, plan, *args, **kwargs):
        t0 = time.perf_counter()
        now.clear()
        try:
            return call(self, plan, *args, **kwargs)
        finally:
            t1 = time.perf_counter()
            row = rows[kind(plan, recent)]
            for phase in PHASES[:4]:
                row[phase].append(now.get(phase, 0.0))
            row["accept"].append(0.0 if last_end[0] is None else t0 - last_end[0])
            row["total"].append(t1 - t0 + row["accept"][-1])
            last_end[0] = t1
            recent.insert(0, plan)
            del recent[_RECENT:]

    for name, fn in saved.items():
        setattr(simulate, name, timed(name, fn))
    Evaluator.__call__ = evaluate
    try:
        yield rows
    finally:
        for name, fn in saved.items():
            setattr(simulate, name, fn)
        Evaluator.__call__ = call


def print_phases(rows: dict[str, dict[str, list[float]]], wall: float) -> None:
    """One line per kind: plans, share of the wall time, mean ms per phase."""
    print(f"{'kind':18s} {'plans':>6s} {'% wall':>7s} " + " ".join(f"{p + ' ms':>10s}" for p in PHASES))
    for name, row in sorted(rows.items(), key=lambda kv: -sum(kv[1]["total"])):
        n = len(row["total"])
        print(f"{name:18s} {n:6d} {100 * sum(row['total']) / wall:7.1f} "
              + " ".join(f"{1e3 * sum(row[p]) / n:10.1f}" for p in PHASES))
