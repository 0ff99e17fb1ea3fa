"""Compute that slows while its device's own collectives run beside it (``DeviceSpec.overlap_rate``).

NCCL's collective kernels run on the GPU's SMs and read and write its HBM, so a product that
runs beside an all-gather or reduce-scatter of its device (FSDP's prefetched all-gathers, the
gradients' reduce-scatters, DDP's buckets) runs slower than alone, where the event loop
overlaps them for free. A device of overlap rate f runs a compute task (a forward, a backward,
an optimizer update) at f of its rate while one of its collectives runs. The event loop places
tasks with fixed durations, so the slowdown is found in passes (``overlapped_times``), as
``simulator.contention`` does: from a timeline, each compute task of base duration D runs from
its start at rate f inside the union of its device's collectives' intervals and at 1 outside;
the instant its D seconds of work are done gives its next duration (one product of 10 ms
beside one all-gather of 4 ms at f = 1/2: 4 ms at half rate, then 8 ms: 12 ms); a task whose
[start, start + D) meets no collective keeps D as is. ``PASSES`` is fixed, so the same inputs
give the same times, on the compiled loop and the Python one alike (both take the durations,
``engine.event_times``).

A collective is a ring task on links (``TaskKind`` REDUCE, ALLREDUCE, COLLECTIVE with links);
its members are the devices whose own links it holds: a link is a device's when every route
that starts with it starts at that device (``link_owners``: an NVSwitch port, a GPU's NIC).
A device's slowdown reads its own tasks only, so a folded graph (``simulator.fold``) slows
copy 0's devices as every copy's: the fold's check (``Folded.holds``) runs on the result.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from simulator.contention import COMPUTE_KINDS, PASSES, settled_times
from simulator.taskgraph import TaskGraph, TaskKind
from simulator.topology import Topology

__all__ = ["PASSES", "finish_times", "link_owners", "overlap_groups", "overlapped", "overlapped_durations",
           "overlapped_times"]

_COLLECTIVE = (TaskKind.REDUCE, TaskKind.ALLREDUCE, TaskKind.COLLECTIVE)


def overlapped(topology: Topology) -> bool:
    """Whether a device of ``topology`` computes slower beside its collectives."""
    return any(d.overlap_rate != 1.0 for d in topology.devices)


@lru_cache(maxsize=8)
def link_owners(topology: Topology) -> np.ndarray:
    """Per link, the device every route starting with it starts at; -1 where no route starts
    with it or routes from several devices do (a switch's or a shared NIC's link). Read from
    ``Topology.route_links`` a block of sources at a time (no route kept in the topology's memo)."""
    n, links = topology.num_devices, len(topology.links)
    lo, hi = np.full(links, n, dtype=np.int64), np.full(links, -1, dtype=np.int64)
    step = max(1, (1 << 20) // n)
    for first in range(0, n, step):
        src, dst = np.divmod(np.arange(first * n, min(n, first + step) * n, dtype=np.int64), n)
        src, dst = src[src != dst], dst[src != dst]
        head = topology.route_links(src, dst)[:, 0] if len(src) else np.empty(0, dtype=np.int64)
        held = head >= 0
        np.minimum.at(lo, head[held], src[held])
        np.maximum.at(hi, head[held], src[held])
    return np.where(lo == hi, lo, -1)


def overlap_groups(tg: TaskGraph, topology: Topology, base: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Per device of overlap rate f < 1 with compute tasks of nonzero ``base`` duration and
    collectives: (its compute tasks, its collectives, f): what ``overlapped_durations`` reads,
    the same on every pass."""
    if tg.num_devices != topology.num_devices or tg.num_links != len(topology.links):
        raise ValueError(f"overlap_groups: the graph has {tg.num_devices} devices and {tg.num_links} links, "
                         f"topology {topology.name!r} {topology.num_devices} and {len(topology.links)}: "
                         "they must be the same")
    _, res_first, res = tg.arrays()
    category = np.asarray(tg.category, dtype=np.int64)
    nd = tg.num_devices
    # every (member, collective task): the collective's resources that are a device's own link
    coll = np.flatnonzero(np.isin(category, _COLLECTIVE))
    counts = res_first[coll + 1] - res_first[coll]
    entry = np.repeat(res_first[coll] - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
    held = res[entry].astype(np.int64)
    member = np.where(held >= nd, link_owners(topology)[np.maximum(held - nd, 0)], -1)
    pick = member >= 0
    pairs = np.unique(np.stack([member[pick], np.repeat(coll, counts)[pick]]), axis=1)
    work = np.flatnonzero(np.isin(category, COMPUTE_KINDS) & (base > 0))
    device = np.asarray(tg.device, dtype=np.int64)
    work = work[np.argsort(device[work], kind="stable")]  # by device, in task order
    on = device[work]
    groups = []
    for d in np.unique(pairs[0]).tolist():
        rate = topology.devices[d].overlap_rate
        mine = work[np.searchsorted(on, d):np.searchsorted(on, d, side="right")]
        if rate != 1.0 and len(mine):
            comm = pairs[1, np.searchsorted(pairs[0], d):np.searchsorted(pairs[0], d, side="right")]
            groups.append((mine, comm, rate))
    return groups


def _blocks(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals [s, e) as disjoint blocks [lo, hi), in order."""
    order = np.argsort(s, kind="stable")
    s, e = s[order], np.maximum.accumulate(e[order])
    fresh = np.ones(len(s), dtype=bool)
    fresh[1:] = s[1:] > e[:-1]  # a block starts past everything before it
    return s[fresh], e[np.append(np.flatnonzero(fresh)[1:] - 1, len(s) - 1)]


def finish_times(lo: np.ndarray, hi: np.ndarray, f: float, start: np.ndarray, work: np.ndarray) -> np.ndarray:
    """When tasks started at ``start`` with ``work`` seconds of work alone end, running at f of
    their rate inside the blocks [lo, hi) and at 1 outside. With C(x) the blocks' length before
    x, u(x) = x − (1 − f)·C(x) is the work done by x from 0, piecewise linear and increasing
    (slope f inside a block, 1 outside): the end is u⁻¹(u(start) + work), exact."""
    edges, u_edges = np.empty(2 * len(lo)), np.empty(2 * len(lo))
    edges[0::2], edges[1::2] = lo, hi
    covered = np.concatenate([[0.0], np.cumsum(hi - lo)])  # C at each block's start, and at the last's end
    u_edges[0::2], u_edges[1::2] = lo - (1.0 - f) * covered[:-1], hi - (1.0 - f) * covered[1:]

    def u(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(edges, x, side="right") - 1
        kk = np.maximum(k, 0)
        return np.where(k >= 0, u_edges[kk] + (x - edges[kk]) * np.where(kk % 2 == 0, f, 1.0), x)

    y = u(start) + work
    k = np.searchsorted(u_edges, y, side="right") - 1
    kk = np.maximum(k, 0)
    return np.where(k >= 0, edges[kk] + (y - u_edges[kk]) / np.where(kk % 2 == 0, f, 1.0), y)


def overlapped_durations(groups: list[tuple[np.ndarray, np.ndarray, float]], base: np.ndarray,
                         start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``base`` durations with every compute task of ``groups`` (``overlap_groups``) as long
    as its base duration's work takes from its start on the timeline (``start``, ``end``) at f
    of its rate inside the union of its device's collectives' intervals, 1 outside
    (``finish_times``), f the device's overlap rate."""
    out = base.copy()
    for work, comm, f in groups:
        comm = comm[end[comm] > start[comm]]
        if not len(comm):
            continue
        lo, hi = _blocks(start[comm], end[comm])
        s, d = start[work], base[work]
        j = np.minimum(np.searchsorted(hi, s, side="right"), len(lo) - 1)  # the first block ending past s
        beside = (hi[j] > s) & (lo[j] < s + d)  # [s, s + d) meets a block: slowed; else its base, as is
        out[work[beside]] = finish_times(lo, hi, f, s[beside], d[beside]) - s[beside]
    return out


def overlapped_times(tg: TaskGraph, topology: Topology, start: np.ndarray, end: np.ndarray,
                     base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The timeline (``start``, ``end``: the event loop's on the ``base`` durations, default
    the graph's) after ``PASSES`` passes of ``overlapped_durations``; unchanged where no device
    slows beside its collectives or none of its compute runs beside one."""
    if not overlapped(topology) or not len(tg):
        return start, end
    base = tg.arrays()[0] if base is None else base
    groups = overlap_groups(tg, topology, base)
    if not groups:
        return start, end
    return settled_times(tg, start, end, base, lambda s, e: overlapped_durations(groups, base, s, e))
