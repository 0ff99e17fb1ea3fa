"""The order each device runs its steps in, as task-graph edges (``simulator.tasks.build_tasks``):
the schedule's steps chained per device, the sends, receives and collective calls placed in
their steps, the gradient buckets' start points, and the order read back by name."""

from __future__ import annotations

import numpy as np

from simulator.taskgraph import INDEX, StepOrder, TaskGraph
from strategies.lowering import Lowered
from strategies.schedule import Step, chunk_of, device_passes

__all__ = ["before_inside", "bucket_ready", "device_steps", "link_schedule"]


def link_schedule(tg: TaskGraph, lowered: Lowered, steps: np.ndarray, first: np.ndarray,
                   slots: np.ndarray, arrivals: np.ndarray
                   ) -> tuple[dict[int, list[int]], tuple[np.ndarray, np.ndarray]]:
    """Each device runs the schedule's order (strategies/schedule.py): per micro-batch its
    forwards in graph and partition order (a stable sort by device and micro-batch), a backward
    pass running them in reverse. A step starts once the one before it is done, a blocking sum
    in it included (the executor's collectives run inside its forward and backward steps), and
    the sends at the end of the step before; a receive in a step starts once the step before
    it is done, and so does a member's call of a collective (``arrivals``: rows (the
    collective's task, the call's step's first task), global ids; ``simulator.collectives``:
    the collective waits on every member's call), and the sends at the end of
    the step before (the host sends them first). ``steps``, ``slots``: the blocks' rows
    (``simulator.tasks._Block``); returns each device's last step and the sends after it (its backward pass is
    over after them), and the receives and the collectives called inside steps as (each one's
    step's first task, it), which ``build_tasks`` has wait on the buckets' packs before the step too."""
    n, m = tg.num_devices, lowered.strategy.microbatches
    chunk = chunk_of(lowered)  # interleaved: a step is one chunk's partitions (strategies.chunks)
    v = 1 + max(chunk.values()) if chunk else 1
    key = steps[1] * m + steps[2]
    if chunk:
        of_op = np.fromiter((chunk[node.name] for node in lowered.graph), INDEX, len(lowered.graph))
        key = key * v + of_op[steps[5]]
    order = np.argsort(key.astype(np.min_scalar_type(n * m * v)), kind="stable")  # small ints: a radix sort
    at = first[steps[5]]
    ts, fd, bd = ((steps[r] + at)[order] for r in (0, 3, 4))
    rts, rbd, size = ts[::-1] + 1, bd[::-1], len(ts)  # a backward pass: its forwards' slice reversed
    bounds = np.concatenate([[0], np.cumsum(np.bincount(key, minlength=n * m * v))]).tolist()
    all_passes = device_passes(lowered)
    devices = [d for d in range(n) if bounds[(d + 1) * m * v] > bounds[d * m * v]]
    seq, ends, device_ends, total = [], [], [], 0
    for d in devices:
        for backward, j, c in all_passes[d]:
            lo, hi = bounds[(d * m + j) * v + c], bounds[(d * m + j) * v + c + 1]
            seq.append(rts[size - hi:size - lo] if backward else ts[lo:hi])
            ends.append(rbd[size - hi:size - lo] if backward else fd[lo:hi])
            total += hi - lo
        device_ends.append(total - 1)  # the position of its last step in ``seq``
    seq, ends = np.concatenate(seq), np.concatenate(ends)
    tg.step_order = StepOrder(devices, seq, device_ends)
    chained = np.ones(len(seq) - 1, dtype=bool)
    chained[device_ends[:-1]] = False
    tg.chunks.append((ends[:-1][chained], seq[1:][chained]))
    last = {d: [e] for d, e in zip(devices, ends[device_ends].tolist())}
    none = np.empty(0, dtype=INDEX)
    if not (slots.shape[1] or arrivals.shape[1]):
        return last, (none, none)
    task, step = slots[0] + first[slots[1]], slots[2] + first[slots[3]]
    before = slots[4].astype(bool)
    link = np.full(len(tg), -1, dtype=INDEX)
    link[seq[:-1][chained]] = seq[1:][chained]  # a step's first task -> the next step's
    sends, after = task[~before], link[step[~before]]
    sent = after >= 0
    tg.chunks.append((sends[sent], after[sent]))
    device_of_last = dict(zip(seq[device_ends].tolist(), devices))
    for s, t in zip(step[~before][~sent].tolist(), sends[~sent].tolist()):  # after a device's last step
        last[device_of_last[s]].append(t)  # its step end waits on it
    link[:] = -1
    link[seq[1:][chained]] = ends[:-1][chained]  # a step's first task -> the end of the one before
    inside, at = np.concatenate([task[before], arrivals[0]]), np.concatenate([step[before], arrivals[1]])
    inside, at = inside.astype(INDEX), at.astype(INDEX)
    prior = link[at]
    has = prior >= 0  # no step before a device's first
    tg.chunks.append((prior[has], inside[has]))
    if sent.any():  # and after the sends at the end of the step before
        tg.chunks.append(before_inside(sends[sent], after[sent], at, inside))
    return last, (at, inside)


def before_inside(tasks: np.ndarray, steps: np.ndarray, at: np.ndarray, inside: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Edges from each of ``tasks`` (run by a device's host right before the step whose first
    task is ``steps[i]``: a send at the end of the step before, a bucket's pack) to every task
    ``inside`` that step (``at``: each one's step, its first task): a receive or a collective's
    call in a step starts after what the host did before the step (the executor runs them in
    that order, ``runtime.Executor.step``), not only after the step before it."""
    order = np.argsort(at, kind="stable")
    at, inside = at[order], inside[order]
    lo, hi = np.searchsorted(at, steps, "left"), np.searchsorted(at, steps, "right")
    cnt = hi - lo
    total = int(cnt.sum())
    pick = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(lo, cnt)
    return np.repeat(tasks, cnt).astype(INDEX), inside[pick].astype(INDEX)


def bucket_ready(tg: TaskGraph, position: dict[str, int], blocks: list, first: np.ndarray,
                  issues: dict) -> dict[tuple, tuple[int, int | None]]:
    """(gradient bucket, member device) -> where its collective starts there: the end of the
    backward step after which the member starts it (``issues``: ``strategies.overlap.bucket_issues``) and
    the first task of the device's next step, which waits on it (the executor starts it
    between the two), None after the device's last step. ``position``: each op's block's."""
    if not issues:
        return {}
    order = tg.step_order
    ends = dict(zip(order.devices, order.last))
    pairs, bwd, after, until = [], [], [], []  # per distinct (device, step): its backward task, end, device's last place
    for d, mine in issues.items():
        step = None
        for key, now in mine:
            if now is not step:  # a device's buckets share a step while none before is ready later
                step = now
                i = position[step.op]
                at, fwd = int(first[i]), blocks[i]  # partitions are in index order; a folded block's by index
                bwd.append(at + fwd.fwd[step.microbatch][step.index] + 1)
                after.append(at + fwd.bwd_done[step.microbatch][step.index])
                until.append(ends[d])
            pairs.append(((key, d), len(bwd) - 1))
    place = np.full(len(tg), -1, dtype=np.int64)  # a step's first task -> its place in the step order
    place[order.tasks] = np.arange(len(order.tasks))  # each step once: every place is one task's
    at = place[bwd]
    nxt = np.where(at < until, order.tasks[np.minimum(at + 1, len(order.tasks) - 1)], -1).tolist()
    return {pair: (after[j], None if nxt[j] < 0 else nxt[j]) for pair, j in pairs}


def device_steps(tg: TaskGraph) -> dict[int, list[Step]]:
    """Device -> its schedule steps in the order ``build_tasks`` chained them, each read back
    from its first task's name: what ``strategies.schedule.device_order`` gives the executor."""
    order, names = tg.step_order, tg.name
    if order is None:
        return {}
    out, lo = {}, 0
    for d, last in zip(order.devices, order.last):
        out[d] = [Step(what == "bwd", op, index, j)
                  for what, op, index, j in (names[t] for t in order.tasks[lo:last + 1].tolist())]
        lo = last + 1
    return out
