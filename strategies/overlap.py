"""When each gradient bucket's collective starts: as DDP (Li et al. 2020, section 3.2.3) and
FSDP2 do, as soon as the gradients in it are final, overlapping the rest of the backward pass,
and waited at the step end, before the update. The one rule the simulator times
(``simulator.step``) and the executor runs (``runtime.Executor.step``).

A bucket (``BucketKey``, level 0 all-reduced, level 1 reduce-scattered; levels 2 and 3 work
per use, ``strategies.zero``) holds the gradients of weights read by its shards' ops; a device
set's shards are cut into buckets of at most about the plan's ``bucket_cap_mb`` in DDP's
reverse order (``strategies.lowered.split_buckets``), so the buckets of the last layers start
while the backward of the first still runs. On a
member device they are final after the last backward step of those ops' partitions there:
every device's last pass is the backward of the last micro-batch (``schedule.passes``), which
runs the device's forward steps in reverse, so that step is the backward, in the last
micro-batch, of the partition among them that comes first in the device's forward order
(graph order, then partition order). A partition whose autograd call is linked into a
consumer's gives its gradient earlier, in the consumer's step: never later.

torch.distributed requires one order of collectives on every member of a group, so buckets
have one global order (``bucket_order``): the bucket whose ops start latest in graph order
first (its gradients are ready first in a backward pass, DDP's reverse order of parameters),
then by key. A member issues a bucket once it and every bucket of it before it in that order
are ready (``bucket_issues``), so every member issues its buckets in that order.

A plan with ``overlap_grad_reduce`` False (Megatron-LM's ``overlap_grad_reduce=False``, its
default, and its local DDP of Narayanan et al. 2021, whose ``allreduce_gradients`` runs after
the pipeline schedule returns) issues every bucket, in that order, after the device's last
backward step (``last_steps``); the executor and the simulator start them once the pipeline
sends after that step are done too, as that schedule waits its sends before it returns.

A loss sum riding a bucket (``strategies.lowering.bucket_sums``) appends its terms, known after
the loss partitions' forwards, to the bucket's flat tensor: every forward of a device precedes
its last backward pass, so the terms are known at the bucket's issue point: those buckets start
by the same rule (the simulator's bucket task also waits on the sums' forward tasks).
"""

from __future__ import annotations

from typing import NamedTuple

from strategies.members import kept_members
from strategies.lowered import BucketKey, Lowered
from strategies.memo import per_lowered
from strategies.schedule import Step, chunk_of

__all__ = ["BucketIssue", "bucket_order", "bucket_issues", "bucket_plan", "last_steps"]


class BucketIssue(NamedTuple):
    """Bucket ``key``'s collective is started on a member device right after ``after``, that
    device's backward step (in the last micro-batch) after which it and every bucket before it
    in ``bucket_order`` are final there (without ``overlap_grad_reduce``: its last step)."""

    key: BucketKey
    after: Step


def _bucket_ops(lowered: Lowered, position: dict[str, int] | None = None, memo: dict | None = None
                ) -> tuple[dict[str, int], dict[BucketKey, set[str]]]:
    """Each op's graph position (``position`` when given), and the level-0 and level-1 buckets
    (``strategies.lowered.split_buckets``) with the ops reading their shards; ``memo``: kept
    with the last call's split (``GradientSync.shard_buckets``, by identity: the lowering
    hands back the same split while its shards are the same objects)."""
    of = lowered.gradient_sync.shard_buckets
    last = None if memo is None else memo.get("ops")
    if last is not None and last[0] is of:
        ops = last[1]
    else:
        ops = {}
        for s, key in zip(lowered.weight_shards, of):
            if key is not None and key.zero < 2:
                ops.setdefault(key, set()).update(s.ops)
        if memo is not None:
            memo["ops"] = (of, ops)
    if position is None:
        position = {node.name: i for i, node in enumerate(lowered.graph)}
    return position, ops


def _order(position: dict[str, int], ops: dict[BucketKey, set[str]]) -> list[BucketKey]:
    first = {key: min(map(position.__getitem__, names)) for key, names in ops.items()}
    return sorted(first, key=lambda k: (-first[k], k))


def bucket_order(lowered: Lowered) -> list[BucketKey]:
    """The level-0 and level-1 gradient buckets in the one order every member issues them:
    the latest first graph position of their ops first, then by key."""
    return _order(*_bucket_ops(lowered))


def bucket_issues(lowered: Lowered) -> dict[int, list[BucketIssue]]:
    """Device -> its buckets in ``bucket_order``, each with the step after which it starts."""
    return bucket_plan(lowered)[1]


def bucket_plan(lowered: Lowered, position: dict[str, int] | None = None, memo: dict | None = None
                ) -> tuple[list[BucketKey], dict[int, list[BucketIssue]]]:
    """``bucket_order`` and ``bucket_issues`` at once (of copy 0's lowering, ``Lowered.copies``:
    the issues of copy 0's devices; every copy's are their images). ``position``: each op's
    graph position, when the caller keeps it; ``memo``: a dict the caller keeps across the
    lowerings of one graph, holding each bucket's ready steps with the reader ops' partitions
    they were found from, so a plan that changes a few ops finds again only the buckets
    those ops read (the same result as without it: ``_ready``). A call with a memo for the
    lowering the last such call planned gets that call's result (``strategies.memo.per_lowered``;
    callers must not change it): one simulation's task build (``simulator.tasks``) and memory
    model (``simulator.memory_collectives``) plan the same lowering."""
    return _plan(lowered, position, None) if memo is None else _kept_plan(lowered, position, memo)


def _plan(lowered: Lowered, position: dict[str, int] | None, memo: dict | None
          ) -> tuple[list[BucketKey], dict[int, list[BucketIssue]]]:
    position, ops = _bucket_ops(lowered, position, memo)
    last = lowered.strategy.microbatches - 1
    kept = None if lowered.copies is None else lowered.copies.kept  # copy 0's lowering: its devices' issues
    out: dict[int, list[BucketIssue]] = {}
    order = _order(position, ops)
    if not lowered.strategy.overlap_grad_reduce:  # every bucket after the device's backward
        final = last_steps(lowered, kept)
        for key in order:
            for d in key.devices if kept is None else kept_members(key.devices, kept):
                out.setdefault(d, []).append(BucketIssue(key, final[d]))
        return order, out
    ready: dict[tuple[int, BucketKey], tuple[int, int, Step]] = {}  # forward position: earlier runs later
    for key, names in ops.items():
        ready.update(_ready(lowered, key, names, position, last, kept, memo))
    issued: dict[int, tuple[int, int, Step]] = {}
    for key in order:
        for d in key.devices if kept is None else kept_members(key.devices, kept):
            here = ready[(d, key)]
            issued[d] = here if d not in issued or here < issued[d] else issued[d]
            out.setdefault(d, []).append(BucketIssue(key, issued[d][2]))
    return order, out


def last_steps(lowered: Lowered, kept: frozenset[int] | None = None) -> dict[int, Step]:
    """Device -> its last step (of ``kept`` where given): the backward, in the last micro-batch,
    of its first partition in graph order among the ops of its lowest model chunk (every
    schedule's last passes are the last micro-batch's backwards, chunk v − 1 down to 0:
    ``schedule.passes``, ``schedule.interleaved_passes``), as ``schedule.device_order`` ends."""
    last = lowered.strategy.microbatches - 1
    chunk = chunk_of(lowered)
    out: dict[int, tuple[int, Step]] = {}
    for node in lowered.graph:
        c = chunk[node.name] if chunk else 0
        for p in lowered.partitions[node.name][last]:
            if (kept is None or p.device in kept) and (p.device not in out or c < out[p.device][0]):
                out[p.device] = (c, Step(True, node.name, p.index, last))
    return {d: step for d, (_, step) in out.items()}


_kept_plan = per_lowered(_plan)
"""``_plan`` of the lowering the last call with a memo planned, kept (a lowering never changes
once made; ``position`` is its graph's, whoever passes it)."""


MEMO = 4096
"""Buckets a ``bucket_plan`` memo keeps (past them it starts empty: speed, never results)."""


def _ready(lowered: Lowered, key: BucketKey, names: set[str], position: dict[str, int], last: int,
           kept: frozenset[int] | None, memo: dict | None) -> dict[tuple[int, BucketKey], tuple[int, int, Step]]:
    """(member, ``key``) -> (forward position, partition index, step) of the backward step in
    the last micro-batch after which the bucket's gradients are final on the member: the first
    partition there of the first op of ``names`` in graph order. ``memo``: kept by (bucket,
    devices simulated, micro-batch) with the reader ops and their partitions (by identity:
    the memo holds them), found again only where they differ."""
    parts = lowered.partitions
    got = None if memo is None else memo.get((key, kept, last))
    if got is not None and got[0] == names and all(parts[op] is p for op, p in got[1]):
        return got[2]
    out = {}
    todo = set(key.devices) if kept is None else set(kept.intersection(key.devices))
    for op in sorted(names, key=position.__getitem__):  # the first op with a partition on d is d's
        for k, p in enumerate(parts[op][last]):
            if p.device in todo:  # its first partition there
                todo.discard(p.device)
                out[(p.device, key)] = (position[op], k, Step(True, op, p.index, last))
        if not todo:
            break
    if memo is not None:
        if len(memo) >= MEMO:
            memo.clear()
        memo[(key, kept, last)] = (names, [(op, parts[op]) for op in names], out)
    return out
