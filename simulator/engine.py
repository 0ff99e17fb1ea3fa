"""Event simulation of a task graph: list scheduling in order of readiness.

Each resource (a device's compute stream, one direction of a link) runs one task at a time; a
task starts when all its predecessors have ended and all its resources are free; among ready
tasks, the one that became ready first goes first (ties: the task added first). This is
FlexFlow's simulator (Jia et al. 2019, section 5), on an explicit heap.
"""

from __future__ import annotations

import heapq

from simulator.tasks import TaskGraph

__all__ = ["run_events"]


def run_events(tg: TaskGraph) -> tuple[list[float], list[float]]:
    """Start and end time of every task; raises on a cycle (tasks that never become ready)."""
    n = len(tg)
    ready = [0.0] * n
    first, succ, ndeps = tg.adjacency()
    remaining = list(ndeps)
    start = [0.0] * n
    end = [0.0] * n
    free = [0.0] * (tg.num_devices + tg.num_links)
    heap = [(0.0, t) for t in range(n) if remaining[t] == 0]
    heapq.heapify(heap)
    done = 0
    duration, resources = tg.duration, tg.resources
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        r, t = pop(heap)
        res = resources[t]
        s = r
        for x in res:
            if free[x] > s:
                s = free[x]
        e = s + duration[t]
        for x in res:
            free[x] = e
        start[t] = s
        end[t] = e
        done += 1
        for i in range(first[t], first[t + 1]):
            u = succ[i]
            if e > ready[u]:
                ready[u] = e
            remaining[u] -= 1
            if remaining[u] == 0:
                push(heap, (ready[u], u))
    if done != n:
        stuck = [tg.label(t) for t in range(n) if remaining[t] > 0][:3]
        raise RuntimeError(f"task graph has a cycle: {n - done} tasks never became ready, e.g. {stuck}")
    return start, end
