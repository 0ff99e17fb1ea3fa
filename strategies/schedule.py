"""The one fixed order in which each device runs its partitions: shared by the simulator and
the executor, so both run the same schedule (and no rank can wait on a task another rank has
not reached yet).

A device's *step* for micro-batch j is every partition it computes for j, in the graph's
topological order (forward) or its reverse (backward).

- GPipe (Huang et al. 2019): F0 F1 … F(m−1), then B0 B1 … B(m−1).
- 1F1B (PipeDream-flush, Narayanan et al. 2021): w = min(m, S − s) warm-up forwards, then
  alternate one backward and one forward, then the remaining backwards; S is the number of
  pipeline stages (runs of consecutive ops on one device set) and s the device's stage. When a
  device serves two stages that are not adjacent (an interleaved placement) no such w is safe
  for every device, so those plans fall back to GPipe's order (w = m) on every device.
"""

from __future__ import annotations

from typing import NamedTuple

from strategies.lowering import Lowered

__all__ = ["Step", "device_order", "stages", "warmup"]


class Step(NamedTuple):
    backward: bool
    op: str
    index: int
    microbatch: int


def stages(lowered: Lowered) -> list[tuple[int, ...]]:
    """Device sets of the runs of consecutive ops (topological order) on one device set."""
    out: list[tuple[int, ...]] = []
    for node in lowered.graph:
        devices = lowered.strategy[node.name].devices
        if not out or devices != out[-1]:
            out.append(devices)
    return out


def warmup(lowered: Lowered, device: int) -> int:
    """Forwards ``device`` runs before its first backward."""
    m = lowered.strategy.microbatches
    if lowered.strategy.schedule == "gpipe" or m == 1:
        return m
    runs = stages(lowered)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for s, devices in enumerate(runs):
        for d in devices:
            first.setdefault(d, s)
            last[d] = s
    members = [{d for d in devs} for devs in runs]
    if any(any(d not in members[s] for s in range(first[d], last[d] + 1)) for d in first):
        return m  # a device in two stages that are not adjacent: GPipe's order is the safe one
    return max(1, min(m, len(runs) - first.get(device, 0)))


def device_order(lowered: Lowered) -> dict[int, list[Step]]:
    """Device -> its steps in the order it runs them."""
    m = lowered.strategy.microbatches
    fwd: dict[int, list[list[Step]]] = {}
    for node in lowered.graph:
        for j, parts in enumerate(lowered.partitions[node.name]):
            for p in parts:
                fwd.setdefault(p.device, [[] for _ in range(m)])[j].append(
                    Step(False, node.name, p.index, j))
    order: dict[int, list[Step]] = {}
    for device, per_mb in sorted(fwd.items()):
        w = warmup(lowered, device)
        bwd = [[Step(True, s.op, s.index, s.microbatch) for s in reversed(steps)] for steps in per_mb]
        seq: list[Step] = []
        for j in range(w):
            seq += per_mb[j]
        for j in range(m - w):
            seq += bwd[j] + per_mb[j + w]
        for j in range(m - w, m):
            seq += bwd[j]
        order[device] = seq
    return order
