"""Event simulation of a task graph: list scheduling in order of readiness, with backfilling on links.

Tasks are placed one by one in the order they became ready (ties: the task added first), each
at the earliest time at or after its ready time (all predecessors ended) at which its resources
are free for its whole duration. A device's compute stream is free from the end of the last task
placed on it: a device's tasks use no links, so its gaps open only before a task's ready time,
which no task placed later can use; so this is the backfilling rule too (and its tasks are
chained in the schedule's order anyway). A link direction keeps its busy intervals, sorted, and a
transfer takes the earliest gap that every link of its route has free: insertion, or
conservative backfilling (Mu'alem and Feitelson 2001), where a task placed later never delays
one placed before it. So a transfer held up by a busy destination NIC does not block the idle
source NIC for the transfers behind it. This is FlexFlow's simulator (Jia et al. 2019, section
5), on an explicit heap, with the gaps on links used.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

import numpy as np

from simulator.linkclass import compact_resources
from simulator.native import library
from simulator.taskgraph import INDEX, TaskGraph

_INDEX_LIMIT = np.iinfo(INDEX).max

__all__ = ["run_events", "event_times"]


def run_events(tg: TaskGraph, native: bool = True) -> tuple[list[float], list[float]]:
    """Start and end time of every task; raises on a cycle (tasks that never become ready).
    ``native``: the compiled loop (``simulator.native``) where there is one; the same times."""
    start, end = event_times(tg, native)
    return start.tolist(), end.tolist()


def event_times(tg: TaskGraph, native: bool = True,
                duration: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``run_events``' times as float64 arrays (a search reads the makespan only, no per-task
    floats); ``duration``: every task's seconds in place of the graph's (``simulator.contention``)."""
    if duration is not None and len(duration) != len(tg):
        raise ValueError(f"event_times: duration has {len(duration)} entries, the graph {len(tg)} tasks: "
                         "one per task")
    lib = library() if native else None
    compact = compact_resources(tg)  # one link per class of links held by the same tasks: the same times
    if lib is not None and len(tg):
        result = _run_native(lib, tg, duration, compact)
        if result is not None:
            return result
    start, end = _run_python(tg, None if duration is None else duration.tolist(),
                             None if compact is None else compact[2])
    return np.array(start, dtype=np.float64), np.array(end, dtype=np.float64)


def _run_native(lib, tg: TaskGraph, override: np.ndarray | None = None,
                compact: tuple | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The C loop on the graph's arrays; None when it did not place every task (a cycle: the
    Python loop then names it), ran out of memory or has more than its 32-bit indices hold."""
    n = len(tg)
    src, dst = tg.edge_arrays()
    if compact is None:
        duration, res_first, res = tg.arrays()
    else:
        duration, (res_first, res) = np.asarray(tg.duration, dtype=np.float64), compact[:2]
    if len(res) >= _INDEX_LIMIT:
        return None
    src, dst, res_first, res = (np.ascontiguousarray(a, dtype=INDEX) for a in (src, dst, res_first, res))  # as is
    if override is not None:
        duration = np.ascontiguousarray(override, dtype=np.float64)
    start, end = np.empty(n), np.empty(n)
    arrays = (src, dst, duration, res_first, res, start, end)  # contiguous int32 / float64, alive till return
    placed = lib.run_events(n, tg.num_devices, tg.num_links, len(src), *[a.ctypes.data for a in arrays])
    return (start, end) if placed == n else None


def _run_python(tg: TaskGraph, override: list[float] | None = None,
                resources: list[tuple[int, ...]] | None = None) -> tuple[list[float], list[float]]:
    n = len(tg)
    nd = tg.num_devices
    ready = [0.0] * n
    first, succ, ndeps = tg.adjacency()
    remaining = list(ndeps)
    start = [0.0] * n
    end = [0.0] * n
    free = [0.0] * nd
    # Busy intervals of each link direction: [starts[k][i], ends[k][i]), sorted, disjoint.
    starts: list[list[float]] = [[] for _ in range(tg.num_links)]
    ends: list[list[float]] = [[] for _ in range(tg.num_links)]
    heap = [(0.0, t) for t in range(n) if remaining[t] == 0]
    heapq.heapify(heap)
    done = 0
    duration = tg.duration if override is None else override
    resources = tg.resources if resources is None else resources
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        r, t = pop(heap)
        res = resources[t]
        d = duration[t]
        if len(res) == 1 and res[0] < nd:  # one compute stream: the common case
            x = res[0]
            s = free[x] if free[x] > r else r
            e = free[x] = s + d
        else:
            s, e = _place(res, r, d, nd, free, starts, ends)
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


def _place(res: tuple[int, ...], r: float, d: float, nd: int, free: list[float],
           starts: list[list[float]], ends: list[list[float]]) -> tuple[float, float]:
    """Place a task of duration ``d`` ready at ``r`` on resources ``res``: the earliest start
    ``s >= r`` past every device's free time with ``[s, s + d)`` in a gap of every link; the
    links' intervals and the devices' free times are updated. Returns (start, end)."""
    s = r
    links = []
    for x in res:
        if x < nd:
            if free[x] > s:
                s = free[x]
        else:
            links.append(x - nd)
    moved = True
    while moved:  # s only grows and each move passes an interval: this ends
        moved = False
        for k in links:
            st, en = starts[k], ends[k]
            i = bisect_right(en, s)  # the first interval ending after s
            while i < len(st) and st[i] < s + d:  # it overlaps [s, s + d): start after it
                s = en[i]
                i += 1
                moved = True
    e = s + d
    for x in res:
        if x < nd:
            free[x] = e
    for k in links:
        st, en = starts[k], ends[k]
        i = bisect_right(en, s)
        if i > 0 and en[i - 1] == s:  # touches the interval before: extend it
            en[i - 1] = e
        else:
            st.insert(i, s)
            en.insert(i, e)
    return s, e
