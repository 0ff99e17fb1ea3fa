"""Where each level-3 all-gather is issued (ZeRO-3 prefetch, as FSDP2's ``fully_shard``): one
rule the simulator times (``simulator.zero3``), the memory model counts (``gathered_bytes``)
and the executor runs (``executor.gathered``).

FSDP2 issues the next unit's all-gather while the current unit computes: in the forward the
next module's (implicit prefetch on the all-gather stream, or
``FSDPModule.set_modules_to_forward_prefetch``), in the backward the next module in backward
order (``set_modules_to_backward_prefetch``, one by default). Here a unit is a step of a
device's run order (``strategies.schedule.device_order``: a partition's forward or backward,
both passes and every micro-batch in one sequence) that all-gathers level-3 weights: its
all-gathers (its recomputations' first, then its own; ``strategies.zero.gather_groups``) are
issued at the start of the previous such step (the first one's at its own start) and waited
right before it computes. Issue order on a device is its run order, so every member of a
group issues the group's calls in the same order. A prefetched gather's buffer is alive from
its issue to the end of the step that reads it.
"""

from __future__ import annotations

from typing import Sequence

from strategies.lowering import Lowered
from strategies.schedule import device_order
from strategies.zero import gather_groups

__all__ = ["issue_positions", "issued_at", "gathered_bytes"]


def issue_positions(gathers: Sequence[bool]) -> list[int]:
    """For a device's run order (``gathers[q]``: step q all-gathers level-3 weights): the
    position at whose start step q's all-gathers are issued: the previous gathering step's (one
    unit ahead, FSDP2's default), the first gathering step's its own; a step gathering nothing
    its own."""
    out, prev = [], None
    for q, g in enumerate(gathers):
        out.append(prev if g and prev is not None else q)
        prev = q if g else prev
    return out


def issued_at(gathers: Sequence[bool]) -> list[list[int]]:
    """At each position of a run order, the positions whose all-gathers are issued at its
    start (``issue_positions``), ascending: the order they are issued in."""
    out: list[list[int]] = [[] for _ in gathers]
    for q, p in enumerate(issue_positions(gathers)):
        if gathers[q]:
            out[p].append(q)
    return out


def gathered_bytes(lowered: Lowered) -> tuple[int, ...]:
    """Per device, the most its level-2 and level-3 uses hold besides their chunks at once: at
    a step reading such shards, each of its groups' full gradient before the reduce-scatter
    and, at level 3, the gathered weights (2 × the group's bytes at level 3, 1 × at level 2;
    a partition's groups are all gathered at its step), plus the level-3 weights of the next
    gathering step, prefetched (``issue_positions``) and alive from the start of this one."""
    n = lowered.strategy.num_devices
    held: dict[tuple[int, str, int], int] = {}
    full: dict[tuple[int, str, int], int] = {}
    for u in gather_groups(lowered):
        for d, k in zip(u.devices, u.partitions):
            held[(d, u.op, k)] = held.get((d, u.op, k), 0) + (2 if u.zero == 3 else 1) * u.nbytes
            if u.zero == 3:
                full[(d, u.op, k)] = full.get((d, u.op, k), 0) + u.nbytes
    out = [0] * n
    if not held:
        return tuple(out)
    for d, order in device_order(lowered).items():
        keys = [(d, s.op, s.index) for s in order]
        ahead = dict(zip(issue_positions([k in full for k in keys]), range(len(keys))))  # issuer -> next
        for p, k in enumerate(keys):
            if k in held:
                nxt = ahead.get(p)
                out[d] = max(out[d], held[k] + (full[keys[nxt]] if nxt is not None and nxt != p else 0))
    return tuple(out)
