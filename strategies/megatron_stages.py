"""The pipeline stages of the megatron baseline: contiguous runs of ops, a transformer block
never split, balanced by forward FLOPs (the proxy of simulated time that ``balanced_stages``
uses too: a block's ops and its backward scale together), each boundary then moved among the
ops between two blocks to where the fewest bytes cross it (``_narrowest``): after a layer's
closing residual add, where Megatron-LM cuts its layers into stages (one tensor, the residual
stream, sent to the next stage; Narayanan et al. SC'21 §2.2, §4.1), not after the next
LayerNorm (its output read by the q, k and v products beside the residual stream). A block's
unit ends with its row-parallel linear's readers: the reduction of the linear's partial sums (an
all-reduce, or a reduce-scatter with sequence parallelism) is lowered into the op that reads
them, and Megatron-LM's ``RowParallelLinear`` reduces its output inside the layer, so no stage
boundary falls between them (partial sums sent to the next stage would cross the tensor-parallel
members of two stages, which the member fold refuses)."""

from __future__ import annotations

from typing import Sequence

from strategies.errors import PlanError
from strategies.graph import OpGraph
from strategies.stages import linear_partition

__all__ = ["megatron_stages"]

_LEAF = {"parameter", "constant", "input"}


def _units(graph: OpGraph, blocks: Sequence[tuple[tuple[str, ...], tuple[str, ...], str]]) -> list[list[str]]:
    """The ops in graph order cut into units no stage boundary may split: each block's span
    (its first op to its row linear's last reader outside the blocks, where the partial sums
    are reduced; a block read straight by the next, as in a stack of MLPs, stays its own) and
    every other op alone; inputs, weights and constants are left out (they go with their first
    reader)."""
    names = [n.name for n in graph]
    pos = {x: i for i, x in enumerate(names)}
    inside = {x for columns, middle, row in blocks for x in (*columns, *middle, row)}
    span_end = {}
    for columns, middle, row in blocks:
        ops = (*columns, *middle, row, *(u for u in graph.users(row) if u not in inside))
        lo, hi = min(pos[x] for x in ops), max(pos[x] for x in ops)
        span_end[lo] = max(span_end.get(lo, lo), hi)
    units, i = [], 0
    while i < len(names):
        hi = span_end.get(i, i)
        j = i
        while j < hi:  # overlapping spans join
            j += 1
            hi = max(hi, span_end.get(j, j))
        units.append([x for x in names[i:hi + 1] if graph[x].kind not in _LEAF])
        i = hi + 1
    return [u for u in units if u]


def _narrowest(graph: OpGraph, units: list[list[str]], starts: list[int]) -> list[int]:
    """``starts`` (each stage's first unit), each moved within the run of single-op units (the ops
    between two blocks) it falls in, staying between its neighbours, to the cut that the fewest
    output bytes cross (an op before the cut read after it; the first such cut on a tie)."""
    where = {x: k for k, u in enumerate(units) for x in u}
    crossing = []  # (first unit, last reader's unit, output bytes) of each op read past its unit
    for k, u in enumerate(units):
        for x in u:
            last = max((where[r] for r in graph.users(x) if r in where), default=k)
            if last > k:
                crossing.append((k, last, graph[x].output.nbytes))

    def cut_bytes(c: int) -> int:
        return sum(n for k, last, n in crossing if k < c <= last)

    out = list(starts)
    for i, s in enumerate(starts):
        if i == 0:
            continue
        lo, hi = s, s
        while lo - 1 > out[i - 1] and len(units[lo - 1]) == 1:
            lo -= 1
        nxt = starts[i + 1] if i + 1 < len(starts) else len(units)
        while hi + 1 < nxt and len(units[hi]) == 1:
            hi += 1
        out[i] = min(range(lo, hi + 1), key=cut_bytes)
    return out


def _runs(costs: list[int], stages: int) -> list[int]:
    """The first unit of each of ``stages`` contiguous non-empty runs minimizing the largest
    run's cost (``linear_partition``; then the costliest runs split until there are
    ``stages``)."""
    starts = linear_partition(costs, stages)
    while len(starts) < stages:  # fewer runs than stages: split the costliest run that can be
        ends = starts[1:] + [len(costs)]
        a, b = max(((a, b) for a, b in zip(starts, ends) if b - a > 1), key=lambda r: sum(costs[r[0]:r[1]]))
        half, acc, cut = sum(costs[a:b]) / 2, 0, a + 1
        for k in range(a, b - 1):
            acc += costs[k]
            cut = k + 1
            if acc >= half:
                break
        starts = sorted(starts + [cut])
    return starts


def megatron_stages(graph: OpGraph, blocks: Sequence[tuple[tuple[str, ...], tuple[str, ...], str]],
                    stages: int) -> dict[str, int]:
    """Op -> its pipeline stage (0 .. ``stages`` − 1): contiguous runs balanced by forward
    FLOPs, a block never split; an input, weight or constant on its first reader's stage.
    PlanError where ``stages`` exceeds the units (overlapping blocks join into one unit)."""
    if stages == 1:
        return {n.name: 0 for n in graph}
    units = _units(graph, blocks)
    if stages > len(units):
        raise PlanError(None, "pp", stages, f"{len(units)} units of whole blocks and the ops between "
                        f"them cannot fill {stages} pipeline stages")
    starts = _narrowest(graph, units, _runs([max(sum(graph[x].flops for x in u), 1) for u in units], stages))
    stage: dict[str, int] = {}
    for s, (a, b) in enumerate(zip(starts, starts[1:] + [len(units)])):
        for u in units[a:b]:
            for x in u:
                stage[x] = s
    for node in reversed(list(graph)):  # a leaf on its first reader's stage
        if node.name not in stage:
            readers = [stage[u] for u in graph.users(node.name) if u in stage]
            stage[node.name] = min(readers) if readers else 0
    return stage
