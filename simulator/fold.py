"""Folded simulation: one copy of a replicated plan simulated for all (``simulator.symmetry``).

``simulator.tasks.build_tasks(..., copies=)`` builds the tasks of copy 0's devices only, and
each collective over several copies once: timed over its whole group, on the links of its
whole ring, its edges and member tasks those of copy 0's members. The full simulation's
timeline of copy r is copy 0's moved by φ_r, so the folded one gives the same times, when:

- every link a copy's own traffic may cross (the routes between two of its devices) is its
  alone, and φ_r maps copy 0's routes link by link onto copy r's (``link_maps``): copies then
  never wait on one another's links, and copy r's link sees what copy 0's sees;
- a task shared by the copies holds φ_r(L) for every copy-0 link L it holds (``task_copies``
  checks it): asking L free in the folded run is asking every φ_r(L) free in the full one;
- the devices do not slow each other (``simulator.contention``): its passes count a node's
  devices computing together, which copies sharing a node would change; such a topology is
  simulated per device.

The event loop places tasks by readiness, ties by task id; copy r's tasks have copy 0's ids'
order (blocks in graph order, partitions in index order, collectives in the lowering's order),
so ties fall alike. Summaries expand: a device's busy time is its copy-0 image's; bytes moved
count a copy's own transfers once per copy, a shared collective once; peak memory is the
lowering's, per device. Where any condition fails the plan is simulated per device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from simulator.symmetry import Copies
from simulator.taskgraph import TaskGraph
from simulator.topology import Topology

__all__ = ["FoldError", "LinkMaps", "link_maps", "task_copies"]


class FoldError(Exception):
    """The plan's pieces break its copies' symmetry (a transfer between copies, a shared task
    on one copy's links only): ``simulate_plan`` simulates it per device instead."""


class LinkMaps(NamedTuple):
    """φ on links: ``owner[l]`` is the copy whose own routes cross link l (-1: none);
    ``image[r, l]`` is φ_r(l) for a link l of copy 0's routes (-1 elsewhere)."""

    owner: np.ndarray
    image: np.ndarray


@functools.lru_cache(maxsize=32)
def link_maps(topology: Topology, copies: Copies) -> LinkMaps | None:
    """The link maps of ``copies`` on ``topology`` (``LinkMaps``), or None where one copy's
    routes share a link with another's or do not map link by link onto copy 0's (G² routes
    per copy; kept per topology and copies)."""
    first = copies.copies[0]
    pairs = [(i, k) for i in range(len(first)) for k in range(len(first)) if i != k]
    owner = np.full(len(topology.links), -1, dtype=np.int64)
    image = np.full((copies.count, len(topology.links)), -1, dtype=np.int64)
    route = topology.route
    base = [route(first[i], first[k]) for i, k in pairs]
    for r, copy in enumerate(copies.copies):
        for (i, k), links in zip(pairs, base):
            mapped = route(copy[i], copy[k])
            if len(mapped) != len(links):
                return None
            for l0, l in zip(links, mapped):
                if image[r, l0] not in (-1, l) or owner[l] not in (-1, r):
                    return None
                image[r, l0] = l
                owner[l] = r
        used = image[r][image[r] >= 0]
        if len(np.unique(used)) != len(used):  # φ_r one to one on links
            return None
    return LinkMaps(owner, image)


def task_copies(tg: TaskGraph, maps: LinkMaps) -> np.ndarray:
    """How many tasks of the full simulation each task of the folded graph ``tg`` stands for:
    the copy count for a copy-0 task, 1 for a task holding a link outside copy 0's own (a
    collective over several copies). Raises ``FoldError`` unless each shared task holds, with
    every copy-0 link, its images in every copy."""
    count = tg.copies.count
    _, res_first, res = tg.arrays()
    n, num_links = tg.num_devices, tg.num_links
    task = np.repeat(np.arange(len(tg), dtype=np.int64), np.diff(res_first))
    on_link = res >= n
    task, link = task[on_link], res[on_link].astype(np.int64) - n
    owner = maps.owner[link]
    shared = np.zeros(len(tg), dtype=bool)
    shared[task[owner != 0]] = True
    mine = shared[task]
    copy0 = mine & (owner == 0)
    if copy0.any():
        held = np.unique(task[mine] * num_links + link[mine])
        for r in range(1, count):
            want = task[copy0] * num_links + maps.image[r, link[copy0]]
            if not np.isin(want, held, assume_unique=False).all():
                raise FoldError(f"a collective over several copies holds a link of copy 0 but not its image in copy {r}")
    owned = np.bincount(task[mine & (owner >= 0)], minlength=len(tg))
    if np.any(owned != count * np.bincount(task[copy0], minlength=len(tg))):
        raise FoldError("a collective over several copies holds one copy's links, not every copy's")
    return np.where(shared, 1, count)
