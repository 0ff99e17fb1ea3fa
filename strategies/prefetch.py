"""Where each level-3 all-gather is issued (ZeRO-3 prefetch, as FSDP2's ``fully_shard``): one
rule the simulator times (``simulator.zero3``), the memory model counts (``gathered_bytes``)
and the executor runs (``executor.gathered``).

FSDP2 issues the next unit's all-gather while the current unit computes: in the forward the
next module's (implicit prefetch on the all-gather stream, or
``FSDPModule.set_modules_to_forward_prefetch``), in the backward the next module in backward
order (``set_modules_to_backward_prefetch``, one by default). Here a unit is a step of a
device's run order (``strategies.schedule.device_order``: a partition's forward or backward,
both passes and every micro-batch in one sequence) that all-gathers level-3 weights
(``Strategy.fsdp_unit`` "op"), or the consecutive steps of one instance of a repeated block
in one pass and micro-batch ("block": a transformer layer, FSDP2's ``fully_shard`` per
layer). A unit's all-gathers (each step's recomputations' first, then its own;
``strategies.zero.gather_groups``) are all issued at the start of the previous gathering
unit's first gathering step (the first unit's at its own) and each waited right before the
step reading it computes; a block unit's groups on one device set are one call
(``calls_at``, FSDP2's one all-gather per unit). A recomputed op whose recomputation runs in a
step of its own backward unit (``recomputed_in_unit``) is gathered once by that call, for the
recomputation and the backward (FSDP2's ``_pre_forward`` returns early in the backward, so a
checkpointed layer's recomputation reads the weights its pre-backward unshard gathered).
Issue order on a device is its run order, so every member of a group issues the group's calls
in the same order. A prefetched gather's buffer is alive from
its issue to the end of the step that reads it.
"""

from __future__ import annotations

import functools
from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np

from strategies.graph import OpGraph
from strategies.lowering import Lowered
from strategies.memo import per_lowered
from strategies.drops import drop_positions
from strategies.precision import reduce_scale
from strategies.repeats import repeated_blocks
from strategies.schedule import Step
from strategies.zero import gather_groups
from strategies.zero_alike import alike_readers, step_sums

__all__ = ["issue_positions", "own_positions", "issued_at", "calls_at", "call_key", "gathered_bytes", "block_units",
           "step_units", "recomputed_in_unit"]


@functools.lru_cache(maxsize=8)
def block_units(graph: OpGraph) -> dict[str, tuple[int, int]]:
    """Op -> (repeated block, instance) for the ops of every repeated block's instances
    (``strategies.repeats.repeated_blocks``: a transformer's layers), the units of
    ``fsdp_unit`` "block" (FSDP2's ``fully_shard`` per layer)."""
    return {op: (b, k) for b, block in enumerate(repeated_blocks(graph))
            for k, instance in enumerate(block.instances) for op in instance}


def step_units(lowered: Lowered, order: Sequence[Step]) -> list[Hashable] | None:
    """Each step's unit in a device's run order under the plan's ``fsdp_unit``: None for
    "op" (every step its own unit); for "block", (pass, micro-batch, block, instance) of a
    step of a repeated block's op, None for any other step (its own unit)."""
    if lowered.strategy.fsdp_unit != "block":
        return None
    blocks = block_units(lowered.graph)
    return [(s.backward, s.microbatch, blocks[s.op]) if s.op in blocks else None for s in order]


@per_lowered
def recomputed_in_unit(lowered: Lowered) -> frozenset[str]:
    """Under ``fsdp_unit`` "block": the recomputed ops reading level-3 weights whose
    recomputation runs in their own backward unit (the executor recomputes an op at the backward
    step of the last op of its dropped chain, ``strategies.drops.drop_positions``, or at its
    own where it keeps its output; both ops of one repeated block's instance), so that unit's
    call lists its groups for the recomputation and the backward and gathers them once. A chain
    reaching into another unit (or whose point differs between devices) is gathered twice."""
    strategy = lowered.strategy
    if strategy.fsdp_unit != "block":
        return frozenset()
    blocks = block_units(lowered.graph)
    readers = {u.op for u in gather_groups(lowered) if u.zero == 3 and strategy[u.op].recompute and u.op in blocks}
    if not readers:
        return frozenset()
    names = [node.name for node in lowered.graph]
    drops = drop_positions(lowered.graph, strategy, {name: i for i, name in enumerate(names)})
    return frozenset(op for op in readers if op not in drops or (
        len({r for _, _, r in drops[op]}) == 1 and blocks.get(names[drops[op][0][2]]) == blocks[op]))


def issue_positions(gathers: Sequence[bool], units: Sequence[Hashable] | None = None) -> list[int]:
    """For a device's run order (``gathers[q]``: step q all-gathers level-3 weights;
    ``units[q]``: its unit, consecutive steps of one unit forming it, None: its own; no
    ``units``: every step its own unit, ``own_positions``): the position at whose start step
    q's all-gathers are issued: the first gathering step of the previous unit that gathers (one
    unit ahead, FSDP2's default), the first gathering unit's at its own first gathering step; a
    step gathering nothing its own."""
    if units is None:
        return own_positions(np.asarray(gathers, dtype=bool)).tolist()
    out: list[int] = []
    prev = first = None  # the previous gathering unit's first gathering step; the current unit's
    key: object = None
    for q, g in enumerate(gathers):
        unit = None if units is None else units[q]
        if q == 0 or unit is None or unit != key:  # a new unit
            prev = first if first is not None else prev
            first, key = None, unit
        if g:
            first = q if first is None else first
            out.append(prev if prev is not None else first)
        else:
            out.append(q)
    return out


def own_positions(gathers: np.ndarray) -> np.ndarray:
    """``issue_positions`` where every step is its own unit, as an array: a gathering step at
    the previous gathering step (the first one at its own), any other step at its own."""
    out = np.arange(len(gathers))
    at = np.flatnonzero(gathers)
    out[at[1:]] = at[:-1]
    return out


def issued_at(gathers: Sequence[bool], units: Sequence[Hashable] | None = None) -> list[list[int]]:
    """At each position of a run order, the positions whose all-gathers are issued at its
    start (``issue_positions``), ascending: the order they are issued in."""
    out: list[list[int]] = [[] for _ in gathers]
    for q, p in enumerate(issue_positions(gathers, units)):
        if gathers[q]:
            out[p].append(q)
    return out


T = TypeVar("T", bound=Hashable)


def calls_at(gathers: Sequence[Sequence[T]], units: Sequence[Hashable] | None,
             key: Callable[[T], Hashable]) -> list[list[tuple[Hashable, tuple[T, ...]]]]:
    """The all-gather calls issued at each position of a run order (``gathers[q]``: what step q
    gathers, in call order; ``units`` as ``issue_positions`` takes them): a step of no unit
    (None) makes one call per gather, keyed by the gather itself; a unit's gathers with one
    ``key`` (device set and dtype) are one call (FSDP2's one all-gather per ``fully_shard``
    unit), keyed (unit, key), in the order of their first gather. Each call as (its key, its
    gathers): the key names the call alike on every member."""
    flags = [bool(g) for g in gathers]
    out: list[list[tuple[Hashable, tuple[T, ...]]]] = []
    for qs in issued_at(flags, units):
        calls: dict[Hashable, list[T]] = {}
        for q in qs:
            unit = None if units is None else units[q]
            for i, x in enumerate(gathers[q]):
                calls.setdefault(("own", q, i) if unit is None else (unit, key(x)), []).append(x)
        out.append([(k, tuple(xs)) for k, xs in calls.items()])
    return out


@per_lowered
def gathered_bytes(lowered: Lowered) -> tuple[int, ...]:
    """Per device, the most its level-2 and level-3 uses hold besides their chunks at once: at
    a step reading such shards, each of its groups' full gradient before the reduce-scatter
    (with its float32 copy where the plan reduces in float32, ``Strategy.reduce_dtype``) and,
    at level 3, the gathered weights (2 × the group's bytes at level 3, 1 × at level 2; a
    partition's groups are all gathered at its step), plus the buffers of the all-gather calls
    issued at or before this step (``calls_at``) whose last reader comes later, each alive from
    its issue to its last reader (which copies it out). A folded lowering's device holds what
    the kept device it is the image of holds (``Copies.rep_array``: a member fold's member m ≥ 2
    device reads its own shards through partitions the lowering does not keep)."""
    n = lowered.strategy.num_devices
    groups = gather_groups(lowered)
    level3 = np.array([u.zero == 3 for u in groups], dtype=np.int64)
    nbytes = np.array([u.nbytes for u in groups], dtype=np.int64)
    # the gradient, and where the plan reduces in float32 its copy cast up for the reduce-scatter
    # (FSDP2's reduce_dtype: foreach_reduce copies the gradients into a float32 input)
    held = (level3 + 1 + np.array([_widened(lowered.strategy, u) for u in groups], dtype=np.int64)) * nbytes
    gathered = [(u.nbytes, call_key(u)) if u.zero == 3 else None for u in groups]  # a unit's calls' items
    out = [0] * n
    for c in alike_readers(lowered):  # the walk once per class: its members hold alike
        gathers, ahead_bytes, holds = step_sums(c, level3, level3 * nbytes, held)
        units = step_units(lowered, c.order) if level3.any() else None  # else nothing is prefetched
        if units is None:
            ahead = _ahead_own(gathers > 0, ahead_bytes)
        else:
            each = tuple(tuple((q, gathered[g]) for g in gs if gathered[g] is not None) for q, gs in enumerate(c.reads))
            ahead = np.array(_ahead(calls_at(each, units, _second_key)), dtype=np.int64)
        alive = np.cumsum(ahead[:-1])  # the buffers alive at each position
        # every step of a reading order reads some group (``AlikeReaders.order``)
        most = int((holds + alive).max()) if len(holds) else 0
        for d in c.devices:
            out[d] = most
    if lowered.copies is not None:  # a member m >= 2 holds its member-1 image's (it reads no kept partition)
        return tuple(out[r] for r in lowered.copies.rep_array(n).tolist())
    return tuple(out)


def _widened(strategy, group) -> int:
    """Bytes of the float32 copy a group's gradient is reduce-scattered from, per gradient
    byte: ``reduce_scale`` where it is above 1 (the compute-dtype gradient is cast up), else 0."""
    wide = reduce_scale(strategy, group.shards[0].dtype)
    return wide if wide > 1 else 0


def _ahead(calls: list[list[tuple[Hashable, tuple]]]) -> list[int]:
    """Prefetched bytes alive at each position of a run order, as a difference array: each of
    ``calls`` (``gathered_bytes``' per position) issued before its last reader adds its
    groups' bytes from its issue to that reader (which copies it out)."""
    ahead = [0] * (len(calls) + 1)
    for p, at in enumerate(calls):
        for _, call in at:
            last = max(q for q, _ in call)
            if p < last:
                nbytes = sum(u[0] for _, u in call)
                ahead[p] += nbytes
                ahead[last] -= nbytes
    return ahead


def _ahead_own(gathers: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """``_ahead`` of ``calls_at``, every step its own unit (``gathers[q]``: step q gathers,
    ``nbytes[q]`` bytes): each gather is its own call, issued at its step's ``own_positions``
    and read last there, so a step's gathers add their bytes from its issue position to it."""
    ahead = np.zeros(len(gathers) + 1, dtype=np.int64)
    q = np.flatnonzero(gathers)
    p = own_positions(gathers)[q]
    np.add.at(ahead, p, nbytes[q] * (p < q))
    np.add.at(ahead, q, -nbytes[q] * (p < q))
    return ahead


def _second_key(item: tuple) -> Hashable:
    """The call key of ``gathered_bytes``' (position, (bytes, call key)) items."""
    return item[1][1]


def call_key(group) -> Hashable:
    """(device set, dtype) of a level-3 group: what one call of a unit moves together."""
    return group.devices, group.shards[0].dtype
