"""Link classes: the links held by exactly the same tasks, which the event loop times as one.

The event loop (``simulator.engine``) keeps each link direction's busy intervals and places a
task in a gap every link it holds has free. Two links held by exactly the same tasks start
empty and receive the same intervals in the same order, so their interval lists are equal at
every step: a task may hold one link of each such class and is placed at the same time. The
gradient buckets of a data-parallel plan over 1,024 devices each hold the same ring of 4,096
link directions and nothing else uses them: one link stands for them, and the loop's work falls
from 578 x 4,096 interval updates to 578. The result is the same, bit for bit.

The classes are found on the distinct resource tuples (a folded graph's collectives share one
tuple object per ring): a link's class is the set of distinct tuples holding it, since tasks
with equal tuples hold equal links.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from simulator.taskgraph import INDEX, TaskGraph

__all__ = ["COMPACT_FROM", "compact_resources", "distinct_links", "distinct_resources", "known_distinct"]

COMPACT_FROM = 8
"""Resources per task, on average, from which ``compact_resources`` compacts: below, the tasks
hold a route's few links each and the pass would cost the loop more than it saves."""


def compact_resources(tg: TaskGraph) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]] | None:
    """(res_first, res, resources) of ``tg`` as ``TaskGraph.arrays`` lays them out, each task's
    links cut to one per link class (its devices kept); None where the tasks hold fewer than
    ``COMPACT_FROM`` resources each on average. Kept on the graph until it grows."""
    got = tg.memo.get("compact")
    if got is not None and got[0] == len(tg):
        return got[1]
    many = tg.resource_count() >= COMPACT_FROM * max(len(tg), 1)
    result = _compact(*distinct_resources(tg), tg.num_devices) if many else None
    tg.memo["compact"] = (len(tg), result)
    return result


def distinct_resources(tg: TaskGraph) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """(the distinct resource tuples of ``tg``'s tasks in order of first use, each task's index
    into them); kept on the graph until it grows. Worked out once per resources list: the
    blocks of twin ops share their twin's (``simulator.twins``), so a list met again holds no
    tuple not already met, and its tasks' indices are the first time's."""
    got = tg.memo.get("distinct")
    if got is not None and got[0] == len(tg):
        return got[1]
    by_value: dict[tuple[int, ...], int] = {}
    distinct: list[tuple[int, ...]] = []
    of_list: dict[int, np.ndarray] = {}  # id of a resources list (alive on the graph) -> its tasks' indices
    parts = []
    for resources in tg.column_parts("resources"):
        which = of_list.get(id(resources))
        if which is None:
            which = of_list[id(resources)] = _distinct(resources, by_value, distinct)
        parts.append(which)
    result = distinct, np.concatenate(parts)
    tg.memo["distinct"] = (len(tg), result)
    return result


def known_distinct(tg: TaskGraph) -> tuple[list[tuple[int, ...]], np.ndarray] | None:
    """``distinct_resources`` of ``tg`` where a pass found them already (the event loop's
    compaction, a fold's copy counts), else None."""
    got = tg.memo.get("distinct")
    return got[1] if got is not None and got[0] == len(tg) else None


def distinct_links(distinct: list[tuple[int, ...]], nd: int) -> tuple[np.ndarray, np.ndarray]:
    """(tuple, link) of every link the ``distinct`` resource tuples hold (resource ``nd`` + link),
    tuple after tuple in their order."""
    lens = np.fromiter(map(len, distinct), np.int64, len(distinct))
    res = np.fromiter(chain.from_iterable(distinct), np.int64, int(lens.sum()))
    tup = np.repeat(np.arange(len(distinct), dtype=np.int64), lens)
    on_link = res >= nd
    return tup[on_link], res[on_link] - nd


def _distinct(resources: list[tuple[int, ...]], by_value: dict[tuple[int, ...], int],
              distinct: list[tuple[int, ...]]) -> np.ndarray:
    """Each of ``resources``' index into ``distinct``, which gains the tuples not yet in
    ``by_value`` in order of first use."""
    ids = np.fromiter(map(id, resources), np.int64, len(resources))  # the tuples live on the graph: ids distinct
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    of_object = np.empty(len(first), dtype=np.int64)
    for k in np.argsort(first).tolist():  # each object once, in order of first use, hashed once
        r = resources[int(first[k])]
        i = of_object[k] = by_value.setdefault(r, len(distinct))
        if i == len(distinct):
            distinct.append(r)
    return of_object[inverse.reshape(-1)]


def _compact(distinct: list[tuple[int, ...]], which: np.ndarray, nd: int
             ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    holders: dict[int, list[int]] = {}  # link -> the distinct tuples holding it, ascending
    for i, r in enumerate(distinct):
        for x in r:
            if x >= nd:
                holders.setdefault(x, []).append(i)
    first: dict[tuple[int, ...], int] = {}  # class -> its first link
    rep = {x: first.setdefault(tuple(h), x) for x, h in holders.items()}
    short = []
    for r in distinct:
        seen: dict[int, None] = {}
        for x in r:
            seen[x if x < nd else rep[x]] = None
        short.append(tuple(seen))
    out = [short[i] for i in which.tolist()]
    lens = np.fromiter(map(len, out), INDEX, len(out))
    res_first = np.zeros(len(out) + 1, dtype=INDEX)
    np.cumsum(lens, dtype=INDEX, out=res_first[1:])
    return res_first, np.fromiter(chain.from_iterable(out), INDEX, int(res_first[-1])), out
