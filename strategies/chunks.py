"""The model chunks of an interleaved pipeline (Narayanan et al. SC'21, section 2.2.2): each
pipeline rank holds v chunks, stages r, r + P, ..., r + (v − 1)·P of P·v, and runs its
micro-batches through them in Megatron-LM's interleaved order (``strategies.schedule``).

A plan says it by its configs alone: the devices split into P disjoint *ranks* (device sets no
op's devices cross), numbered by the first op (graph order, inputs, weights and constants left
out) that runs on each; the ops in graph order form runs of consecutive ops on one rank, and
run s must be on rank s mod P, P·v runs with v >= 2. An op's *chunk* is its run's index // P;
an input, weight or constant takes the lowest chunk of its readers on its rank (it is loaded
before any of them reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from strategies.errors import PlanError

__all__ = ["Chunks", "LEAF_KINDS", "pipeline_chunks"]

LEAF_KINDS = frozenset({"parameter", "constant", "input"})
"""Ops that compute nothing: they go with their first reader's chunk."""

_CACHE: dict[int, tuple[object, object, "Chunks"]] = {}


@dataclass(frozen=True)
class Chunks:
    """An interleaved plan's pipeline: ``ranks`` (P) disjoint device sets of ``chunks`` (v)
    model chunks each."""

    ranks: int
    chunks: int
    rank: Mapping[int, int]
    """Device -> its pipeline rank (0 .. P − 1)."""
    chunk: Mapping[str, int]
    """Op -> its chunk on its rank (0 .. v − 1)."""


def _bad(rule: str) -> PlanError:
    return PlanError(None, "schedule", "interleaved", rule)


def pipeline_chunks(graph, strategy) -> Chunks:
    """The ranks and chunks of an ``interleaved`` plan (module docstring); PlanError in one
    line where its ops' devices are not P·v runs on P ranks, v >= 2, run s on rank s mod P, or
    where the micro-batches are not a multiple of P (Megatron-LM's rule)."""
    hit = _CACHE.get(id(strategy))
    if hit is not None and hit[0] is strategy and hit[1] is graph:
        return hit[2]
    parent: dict[int, int] = {}

    def find(d: int) -> int:
        while parent.setdefault(d, d) != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for node in graph:
        devices = strategy[node.name].devices
        for d in devices[1:]:
            parent[find(d)] = find(devices[0])
    computing = [n for n in graph if n.kind not in LEAF_KINDS]
    runs: list[int] = []  # each run's root device
    run_of: dict[str, int] = {}
    for node in computing:
        root = find(strategy[node.name].devices[0])
        if not runs or runs[-1] != root:
            runs.append(root)
        run_of[node.name] = len(runs) - 1
    order = list(dict.fromkeys(runs))
    p, s = len(order), len(runs)
    if s % p or s // p < 2 or any(root != order[i % p] for i, root in enumerate(runs)):
        raise _bad(f"the ops in graph order make {s} run(s) of consecutive ops on {p} disjoint device set(s) "
                   f"(ranks {[find(d) for d in order]} by first device); interleaved needs P·v runs, v >= 2, "
                   "run s on rank s mod P")
    m = strategy.microbatches
    if m % p:
        raise PlanError(None, "microbatches", m, f"the interleaved schedule needs a multiple of its {p} "
                        f"pipeline ranks ({m} % {p} = {m % p})")
    rank_of_root = {root: i for i, root in enumerate(order)}
    chunk = {name: r // p for name, r in run_of.items()}
    for node in graph:
        if node.kind in LEAF_KINDS:
            readers = [chunk[u] for u in graph.users(node.name) if u in chunk]
            chunk[node.name] = min(readers, default=0)
    out = Chunks(p, s // p, {d: rank_of_root[find(d)] for d in parent}, chunk)
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[id(strategy)] = (strategy, graph, out)
    return out
