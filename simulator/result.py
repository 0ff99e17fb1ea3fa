"""SimResult: what one simulated iteration of a plan costs, and its timeline as a Chrome trace
(``{"traceEvents": [...]}``, opens in Perfetto: pid = device, tid = compute or a link)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from simulator.linkclass import distinct_links, known_distinct
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


def summarize(tg: TaskGraph, topology: Topology, start: Sequence[float], end: Sequence[float],
              peak: list[int], keep_timeline: bool,
              memory: tuple[MemoryBreakdown, ...] | list[MemoryBreakdown] = (),
              copies: Sequence[int] | None = None) -> SimResult:
    """The result of the timeline (``start``, ``end``: lists or arrays) of ``tg``. A folded graph
    (``tg.copies``, ``simulator.fold``): ``copies`` says how many tasks of the full simulation
    each task stands for (its bytes count that often), and each device's busy time is its copy-0
    image's; the timeline holds copy 0's tasks."""
    n = topology.num_devices
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    kinds, held = _link_kinds(tg, topology)
    linked = held.any(axis=1)  # the tasks that hold a link
    busy = _busy(tg, n, ~linked, start, end)
    moved = _moved(tg, kinds, held, linked, copies)
    timeline = _timeline(tg, topology, start.tolist(), end.tolist()) if keep_timeline else []
    if tg.copies is not None:
        image = tg.copies.representative
        busy = [busy[image.get(d, d)] for d in range(n)]
    return SimResult(float(end.max(initial=0.0)), tuple(busy[:len(peak)]), tuple(peak),
                     tuple(d.memory_bytes for d in topology.devices[:len(peak)]),
                     moved, len(tg), tuple(timeline), tuple(memory))


def _link_kinds(tg: TaskGraph, topology: Topology) -> tuple[list[str], np.ndarray]:
    """The topology's link kinds, and which of them each task holds a link of (tasks × kinds)."""
    n = topology.num_devices
    names: dict[str, int] = {}
    kind_of = np.array([names.setdefault(link.kind, len(names)) for link in topology.links], dtype=np.int64)
    known = known_distinct(tg)
    if known is not None:  # per distinct resource tuple, then per task: no pass over every task's resources
        distinct, which = known
        tup, link = distinct_links(distinct, n)
        held = np.zeros((len(distinct), len(names)), dtype=bool)
        held[tup, kind_of[link]] = True
        return list(names), held[which]
    _, res_first, res = tg.arrays()
    links = res >= n
    task = np.repeat(np.arange(len(tg)), np.diff(res_first))[links]
    held = np.zeros((len(tg), len(names)), dtype=bool)
    held[task, kind_of[res[links] - n]] = True
    return list(names), held


def _busy(tg: TaskGraph, n: int, computes: np.ndarray, start: np.ndarray, end: np.ndarray) -> list[float]:
    """Each device's seconds on the tasks that hold resources and no link (``computes``): on the
    first device each holds, summed in task order (``np.bincount`` adds its weights in input
    order: the same floats as a loop over the tasks)."""
    _, res_first, res = tg.arrays()
    on = computes & (res_first[1:] > res_first[:-1])
    return np.bincount(res[res_first[:-1][on]], weights=(end - start)[on], minlength=n).tolist()


def _moved(tg: TaskGraph, kinds: list[str], held: np.ndarray, linked: np.ndarray,
           copies: Sequence[int] | None) -> dict[str, int]:
    """Bytes per link kind: each task's bytes (times the tasks it stands for, ``copies``) once
    for every kind of link it holds (``held``; ``linked``: the tasks that hold any), the kinds in
    the order tasks first hold them."""
    if not linked.any():
        return {}
    nbytes = np.fromiter(chain.from_iterable(tg.column_parts("nbytes")), np.int64, len(tg))
    times = None if copies is None else np.asarray(copies, dtype=np.int64)
    total = nbytes.astype(np.float64) if times is None else nbytes * times.astype(np.float64)
    if float(total[linked].sum()) * held.shape[1] >= 2.0 ** 62:  # past int64's reach: Python's ints
        nbytes, times = nbytes.astype(object), None if times is None else times.astype(object)
    if times is not None:
        nbytes = nbytes * times
    first = held.argmax(axis=0)  # the first task that holds each kind (0 where none does)
    order = sorted((int(first[k]), k) for k in range(len(kinds)) if held[first[k], k])
    return {kinds[k]: int(nbytes[held[:, k]].sum()) for _, k in order}


def _timeline(tg: TaskGraph, topology: Topology, start: list[float], end: list[float]) -> list[tuple]:
    """(name, device, lane, start, end, category) of every task that holds a resource or
    computes (a weight op's steps hold nothing); lane: its first link's name, or compute."""
    n = topology.num_devices
    names = [l.name for l in topology.links]
    resources, device, category = tg.resources, tg.device, tg.category
    lanes: dict[int, str] = {}  # id of a resource tuple -> its lane (rings share one)
    out = []
    for t in range(len(tg)):
        res = resources[t]
        lane = lanes.get(id(res))
        if lane is None:
            links = [r - n for r in res if r >= n]
            lane = lanes[id(res)] = names[links[0]] if links else "compute"
        if res or category[t] <= TaskKind.BACKWARD:
            out.append((tg.label(t), device[t], lane, start[t], end[t], CATEGORY[category[t]]))
    return out


def write_trace(path, result: SimResult) -> None:
    """Write ``result``'s timeline as a Chrome trace, atomically."""
    atomic_write_text(path, json.dumps(result.chrome_trace()))
