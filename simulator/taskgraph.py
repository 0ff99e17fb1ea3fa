"""The task graph's storage: columns of per-task facts, laid out as sealed segments (the cached
blocks of ``simulator.tasks``, numpy arrays) followed by a tail of tasks added one by one.

A search builds one graph per proposal from mostly unchanged blocks, so the graph never copies
its segments task by task: the event loop reads them concatenated as arrays (``arrays``), and
the per-task lists (``duration``, ``resources``...) are built only when something reads them
(traces, busy times, the Python event loop, tests).
"""

from __future__ import annotations

from enum import IntEnum
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

__all__ = ["TaskGraph", "TaskKind", "StepOrder", "Columns", "Segment", "Recorded", "INDEX", "CATEGORY"]


class TaskKind(IntEnum):
    """What a task is. An int, so the event loop and numpy read the column as integers."""

    FORWARD = 0
    """A partition's forward step on its device."""
    BACKWARD = 1
    """A partition's backward step on its device."""
    TRANSFER = 2
    """A piece sent between devices, on the links of its route."""
    GRAD_TRANSFER = 3
    """A piece's gradient sent back, on the links of the reverse route."""
    REDUCE = 4
    """A reduction group's sum (an all-gather or a ring sum), or a member's host part of it."""
    ALLREDUCE = 5
    """A gradient bucket's or the loss value's all-reduce, its packing and unpacking."""
    UPDATE = 6
    """A device's optimizer update."""
    RECV = 7
    """The receiving device's host work for a piece (``DeviceSpec.message_overhead``)."""
    SEND = 8
    """The sending device's host held by a piece (``Link.send_bandwidth``)."""
    GRAD_SEND = 9
    """The sending device's host held by a gradient sent back."""
    COLLECTIVE = 10
    """A collective moving a producer's output to its readers (``strategies.lowered.Collective``)
    or its gradient back, on the links of its ring, or a member's host part of it."""


CATEGORY = tuple(kind.name.lower() for kind in TaskKind)
"""Each kind's category in a trace, by its value: ``CATEGORY[TaskKind.FORWARD]`` is "forward"."""

INDEX = np.int32
"""The dtype of task ids, edges and resource ids in the graph's arrays: the compiled event
loop's (``simulator/_events.c``), half the memory traffic of int64 for every join and gather."""

_FIELDS = ("name", "category", "duration", "resources", "device", "nbytes")


class StepOrder(NamedTuple):
    """The schedule steps each device runs, in order, as the graph chains them: the first task
    of each step (a partition's forward or backward task), device after device."""

    devices: list[int]
    """The devices that run a step, ascending."""
    tasks: np.ndarray
    """The steps' first tasks: ``devices[0]``'s, then ``devices[1]``'s, ..."""
    last: list[int]
    """The position in ``tasks`` of each device's last step."""


class Columns:
    """Per-task facts as parallel lists, one entry per task.

    name: a label, a string or a tuple formatted by ``label`` only when shown (traces, errors);
    category: a ``TaskKind``; duration: seconds; resources: resource ids (device d is d, link
    l is num_devices + l); device: the device a task belongs to (a transfer's source) for traces
    and busy time; nbytes: bytes it moves."""

    def __init__(self) -> None:
        self.name: list[Any] = []
        self.category: list[int] = []
        self.duration: list[float] = []
        self.resources: list[tuple[int, ...]] = []
        self.device: list[int] = []
        self.nbytes: list[int] = []

    def add(self, name: Any, category: int, duration: float, resources: tuple[int, ...],
            device: int, nbytes: int = 0) -> int:
        """Append one task; returns its index among these columns."""
        self.name.append(name)
        self.category.append(category)
        self.duration.append(duration)
        self.resources.append(resources)
        self.device.append(device)
        self.nbytes.append(nbytes)
        return len(self.duration) - 1

    def __len__(self) -> int:
        return len(self.duration)


class Recorded:
    """Tasks recorded once and laid out in later graphs (each record has its ``Columns`` as
    ``cols``), by key, and the tasks they hold in all: ``simulator.step``'s gradient buckets,
    ``simulator.zero3``'s level-2/3 chunks (a ``TaskCache`` keeps one of each)."""

    def __init__(self) -> None:
        self.records: dict[Any, Any] = {}
        self.tasks = 0

    def record(self, key: Any, record: Any) -> Any:
        """``record`` kept under ``key`` (a new key: a record is made once); returns it."""
        self.records[key] = record
        self.tasks += len(record.cols)
        return record

    def clear(self) -> None:
        self.records.clear()
        self.tasks = 0

    def bound(self, most: int, most_tasks: float = float("inf")) -> None:
        """Empty from ``most`` records or past ``most_tasks`` tasks (speed, never results)."""
        if len(self.records) >= most or self.tasks > most_tasks:
            self.clear()


class Segment:
    """Columns frozen as arrays (for the event loop) next to the lists (for readers)."""

    def __init__(self, cols: Columns) -> None:
        self.cols = cols
        self.size = len(cols)
        self.duration = np.asarray(cols.duration, dtype=np.float64)
        self.res_len = np.fromiter(map(len, cols.resources), INDEX, self.size)
        self.res = np.fromiter(chain.from_iterable(cols.resources), INDEX, int(self.res_len.sum()))


def join(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """Field by field, the parts' arrays concatenated along their last axis."""
    return tuple(np.concatenate(field, axis=-1) for field in zip(*parts))


def label(name: Any) -> str:
    """A task's name as shown: a string as is; (what, op, index, micro-batch) of a partition's
    task; (what, transfer) of a transfer's task (``strategies.lowering.Transfer``); (template,
    micro-batch) of a collective's task (``simulator.collectives``: ``str.format``'s template)."""
    if isinstance(name, str):
        return name
    if len(name) == 2:
        what, t = name
        if type(t) is int:
            return what.format(t)
        return f"{what} {t.src_op}[{t.src_index}]->{t.dst_op}[{t.dst_index}]@mb{t.microbatch}"
    what, op, index, mb = name
    return f"{what} {op}[{index}]@mb{mb}"


class TaskGraph:
    """Tasks in id order: the sealed segments (``place``), then the tail (``add``); edges
    collected as (source, target) pairs or arrays and turned into one adjacency (CSR) when
    first read. Tasks and edges are only ever appended, so what is built from them (the
    per-task lists, the adjacency) is stamped with the counts it saw and rebuilt when they have
    grown: ``add`` and ``edge`` do no bookkeeping."""

    def __init__(self, num_devices: int, num_links: int) -> None:
        self.num_devices, self.num_links = num_devices, num_links
        self.segments: list[Segment] = []
        self.tail = Columns()
        self._head = 0  # tasks in the segments
        self._joined: tuple[np.ndarray, ...] | None = None
        self.edge_src: list[int] = []
        self.edge_dst: list[int] = []
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []
        """Edges added in bulk: (sources, targets)."""
        self._lists: dict[str, list] = {}
        self._lists_at = 0  # the task count the per-task lists hold
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._arrays_at = -1  # the task count ``arrays`` holds
        self._adjacency: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._adjacency_lists: tuple[list[int], list[int], list[int]] | None = None
        self._adjacency_at: tuple[int, int, int] | None = None  # (tasks, edges, chunks) it holds
        self.syncs: list[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], int]] = []
        """The step end's collectives with per-member overhead tasks: (collective, its (device,
        overhead task) pairs, the (device, task) pairs it waits on, the members each of them
        stands for: 1, or a folded plan's copy count where the group spans the copies), which
        ``simulator.stragglers`` scales."""
        self.copies: Any = None
        """The plan's replica copies when only copy 0's tasks are built (``simulator.symmetry
        .Copies``, ``simulator.fold``), else None."""
        self.step_order: StepOrder | None = None
        """Each device's schedule steps in order (``simulator.tasks``), once they are chained."""
        self.memo: dict[str, tuple[int, Any]] = {}
        """What ``simulator.linkclass`` derives from the tasks: name -> (the task count it saw, it)."""

    # --- tasks ----------------------------------------------------------------------------------
    def place(self, segments: list[Segment], joined: tuple[np.ndarray, ...],
              first: np.ndarray | None = None) -> np.ndarray:
        """Lay ``segments``' tasks out first, in order (once, before any task is added); returns
        each one's first id. ``joined``: their (duration, res_len, res) concatenated, which the
        caller keeps across graphs (``arrays`` reads them); ``first``: each one's first id and
        the task count last, when the caller keeps those too."""
        if self.segments or len(self.tail):
            raise ValueError("TaskGraph.place: segments are laid out once, before any task is added")
        if first is None:
            first = np.zeros(len(segments) + 1, dtype=INDEX)
            np.cumsum(np.fromiter(map(attrgetter("size"), segments), INDEX, len(segments)), dtype=INDEX,
                      out=first[1:])
        self.segments = list(segments)
        self._joined = joined
        self._head = int(first[-1])
        return first[:-1]

    def add(self, name: Any, category: int, duration: float, resources: tuple[int, ...],
            device: int, nbytes: int = 0) -> int:
        return self._head + self.tail.add(name, category, duration, resources, device, nbytes)

    def extend(self, cols: Columns) -> int:
        """Append ``cols``' tasks in order (a run recorded once and laid out again,
        ``simulator.step``); returns the first one's id."""
        first, tail = len(self), self.tail
        tail.name += cols.name
        tail.category += cols.category
        tail.duration += cols.duration
        tail.resources += cols.resources
        tail.device += cols.device
        tail.nbytes += cols.nbytes
        return first

    def __len__(self) -> int:
        return self._head + len(self.tail)

    def _column(self, field: str) -> list:
        if self._lists_at != len(self):
            self._lists.clear()
            self._lists_at = len(self)
        got = self._lists.get(field)
        if got is None:
            got = self._lists[field] = list(chain.from_iterable(self.column_parts(field)))
        return got

    def column_parts(self, field: str) -> list[list]:
        """The lists a per-task column is joined from, in task order: each segment's, then the
        tail's (a segment copied from a twin's block shares its twin's lists, ``simulator.twins``)."""
        return [getattr(s.cols, field) for s in self.segments] + [getattr(self.tail, field)]

    name = property(lambda self: self._column("name"))
    category = property(lambda self: self._column("category"))
    duration = property(lambda self: self._column("duration"))
    resources = property(lambda self: self._column("resources"))
    device = property(lambda self: self._column("device"))
    nbytes = property(lambda self: self._column("nbytes"))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(duration, res_first, res): durations, and every task's resources as CSR (task t's
        are res[res_first[t]:res_first[t + 1]]), the segments' arrays joined, then the tail's;
        made again once tasks are added (the event loop's passes, stragglers' and contention's
        reruns and the summary read the same arrays: read only)."""
        if self._arrays_at != len(self):
            tail = Segment(self.tail)
            head = [self._joined] if self._joined is not None else []
            duration, lens, res = join(head + [(tail.duration, tail.res_len, tail.res)])
            res_first = np.zeros(len(lens) + 1, dtype=INDEX)
            np.cumsum(lens, dtype=INDEX, out=res_first[1:])
            self._arrays, self._arrays_at = (duration, res_first, res), len(self)
        return self._arrays

    def resource_count(self) -> int:
        """How many (task, resource) pairs the graph holds (``arrays``' res length), without
        joining the resources."""
        head = 0 if self._joined is None else len(self._joined[2])
        return head + sum(map(len, self.tail.resources))

    def label(self, t: int) -> str:
        return label(self.name[t])

    # --- edges ----------------------------------------------------------------------------------
    def edge(self, a: int, b: int) -> None:
        self.edge_src.append(a)
        self.edge_dst.append(b)

    def edge_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(sources, targets) of every edge as ``INDEX`` arrays: those added one by one, then the chunks."""
        return (np.concatenate([np.asarray(self.edge_src, dtype=INDEX)] + [c[0] for c in self.chunks]),
                np.concatenate([np.asarray(self.edge_dst, dtype=INDEX)] + [c[1] for c in self.chunks]))

    def adjacency_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first, succ, ndeps) as integer arrays: task t's successors are succ[first[t]:first[t + 1]],
        in the order of ``edge_arrays``; ndeps[t] counts t's predecessors (with multiplicity)."""
        at = (len(self), len(self.edge_src), len(self.chunks))
        if self._adjacency_at != at:
            self._adjacency_at, self._adjacency_lists = at, None
            n = len(self)
            src, dst = self.edge_arrays()
            order = np.argsort(src, kind="stable")
            first = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.bincount(src, minlength=n), out=first[1:])
            self._adjacency = (first, dst[order], np.bincount(dst, minlength=n))
        return self._adjacency

    def adjacency(self) -> tuple[list[int], list[int], list[int]]:
        """``adjacency_arrays`` as lists (what the Python event loop indexes fastest)."""
        arrays = self.adjacency_arrays()  # first: it drops lists of an older adjacency
        if self._adjacency_lists is None:
            self._adjacency_lists = tuple(a.tolist() for a in arrays)  # type: ignore[assignment]
        return self._adjacency_lists  # type: ignore[return-value]

    def successors(self, t: int) -> list[int]:
        first, succ, _ = self.adjacency()
        return succ[first[t]:first[t + 1]]
