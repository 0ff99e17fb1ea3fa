"""Folded simulation: one copy of a replicated plan simulated for all (``simulator.symmetry``).

``simulator.tasks.build_tasks(..., copies=)`` builds the tasks of copy 0's devices only, and
each collective over several copies once: timed over its whole group, on the links of its
whole ring, its edges and member tasks those of copy 0's members. The full simulation's
timeline of copy r is copy 0's moved by φ_r, so the folded one gives the same times, when:

- every link a copy's own traffic may cross (the routes between two of its devices) is its
  alone, and φ_r maps copy 0's routes link by link onto copy r's (``link_maps``): copies then
  never wait on one another's links, and copy r's link sees what copy 0's sees;
- a task shared by the copies holds φ_r(L) for every copy-0 link L it holds: asking L free
  in the folded run is asking every φ_r(L) free in the full one; where it holds some images
  and not others (the loss value's all-reduce rings every device in order, through some
  copies' NICs only), it must start after the copies' own traffic on them has ended, which
  the folded timeline shows (``Folded.holds``; its ends are every copy's, and such a task
  delayed none of them and was delayed by none);
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

from simulator.linkclass import distinct_links, distinct_resources
from simulator.symmetry import Copies, CrossCopy
from simulator.taskgraph import TaskGraph
from simulator.topology import Topology

__all__ = ["FoldError", "Folded", "LinkMaps", "link_maps", "task_copies"]


class FoldError(CrossCopy):
    """The plan's pieces break its copies' symmetry (a transfer between copies, a shared task
    on one copy's links only): ``simulate_plan`` simulates it per device instead."""


class LinkMaps(NamedTuple):
    """φ on links: ``owner[l]`` is the copy whose own routes cross link l (-1: none);
    ``base[l]`` the copy-0 link whose image under φ_owner l is (-1: none)."""

    owner: np.ndarray
    base: np.ndarray


@functools.lru_cache(maxsize=32)
def link_maps(topology: Topology, copies: Copies) -> LinkMaps | None:
    """The link maps of ``copies`` on ``topology`` (``LinkMaps``), or None where one copy's
    routes share a link with another's or do not map link by link onto copy 0's (G² routes
    per copy; kept per topology and copies)."""
    first = np.asarray(copies.copies[0], dtype=np.int64)
    i, k = np.nonzero(~np.eye(len(first), dtype=bool))  # every ordered pair of copy 0's devices
    routes = topology.route_links(first[i], first[k])
    held = routes >= 0
    at = np.flatnonzero(held)  # the (pair, hop) cells of copy 0's routes, row by row
    n = len(topology.links)
    l0 = routes.ravel()[at]
    code = np.full(n, -1, dtype=np.int64)  # link l -> r * n + l0: copy r's routes cross l where copy 0's cross l0
    image = np.full(n, -1, dtype=np.int64)  # within one copy: l0 -> l
    for r, copy in enumerate(copies.copies):
        copy = np.asarray(copy, dtype=np.int64)
        mapped = topology.route_links(copy[i], copy[k])
        if mapped.shape != routes.shape or not np.array_equal(mapped >= 0, held):
            return None  # a route of another length
        link, source = mapped.ravel()[at], r * n + l0
        image[l0] = link  # duplicates: the last write stands; a map where every write agrees
        if not np.array_equal(image[l0], link) or (code[link] >= 0).any():
            return None  # φ_r not a map, or a link an earlier copy's routes cross
        code[link] = source
        if not np.array_equal(code[link], source):
            return None  # a link of two copy-0 links
    owner = np.where(code >= 0, code // n, -1)
    base = np.where(code >= 0, code % n, -1)
    return LinkMaps(owner, base)


class Folded(NamedTuple):
    """What a folded task graph needs besides its tasks (``task_copies``)."""

    count: int
    """R, the copies folded onto copy 0."""
    copies: np.ndarray
    """How many tasks of the full simulation each task stands for: the copy count for a
    copy-0 task, 1 for a task holding a link outside copy 0's own (a collective over copies)."""
    tasks: np.ndarray
    """Shared tasks that hold some image of a copy-0 link ``links[i]`` but not all of them."""
    links: np.ndarray
    """Their copy-0 links."""
    internal: tuple[np.ndarray, np.ndarray]
    """(task, link) of every copy-0 task on one of ``links``, each of its links there (what
    ``holds`` compares the asymmetric tasks with)."""
    held: tuple[frozenset[int], ...]
    """Per asymmetric (task, link): the copies whose image of the link the task holds."""

    def coarser(self) -> int | None:
        """The most copies, fewer than now, under which every asymmetric task is symmetric:
        R' dividing R with each ``held`` set unchanged by a shift of R / R' copies (copy k of
        R' joins copies k·R/R' .. of R, ``symmetry.copies_of``); None: none above 1."""
        count = self.count
        for fewer in range(count // 2, 1, -1):
            step = count // fewer
            if count % fewer == 0 and all({(r + step) % count for r in rs} == rs for rs in self.held):
                return fewer
        return None

    def holds(self, start: np.ndarray, end: np.ndarray) -> bool:
        """Whether the timeline (``start``, ``end``) is every copy's: each asymmetric shared
        task starts after every copy-0 task on its link has ended, so it delayed none of them,
        and their images (which it holds in some copies, not in others) did not delay it."""
        if not len(self.tasks):
            return True
        task, link = self.internal
        last = np.full(int(self.links.max()) + 1, -np.inf)
        inside = link <= self.links.max()
        np.maximum.at(last, link[inside], end[task[inside]])
        return bool(np.all(start[self.tasks] >= last[self.links]))


def task_copies(tg: TaskGraph, maps: LinkMaps, count: int | None = None) -> Folded:
    """``Folded`` of the folded graph ``tg``: each task's copy count, and the shared tasks that
    hold copy links asymmetrically (some of a copy-0 link's images, not all): the loss value's
    all-reduce rings every device through some copies' NICs only. Exact only where such a task
    runs after the copies' own traffic on those links (``Folded.holds``). ``count``: the copies
    ``maps`` were made of (None: ``tg.copies``')."""
    count = tg.copies.count if count is None else count
    distinct, which = distinct_resources(tg)  # worked out per distinct tuple: the rings repeat
    n, num_links = tg.num_devices, tg.num_links
    tup, link = distinct_links(distinct, n)
    owner = maps.owner[link]
    shared = np.zeros(len(distinct), dtype=bool)
    shared[tup[owner != 0]] = True
    mine = shared[tup]
    owned = mine & (owner >= 0)
    key = tup[owned] * num_links + maps.base[link[owned]]  # base: the copy-0 link each owned link is the image of
    keys, counts = np.unique(key, return_counts=True)
    odd = keys[counts != count]
    held: list[frozenset[int]] = []
    if len(odd):
        pick = np.isin(key, odd)
        order = np.argsort(key[pick], kind="stable")
        k, r = key[pick][order], owner[owned][pick][order]
        cuts = np.flatnonzero(np.diff(k)) + 1
        held = [frozenset(part.tolist()) for part in np.split(r, cuts)]
    none = np.empty(0, dtype=np.int64)
    odd_at, odd_of = _per_task(odd // num_links, len(distinct), which) if len(odd) else (none, none)
    # the copy-0 tasks on the links an asymmetric task holds, what ``holds`` compares it with
    # (not every copy-0 task's every link: a collective's ring holds many, on many tasks)
    inner = ~mine & np.isin(link, odd % num_links)
    in_at, in_of = _per_task(tup[inner], len(distinct), which) if inner.any() else (none, none)
    return Folded(count, np.where(shared[which], 1, count), odd_at, odd[odd_of] % num_links,
                  (in_at, link[inner][in_of]), tuple(held[i] for i in odd_of.tolist()))


def _per_task(of: np.ndarray, distinct: int, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries listed per distinct tuple (``of``: each one's tuple, ascending) repeated for every
    task holding that tuple (``which``): (each entry's task, its index in ``of``), by task."""
    lo = np.searchsorted(of, np.arange(distinct), "left")
    cnt = (np.searchsorted(of, np.arange(distinct), "right") - lo)[which]
    total = int(cnt.sum())
    at = np.repeat(np.arange(len(which), dtype=np.int64), cnt)
    return at, np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(lo[which], cnt)
