"""The linear partition problem: cut a sequence of costs into contiguous runs minimizing the
largest run's cost, as pipeline stages of contiguous layers are balanced (GPipe, Huang et al.
2019; PipeDream, Narayanan et al. 2019)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["dp_partition", "linear_partition"]


def linear_partition(costs: Sequence[int], stages: int) -> list[int]:
    """The first index of each of at most ``stages`` contiguous non-empty runs of ``costs``
    minimizing the largest run's sum: a binary search on that bound, each bound tried with a
    greedy fill (a run grows until the next cost would pass the bound)."""
    def fill(bound: int) -> list[int]:
        starts, acc = [0], 0
        for k, c in enumerate(costs):
            if acc and acc + c > bound:
                starts.append(k)
                acc = 0
            acc += c
        return starts

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(fill(mid)) <= stages:
            hi = mid
        else:
            lo = mid + 1
    return fill(lo)


def dp_partition(times: Sequence[float], stages: int) -> tuple[list[int], float]:
    """The first index of each of exactly ``stages`` contiguous non-empty runs of ``times``
    (one per unit, e.g. a layer's simulated time) minimizing the slowest run's sum, and that
    sum: PipeDream's dynamic program (Narayanan et al. SOSP 2019, section 3.1) without the
    communication term, slowest[k][j] = min over i < j of max(slowest[k−1][i], sum(times[i:j])).
    Ties go to the latest last cut. ``stages`` must be between 1 and ``len(times)``."""
    n = len(times)
    if not 1 <= stages <= n:
        raise ValueError(f"stages = {stages}: must be between 1 and the {n} units to split")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    slowest = [[inf] * (n + 1) for _ in range(stages + 1)]  # [k][j]: the first j units in k runs
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    slowest[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                worst = max(slowest[k - 1][i], prefix[j] - prefix[i])
                if worst <= slowest[k][j]:
                    slowest[k][j], cut[k][j] = worst, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1], slowest[stages][n]
