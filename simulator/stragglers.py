"""Collectives wait for the slowest of the members that arrive together
(``DeviceSpec.collective_overhead``, scaled per collective).

Calibration fits a collective's overhead beyond the ring formula on data parallel, whose members
all compute up to the gradient all-reduce and arrive together; most of it is the wait for the
member whose compute ran late by the host's jitter (processes sharing a host's cores finish the
same work at times spread far wider than the all-reduce itself takes). Where only some members compute up to the collective and the others wait for it idle
(the loss value's all-reduce of a pipeline, summed after stage 0's last backward), only the busy
ones can be late. The expected wait for the slowest of k i.i.d. normal jitters is σ·e(k),
e(k) = E[max of k standard normals] (e(1) = 0, e(2) = 1/√π ≈ 0.564, e(4) ≈ 1.029), so the
overhead charged is scaled by e(k) / e(m) for k of the collective's m members arriving together:
the fitted figure when all m do, none when one arrives last alone. A member arriving δ before
the last counts max(0, 1 − δ/w), w = the overhead (the jitter's scale), and e is interpolated
between whole k, so the charge moves continuously with the arrivals (no step for a search to
fall over). Found from the uncontended timeline in one pass (``straggler_durations``), before
``simulator.contention``'s passes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from simulator.taskgraph import TaskGraph
from simulator.topology import Topology

__all__ = ["expected_max", "straggler_durations", "together"]


def together(k: float) -> float:
    """e(k) for a real k >= 1: ``expected_max`` interpolated linearly between whole k."""
    lo = math.floor(k)
    return expected_max(lo) + (k - lo) * (expected_max(lo + 1) - expected_max(lo)) if k > lo else expected_max(lo)


@lru_cache(maxsize=None)
def expected_max(k: int) -> float:
    """E[max of k i.i.d. standard normals] = ∫ x·k·φ(x)·Φ(x)^(k-1) dx (Simpson's rule on
    [-10, 10]; 0 for k = 1)."""
    if k < 1:
        raise ValueError(f"expected_max: k = {k}: must be >= 1")
    if k == 1:
        return 0.0
    x = np.linspace(-10.0, 10.0, 4001)
    phi = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    f = x * k * phi * cdf ** (k - 1)
    h = x[1] - x[0]
    return float(h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))


def straggler_durations(tg: TaskGraph, topology: Topology, end: np.ndarray) -> np.ndarray | None:
    """The graph's durations with each collective's overhead tasks (``TaskGraph.syncs``)
    scaled by e(k) / e(m) (the module docstring), k weighed on the timeline whose task ends are
    ``end``; None when every factor is 1 (nothing to re-run)."""
    if not tg.syncs:
        return None
    duration = None
    for _, hosts, waits_on, copies in tg.syncs:  # copies: the members each simulated one stands for
        m = len(hosts) * copies
        if m < 2:
            continue
        arrival: dict[int, float] = {}
        for d, t in waits_on:
            arrival[d] = max(arrival.get(d, -math.inf), float(end[t]))
        last = max((arrival.get(d, -math.inf) for d, _ in hosts), default=-math.inf)
        window = max(topology.devices[d].collective_overhead for d, _ in hosts)
        k = max(1.0, copies * sum(max(0.0, 1.0 - (last - arrival.get(d, -math.inf)) / window) for d, _ in hosts))
        if k == m:
            continue
        factor = together(k) / expected_max(m)
        if duration is None:
            duration = tg.arrays()[0].copy()
        for d, h in hosts:
            duration[h] = topology.devices[d].collective_overhead * factor
    return duration
