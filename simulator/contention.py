"""Compute that slows when the devices of a node compute at once: CPU processes sharing cores
or memory bandwidth (``DeviceSpec.contention``).

A device of contention c runs a compute task (a forward, a backward, an optimizer update) c
times slower when all n devices of its node compute with it than when it computes alone; with
k of them computing (itself included) the slowdown is interpolated, f(k) = 1 + (c - 1)(k - 1)
/ (n - 1). The event loop places tasks with fixed durations, so the sharing is found in passes
(``contended_times``): from a timeline, each compute task's k̄ is the mean number of its node's
devices computing while it runs; its base duration times f(k̄) gives the next timeline.
``PASSES`` is fixed, so the same inputs give the same times. Data parallel, where every device
computes at once, gets the whole slowdown; pipeline stages and model-parallel devices that
take turns get little of it, which one calibrated FLOP/s for all plans cannot express.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from simulator.engine import event_times
from simulator.taskgraph import TaskGraph, TaskKind
from simulator.topology import Topology

__all__ = ["COMPUTE_KINDS", "PASSES", "contended", "contended_times", "node_tasks", "settled_times", "slowed_durations"]

PASSES = 2
"""Timelines re-run after the first, each with the durations the previous one implies."""
COMPUTE_KINDS = (TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.UPDATE)
"""The tasks that compute (and slow): a forward, a backward, an optimizer update."""
_COMPUTE = frozenset(COMPUTE_KINDS)


def contended(topology: Topology) -> bool:
    """Whether a device of ``topology`` slows when its node's devices compute at once (a node
    of one device has nothing to share)."""
    return any(len(members) > 1 and any(topology.devices[d].contention != 1.0 for d in members)
               for members in topology.nodes)


def node_tasks(tg: TaskGraph, topology: Topology, base: np.ndarray) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """Per node of n >= 2 devices, some of contention != 1: (its compute tasks of nonzero
    ``base`` duration, n, each task's device contention c): what ``slowed_durations`` reads,
    the same on every pass."""
    device = np.asarray(tg.device, dtype=np.int64)
    compute = np.fromiter(map(_COMPUTE.__contains__, tg.category), bool, len(tg)) & (base > 0)
    c = np.array([d.contention for d in topology.devices])
    groups = []
    for members in topology.nodes:
        if len(members) < 2 or np.all(c[list(members)] == 1.0):
            continue
        idx = np.flatnonzero(compute & np.isin(device, members))
        if len(idx):
            groups.append((idx, len(members), c[device[idx]]))
    return groups


def slowed_durations(groups: list[tuple[np.ndarray, int, np.ndarray]], base: np.ndarray, start: np.ndarray,
                     end: np.ndarray) -> np.ndarray:
    """``base`` durations with every compute task of ``groups`` (``node_tasks``) scaled by
    f(k̄) = 1 + (c - 1)(k̄ - 1)/(n - 1), k̄ = (1 / (e - s)) ∫ₛᵉ k(t) dt over the timeline
    (``start``, ``end``), k(t) the node's compute tasks running at t, c its device's contention."""
    out = base.copy()
    for idx, n, c in groups:
        s, e = start[idx], end[idx]
        times = np.concatenate([s, e])
        steps = np.concatenate([np.ones(len(idx)), -np.ones(len(idx))])
        order = np.argsort(times, kind="stable")  # ties add no area: their order does not matter
        t, level = times[order], np.cumsum(steps[order])
        area = np.concatenate([[0.0], np.cumsum(np.diff(t) * level[:-1])])  # ∫ k dt up to each event

        def integral(x: np.ndarray) -> np.ndarray:
            j = np.searchsorted(t, x, side="right") - 1
            return area[j] + level[j] * (x - t[j])

        k = np.clip((integral(e) - integral(s)) / (e - s), 1.0, n)
        out[idx] = base[idx] * (1.0 + (c - 1.0) * (k - 1.0) / (n - 1))
    return out


def contended_times(tg: TaskGraph, topology: Topology, start: np.ndarray, end: np.ndarray,
                    base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The timeline (``start``, ``end``: the event loop's on the ``base`` durations, default
    the graph's) after ``PASSES`` passes of ``slowed_durations``; unchanged where no device
    has contention."""
    if not contended(topology):
        return start, end
    base = tg.arrays()[0] if base is None else base
    groups = node_tasks(tg, topology, base)
    return settled_times(tg, start, end, base, lambda s, e: slowed_durations(groups, base, s, e))


def settled_times(tg: TaskGraph, start: np.ndarray, end: np.ndarray, base: np.ndarray,
                  durations: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``PASSES`` passes from the timeline (``start``, ``end``: the event loop's on the ``base``
    durations), each the event loop again on ``durations(start, end)`` of the timeline before;
    the given timeline where the first pass's durations are ``base`` (nothing slowed)."""
    for i in range(PASSES):
        slowed = durations(start, end)
        if i == 0 and np.array_equal(slowed, base):
            return start, end
        start, end = event_times(tg, duration=slowed)
    return start, end
