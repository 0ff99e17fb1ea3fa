"""The linear partition problem: cut a sequence of costs into contiguous runs minimizing the
largest run's cost, as pipeline stages of contiguous layers are balanced (GPipe, Huang et al.
2019; PipeDream, Narayanan et al. 2019)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["linear_partition"]


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
