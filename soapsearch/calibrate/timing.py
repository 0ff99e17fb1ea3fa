"""Timing on N processes at once: each run starts after a barrier, and a figure is the slowest
rank's median, or the median over runs of the slowest rank (what a step of all of them costs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["median_slowest", "slowest_median", "step_times"]


def step_times(fn: Callable[[], Any], steps: int) -> list[float]:
    """``steps`` runs of ``fn``, each after a barrier: this rank's seconds."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def slowest_median(times: Sequence[float]) -> float:
    """The median of this rank's ``times``, then the largest over the ranks."""
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def median_slowest(times: Sequence[float]) -> float:
    """The median over runs of the slowest rank's time of each run: how ``compare.run_plans``
    times a plan's steps (a step ends when its slowest rank does, and which rank is slowest,
    waking up late, changes from step to step: this is >= ``slowest_median``)."""
    t = torch.tensor(list(times), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())
