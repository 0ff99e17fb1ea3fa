"""The one fixed order in which each device runs its partitions: shared by the simulator and
the executor, so both run the same schedule (and no rank can wait on a task another rank has
not reached yet).

A device's *step* for micro-batch j is every partition it computes for j, in the graph's
topological order (forward) or its reverse (backward).

- GPipe (Huang et al. 2019): F0 F1 … F(m−1), then B0 B1 … B(m−1).
- 1F1B (PipeDream-flush, Narayanan et al. 2021): w warm-up forwards, then alternate one
  backward and one forward, then the remaining backwards. For a plain pipeline of S stages the
  device of stage s warms up w = min(m, S − s). For any plan: devices that exchange data in
  both directions (a split op across them, an interleaved placement, a shared reduction) are
  one group and share one w; the groups form a DAG along the forward data flow, and a group's w
  is min(m, 1 + the longest path from it to a sink). So w strictly falls along every edge and
  is equal inside a group, which keeps the fixed orders deadlock-free.
- Interleaved 1F1B (Narayanan et al. SC'21, section 2.2.2; ``strategies.chunks``): pipeline
  rank r of P holds v model chunks and runs (micro-batch, chunk) passes in the order of
  Megatron-LM's ``forward_backward_pipelining_with_interleaving``
  (megatron/core/pipeline_parallel/schedules.py, ``get_schedule_table`` with
  ``microbatch_group_size_per_vp_stage`` = P, its default): the forwards go by groups of P
  micro-batches through chunk 0, then chunk 1, ...; a backward runs the chunks from the last;
  W = min(2·(P − r − 1) + (v − 1)·P, v·m) warm-up forwards, then one forward and one backward
  alternately, then the remaining backwards. A device's step is then every partition it
  computes for j in one chunk (``interleaved_passes``).

Collectives (``Lowered.collectives``) are called by every member of their device group in the
same order (torch.distributed's rule): a member calls a collective's forward at the start of its
first step of the collective's first reader op in that micro-batch, and its backward at the
start of its holder partition's backward step; several at one step in ``Lowered.collectives``
order (``collective_calls``). The members of a group share one warm-up (a collective couples
them both ways), so they run the same passes and reach those steps in the same order; so do the
members of a level-2/3 weight shard (``strategies.zero``: each use's all-gathers and
reduce-scatters are collectives over them).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

from strategies.chunks import pipeline_chunks
from strategies.lowering import Lowered
from strategies.memo import per_lowered
from strategies.zero import per_use_shards

__all__ = ["Step", "CollectiveCall", "CollectiveSteps", "chunk_of", "collective_calls", "collective_steps",
           "device_order", "rank_passes", "device_passes", "interleaved_passes", "passes", "stages", "warmup",
           "warmups"]


_new = tuple.__new__


class Step(NamedTuple):
    backward: bool
    op: str
    index: int
    microbatch: int


class CollectiveCall(NamedTuple):
    """A member's call of collective ``collective`` (its index in ``Lowered.collectives``),
    forward or ``backward``, at the start of its schedule step ``step``."""

    collective: int
    backward: bool
    step: Step


def collective_steps(lowered: Lowered) -> list[tuple[dict[int, Step], dict[int, Step]]]:
    """Per collective (``Lowered.collectives`` order): member device -> the step at whose start
    it calls the forward (its first step of the collective's first reader op in that
    micro-batch), and member -> the step at whose start it calls the backward (its first
    backward step of the producer op: the last of its partitions; empty where the gradient does
    not move). Every collective a member calls at one op's step is called at the same step,
    whichever of the op's partitions read or hold it, so their order is ``Lowered.collectives``'
    on every member."""
    steps = CollectiveSteps(lowered)
    return [steps(c) for c in lowered.collectives]


class CollectiveSteps:
    """``collective_steps`` one collective at a time (``steps(c)``), each op's and micro-batch's
    partition spans found once for all."""

    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.spans: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}

    def __call__(self, c) -> tuple[dict[int, Step], dict[int, Step]]:
        lowered, j = self.lowered, c.microbatch
        first = lowered.collective_readers[c][0].dst_op
        lo, hi = _spans(lowered, first, j, self.spans), _spans(lowered, c.op, j, self.spans)
        on = [d for d in c.devices if d in lo]  # a member fold's: the kept members (strategies.lowering_members)
        fwd = {d: _new(Step, (False, first, lo[d][0], j)) for d in on}  # Steps made as the tuples they are
        bwd = {d: _new(Step, (True, c.op, hi[d][1], j)) for d in on} if c.grad else {}
        return fwd, bwd


def _spans(lowered: Lowered, op: str, microbatch: int, known: dict) -> dict[int, tuple[int, int]]:
    """Device -> (min, max) of the indices of ``op``'s partitions on it in ``microbatch``, found
    once per op and micro-batch (``known``)."""
    got = known.get((op, microbatch))
    if got is None:
        got = known[(op, microbatch)] = {}
        for p in lowered.partitions[op][microbatch]:
            was = got.get(p.device)
            got[p.device] = (p.index, p.index) if was is None else (min(was[0], p.index), max(was[1], p.index))
    return got


def collective_calls(lowered: Lowered, order: dict[int, list[Step]] | None = None) -> dict[int, list[CollectiveCall]]:
    """Device -> its collective calls in the order it makes them (module docstring): by the
    position of their step in its ``device_order`` (``order``, when the caller has it), then
    by ``Lowered.collectives`` order."""
    order = device_order(lowered) if order is None else order
    position = {d: {s: i for i, s in enumerate(steps)} for d, steps in order.items()}
    calls: dict[int, list[tuple[int, int, CollectiveCall]]] = {}
    for i, (fwd, bwd) in enumerate(collective_steps(lowered)):
        for backward, steps in ((False, fwd), (True, bwd)):
            for d, step in steps.items():
                calls.setdefault(d, []).append((position[d][step], i, CollectiveCall(i, backward, step)))
    return {d: [c for _, _, c in sorted(cs)] for d, cs in sorted(calls.items())}


def stages(lowered: Lowered) -> list[tuple[int, ...]]:
    """Device sets of the runs of consecutive ops (topological order) on one device set."""
    out: list[tuple[int, ...]] = []
    for node in lowered.graph:
        devices = lowered.strategy[node.name].devices
        if not out or devices != out[-1]:
            out.append(devices)
    return out


def warmups(lowered: Lowered) -> dict[int, int]:
    """Device -> forwards it runs before its first backward (see the module docstring); under
    the interleaved schedule, the micro-batches' worth of chunk passes it holds at most
    (``_interleaved_warmups``)."""
    m = lowered.strategy.microbatches
    devices = lowered.strategy.devices_used
    if lowered.strategy.schedule == "interleaved":
        return _interleaved_warmups(lowered)
    if lowered.strategy.schedule == "gpipe" or m == 1:
        return {d: m for d in devices}
    succ: dict[int, set[int]] = {d: set() for d in devices}
    for pieces in lowered.pieces.values():
        for a, b in pieces.couples:
            succ[a].add(b)
    for shard in per_use_shards(lowered):  # its per-use gathers and reduce-scatters couple its members
        ring = shard.devices[1:] + shard.devices[:1]
        for a, b in (*zip(shard.devices, ring), *zip(ring, shard.devices)):
            succ[a].add(b)
    group = _components(list(devices), succ)
    down: dict[int, set[int]] = {}
    for a in devices:
        for b in succ[a]:
            if group[a] != group[b]:
                down.setdefault(group[a], set()).add(group[b])
    depth: dict[int, int] = {}

    def longest(c: int) -> int:
        if c not in depth:
            depth[c] = 1 + max((longest(x) for x in down.get(c, ())), default=-1)
        return depth[c]

    return {d: max(1, min(m, 1 + longest(group[d]))) for d in devices}


def warmup(lowered: Lowered, device: int) -> int:
    """Forwards ``device`` runs before its first backward."""
    return warmups(lowered).get(device, lowered.strategy.microbatches)


def _components(nodes: list[int], succ: dict[int, set[int]]) -> dict[int, int]:
    """Strongly connected components (Kosaraju): node -> component id."""
    order: list[int] = []
    seen: set[int] = set()
    for root in nodes:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sorted(succ[root])))]
        while stack:
            node, it = stack[-1]
            nxt = next((x for x in it if x not in seen), None)
            if nxt is None:
                stack.pop()
                order.append(node)
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(succ[nxt]))))
    pred: dict[int, set[int]] = {n: set() for n in nodes}
    for a in nodes:
        for b in succ[a]:
            pred[b].add(a)
    comp: dict[int, int] = {}
    for root in reversed(order):
        if root in comp:
            continue
        comp[root] = root
        todo = [root]
        while todo:
            for x in pred[todo.pop()]:
                if x not in comp:
                    comp[x] = root
                    todo.append(x)
    return comp


def chunk_of(lowered: Lowered) -> Mapping[str, int] | None:
    """Op -> its model chunk under the interleaved schedule (``strategies.chunks``); None for
    the other schedules (one chunk: a device's step holds all its partitions of a micro-batch)."""
    if lowered.strategy.schedule != "interleaved":
        return None
    return pipeline_chunks(lowered.graph, lowered.strategy).chunk


def device_passes(lowered: Lowered) -> dict[int, list[tuple[bool, int, int]]]:
    """Device -> its passes in order, (backward?, micro-batch, chunk): ``passes`` with chunk 0
    for GPipe and 1F1B, ``interleaved_passes`` for the interleaved schedule (devices of one
    pipeline rank, or of one warm-up, share one list: read it only)."""
    s = lowered.strategy
    if s.schedule == "interleaved":
        rank, by_rank = pipeline_chunks(lowered.graph, s).rank, rank_passes(lowered.graph, s)
        return {d: by_rank[rank[d]] for d in s.devices_used}
    ws = warmups(lowered)
    by_warmup = {w: [(b, j, 0) for b, j in passes(s.microbatches, w)] for w in set(ws.values())}
    return {d: by_warmup[w] for d, w in ws.items()}


def rank_passes(graph, strategy) -> dict[int, list[tuple[bool, int, int]]]:
    """Pipeline rank -> its passes in order under the interleaved schedule (``interleaved_passes``
    of ``strategies.chunks.pipeline_chunks``' ranks and chunks): every device of a rank runs
    them (one list a rank: read it only)."""
    c = pipeline_chunks(graph, strategy)
    return {r: interleaved_passes(strategy.microbatches, c.ranks, r, c.chunks) for r in range(c.ranks)}


@per_lowered
def device_order(lowered: Lowered) -> dict[int, list[Step]]:
    """Device -> its steps in the order it runs them."""
    chunk = chunk_of(lowered)
    fwd: dict[tuple[int, int, int], list[Step]] = {}
    for node in lowered.graph:
        c = chunk[node.name] if chunk else 0
        for j, parts in enumerate(lowered.partitions[node.name]):
            for p in parts:
                fwd.setdefault((p.device, j, c), []).append(Step(False, node.name, p.index, j))
    order: dict[int, list[Step]] = {}
    all_passes = device_passes(lowered)
    for device in sorted({d for d, _, _ in fwd}):
        out: list[Step] = []
        for backward, j, c in all_passes[device]:
            steps = fwd.get((device, j, c), [])
            out += [Step(True, s.op, s.index, j) for s in reversed(steps)] if backward else steps
        order[device] = out
    return order


def passes(microbatches: int, warmup: int) -> list[tuple[bool, int]]:
    """One device's passes in order, (backward?, micro-batch): ``warmup`` forwards, then one
    backward and one forward alternately, then the remaining backwards. A backward pass runs
    the device's forward steps of that micro-batch in reverse."""
    m, w = microbatches, warmup
    out = [(False, j) for j in range(w)]
    for j in range(m - w):
        out += [(True, j), (False, j + w)]
    return out + [(True, j) for j in range(m - w, m)]


def interleaved_passes(microbatches: int, ranks: int, rank: int, chunks: int) -> list[tuple[bool, int, int]]:
    """Pipeline rank ``rank`` of ``ranks``' passes, (backward?, micro-batch, chunk), in the order
    of Megatron-LM's ``forward_backward_pipelining_with_interleaving`` (module docstring):
    forward k is ``get_schedule_table``'s entry k (groups of P micro-batches through chunk 0,
    then 1, ...), backward k the same entry with chunk v − 1 − c; W warm-up forwards, then
    forward k + W and backward k for each k, then the remaining backwards. ``microbatches`` must
    be a multiple of ``ranks``."""
    m, p, v = microbatches, ranks, chunks
    table = [(j, c) for g in range(0, m, p) for c in range(v) for j in range(g, g + p)]
    total = m * v
    w = _interleaved_warmup(p, rank, v, total)
    fwd = [(False, j, c) for j, c in table]
    bwd = [(True, j, v - 1 - c) for j, c in table]
    out = fwd[:w]
    for k in range(total - w):
        out += [fwd[k + w], bwd[k]]
    return out + bwd[total - w:]


def _interleaved_warmup(ranks: int, rank: int, chunks: int, passes_total: int) -> int:
    """Megatron-LM's warm-up forwards of pipeline rank ``rank`` (``get_pp_rank_microbatches``):
    2·(P − r − 1) + (v − 1)·P, at most every pass."""
    return min(2 * (ranks - rank - 1) + (chunks - 1) * ranks, passes_total)


def _interleaved_warmups(lowered: Lowered) -> dict[int, int]:
    """Device -> the micro-batches' worth of activations its interleaved order holds at most:
    the (micro-batch, chunk) passes in flight at its first backward, / v, rounded up (its
    ranks share one value, so the executor's checks of coupled devices hold)."""
    s = lowered.strategy
    c = pipeline_chunks(lowered.graph, s)
    total = s.microbatches * c.chunks
    out = {}
    for d in s.devices_used:  # W + 1 passes in flight once the steady state starts
        w = _interleaved_warmup(c.ranks, c.rank[d], c.chunks, total)
        out[d] = min(s.microbatches, math.ceil(min(w + 1, total) / c.chunks))
    return out
