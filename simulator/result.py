"""SimResult: what one simulated iteration of a plan costs, and its timeline as a Chrome trace
(``{"traceEvents": [...]}``, opens in Perfetto: pid = device, tid = compute or a link)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from simulator.memory import MemoryBreakdown
from simulator.taskgraph import CATEGORY, TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.serialize import atomic_write_text

__all__ = ["SimResult", "chrome_trace", "summarize", "write_trace"]


@dataclass(frozen=True)
class SimResult:
    iteration_time: float
    """Seconds per training iteration (the makespan of the task graph)."""
    busy_time: tuple[float, ...]
    """Seconds each device computes (forward, backward, update)."""
    peak_memory_bytes: tuple[int, ...]
    memory_capacity: tuple[int, ...]
    bytes_moved: dict[str, int]
    """Bytes that crossed links this iteration, per link kind (forward, gradients, all-reduce)."""
    num_tasks: int
    timeline: tuple[tuple[str, int, str, float, float, str], ...] = field(repr=False, default=())
    """(name, device, lane, start s, end s, category) per task."""
    memory: tuple[MemoryBreakdown, ...] = field(repr=False, default=())
    """Each device's peak by category (``simulator.memory.memory_breakdown``; they sum to
    ``peak_memory_bytes``); empty where the result was made without a summary (a search's
    scoring)."""

    @property
    def iteration_ms(self) -> float:
        return self.iteration_time * 1e3

    @property
    def fits(self) -> bool:
        return all(p <= c for p, c in zip(self.peak_memory_bytes, self.memory_capacity))

    @property
    def busiest_device(self) -> int:
        """The device of the highest peak (the first of them); 0 with no device."""
        peak = self.peak_memory_bytes
        return max(range(len(peak)), key=peak.__getitem__, default=0)

    @property
    def peak_breakdown(self) -> MemoryBreakdown | None:
        """The busiest device's peak by category; None where the result has no breakdown."""
        return self.memory[self.busiest_device] if self.memory else None

    def to_json(self) -> dict[str, Any]:
        out = {"iteration_ms": self.iteration_ms, "busy_ms": [b * 1e3 for b in self.busy_time],
               "peak_memory_bytes": list(self.peak_memory_bytes),
               "memory_capacity_bytes": list(self.memory_capacity), "fits": self.fits,
               "bytes_moved": dict(self.bytes_moved), "tasks": self.num_tasks}
        top = self.peak_breakdown
        if top is not None:
            out["peak_memory"] = {"device": self.busiest_device, "bytes": top.total,
                                  "breakdown": top.to_json()}
        return out

    def chrome_trace(self) -> dict[str, Any]:
        return chrome_trace(self.timeline)


def chrome_trace(timeline) -> dict[str, Any]:
    """Trace-event JSON: one complete ("X") event per task, microseconds."""
    events: list[dict[str, Any]] = []
    lanes: dict[tuple[int, str], int] = {}
    for name, device, lane, s, e, cat in timeline:
        tid = lanes.setdefault((device, lane), len(lanes))
        events.append({"name": name, "cat": cat, "ph": "X", "pid": device, "tid": tid,
                       "ts": round(s * 1e6, 3), "dur": round((e - s) * 1e6, 3)})
    for (device, lane), tid in lanes.items():
        events.append({"name": "thread_name", "ph": "M", "pid": device, "tid": tid,
                       "args": {"name": lane}})
    for device in sorted({d for d, _ in lanes}):
        events.append({"name": "process_name", "ph": "M", "pid": device,
                       "args": {"name": f"device {device}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def summarize(tg: TaskGraph, topology: Topology, start: list[float], end: list[float],
              peak: list[int], keep_timeline: bool,
              memory: tuple[MemoryBreakdown, ...] | list[MemoryBreakdown] = (),
              copies: list[int] | None = None) -> SimResult:
    """The result of the timeline (``start``, ``end``) of ``tg``. A folded graph (``tg.copies``,
    ``simulator.fold``): ``copies`` says how many tasks of the full simulation each task
    stands for (its bytes count that often), and each device's busy time is its copy-0
    image's; the timeline holds copy 0's tasks."""
    n = topology.num_devices
    busy = [0.0] * n
    moved: dict[str, int] = {}
    timeline = []
    kinds = [l.kind for l in topology.links]
    names = [l.name for l in topology.links]
    resources, nbytes, device, category = tg.resources, tg.nbytes, tg.device, tg.category
    each: dict[int, tuple[int, set[str], str]] = {}  # id of a resource tuple -> what it says (rings share one)
    for t in range(len(tg)):
        res = resources[t]
        got = each.get(id(res))
        if got is None:
            links = [r - n for r in res if r >= n]
            got = each[id(res)] = (res[0] if res and not links else -1, {kinds[l] for l in links},
                                   names[links[0]] if links else "compute")
        on, link_kinds, lane = got
        if on >= 0:
            busy[on] += end[t] - start[t]
        for kind in link_kinds:
            moved[kind] = moved.get(kind, 0) + nbytes[t] * (1 if copies is None else copies[t])
        if keep_timeline and (res or category[t] <= TaskKind.BACKWARD):  # a weight op's steps hold nothing
            timeline.append((tg.label(t), device[t], lane, start[t], end[t], CATEGORY[category[t]]))
    if tg.copies is not None:
        image = tg.copies.representative
        busy = [busy[image.get(d, d)] for d in range(n)]
    return SimResult(max(end, default=0.0), tuple(busy[:len(peak)]), tuple(peak),
                     tuple(d.memory_bytes for d in topology.devices[:len(peak)]),
                     moved, len(tg), tuple(timeline), tuple(memory))


def write_trace(path, result: SimResult) -> None:
    """Write ``result``'s timeline as a Chrome trace, atomically."""
    atomic_write_text(path, json.dumps(result.chrome_trace()))
