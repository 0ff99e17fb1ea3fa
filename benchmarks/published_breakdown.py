"""Where one GPU's predicted iteration goes (``published_runs.py --breakdown``): device 0's
timeline of a row's simulation split into compute by op kind (the products of ``linear`` ops,
attention, everything else, the optimizer update, FSDP2's copies), the communication that no compute of that
device hides, by the link kinds it crosses (inside a node: ``nvswitch``; between nodes: ``ib``),
and the rest, when device 0 neither computes nor waits on its own collectives: the pipeline
bubble and waits for other devices.

Exposed communication is the union of the device's communication intervals less the union of
its compute intervals; the parts sum to the iteration."""

from __future__ import annotations

from typing import NamedTuple

from simulator.cost import CostModel
from simulator.presets import get_topology
from simulator.topology import Topology
from simulator.simulate import Lowerings, timed_graph
from simulator.taskgraph import CATEGORY, label
from simulator.zero3 import FSDP_COPY_LABELS
from strategies import OpGraph, Strategy
from strategies.precision import compute_graph

__all__ = ["Breakdown", "breakdown", "exposed", "union"]

_KINDS = {"linear": "gemm", "attention": "attention"}
"""An op kind's part of the compute (any other kind: "other")."""


class Breakdown(NamedTuple):
    """Device ``device``'s iteration in seconds: ``compute`` by part ("gemm", "attention",
    "other", "update"), ``exposed`` communication by link kinds ("ib", "nvswitch",
    "ib+nvswitch"), ``idle`` the rest."""

    iteration: float
    device: int
    compute: dict[str, float]
    exposed: dict[str, float]
    idle: float


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted disjoint (start, end) pairs."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def exposed(busy: list[tuple[float, float]], hidden: list[tuple[float, float]]) -> float:
    """Seconds of the union ``busy`` outside the union ``hidden`` (both from ``union``)."""
    total, j = 0.0, 0
    for s, e in busy:
        while j < len(hidden) and hidden[j][1] <= s:
            j += 1
        cur, k = s, j
        while k < len(hidden) and hidden[k][0] < e:
            total += max(0.0, hidden[k][0] - cur)
            cur = max(cur, hidden[k][1])
            k += 1
        total += max(0.0, e - cur)
    return total


def breakdown(graph: OpGraph, plan: Strategy, topology: Topology | str, cost: CostModel, device: int = 0,
              optimizer: str = "adam") -> Breakdown:
    """Device ``device``'s iteration of ``plan`` on ``topology`` (or the preset of that name) timed by ``cost``
    (``published_runs.row_cost``): one folded simulation as ``simulate_plan`` runs it (device 0
    is always in the simulated copy)."""
    topo = get_topology(topology) if isinstance(topology, str) else topology
    lowerings = Lowerings(graph, plan)
    tg, _, start, end = timed_graph(lowerings.first(topo, True), topo, cost, optimizer, None, True,
                                    relower=lowerings)
    kinds = {n.name: n.kind for n in compute_graph(graph, plan.compute_dtype)}
    n = topo.num_devices
    compute: dict[str, float] = {}
    busy: list[tuple[float, float]] = []
    comm: dict[str, list[tuple[float, float]]] = {}
    for t in range(len(tg)):
        res = tg.resources[t]
        if not res or tg.device[t] != device:
            continue
        links = sorted({topo.links[r - n].kind for r in res if r >= n})
        span = (float(start[t]), float(end[t]))
        if links:
            comm.setdefault("+".join(links), []).append(span)
        elif res[0] == device:
            name = tg.name[t]
            part = "update" if CATEGORY[tg.category[t]] == "update" else "fsdp copies" if label(name).startswith(
                FSDP_COPY_LABELS) else _KINDS.get(
                kinds.get(name[1]) if isinstance(name, tuple) and len(name) == 4 else None, "other")
            compute[part] = compute.get(part, 0.0) + span[1] - span[0]
            busy.append(span)
    computing = union(busy)
    shown = {k: exposed(union(v), computing) for k, v in sorted(comm.items())}
    waiting = exposed(union([s for v in comm.values() for s in v]), computing)
    iteration = float(end.max(initial=0.0))
    idle = iteration - sum(e - s for s, e in computing) - waiting
    return Breakdown(iteration, device, compute, shown, idle)
