"""The per-use tasks of level-2 and level-3 sharded weights (``ParallelConfig.zero``;
``strategies.zero.gather_groups``), as the executor runs them: for each use of a group (the
shards a reader op's partition reads on one device set, FSDP2's ``FSDPParamGroup``) and each
micro-batch, after the partition's backward one ring reduce-scatter of the group's gradients
into its chunks' (``simulator.comm``; bytes: n times a member's chunk of the group, the sum of
its chunks of the shards), which only the step end's optimizer update waits on; at level 3
(FSDP2's ``fully_shard``) also one ring all-gather of the group's chunks called at the start
of the partition's forward step, which its forward waits on, and another at the start of its
backward step, which its backward waits on (a reader op with recompute: two there, the first
for the recomputation, which the executor runs with the weights gathered at the step where it
recomputes the op, its own backward step or the one of the last op of its dropped chain,
"Recompute").
Each all-gather is issued ahead, as FSDP2 prefetches (``strategies.prefetch``): a member's call
starts at the start of the previous unit in its run order that all-gathers (a step, or a
repeated block's instance under ``fsdp_unit`` "block", whose groups on one device set are one
all-gather task, ``strategies.prefetch.calls_at``), and only the reader's step waits on it, so
the gather runs beside the steps in between.
A call is an arrival task of no duration in the member's schedule, as a lowering collective's
(``simulator.collectives``). Built afresh for every task graph from the lowering, so delta
simulation needs nothing more."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from simulator.comm import allgather_time, reduce_scatter_time, ring_links
from simulator.step import member_ends
from simulator.taskgraph import INDEX, TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.config import format_devices
from strategies.lowering import Lowered
from strategies.prefetch import call_key, calls_at, issue_positions, step_units
from strategies.schedule import Step, device_order
from strategies.zero import gather_groups
from strategies.zero_alike import alike_readers

__all__ = ["add_gathers"]


def add_gathers(tg: TaskGraph, lowered: Lowered, topology: Topology, blocks: Sequence, first: np.ndarray,
                position: dict[str, int], keep: frozenset[int] | None = None
                ) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Add every level-2 and level-3 use's tasks to ``tg`` (``blocks``, ``first``, ``position`` as
    ``simulator.collectives.add_collectives`` takes them). Returns the arrivals' places in the
    devices' schedules as rows (arrival task, the step's first task), and per device the
    reduce-scatters' ends its optimizer update waits on. ``keep``: the devices simulated
    (``simulator.fold``: each collective timed over its group, its member tasks on them)."""
    groups = gather_groups(lowered)
    ends: dict[int, list[int]] = {}
    if not groups:
        return np.empty((2, 0), dtype=INDEX), ends
    n, arrivals = topology.num_devices, []
    issue = _issue_tasks(lowered, groups, blocks, first, position, keep) if any(u.zero == 3 for u in groups) else {}
    of, calls = _unit_calls(lowered, groups, keep) if issue and lowered.strategy.fsdp_unit == "block" else ({}, {})
    made: dict = {}  # a unit's call -> its simulated members' ends, by device
    chunks = [u.chunk_bytes for u in groups]
    add, edge = tg.add, tg.edge
    uses = []  # what a group's tasks read alike in every micro-batch, found once
    for g, u in enumerate(groups):
        members = [(d, k) for d, k in zip(u.devices, u.partitions) if keep is None or d in keep]
        if members:
            again = ("recompute",) if lowered.strategy[u.op].recompute else ()  # gathered for its recomputation too
            uses.append((g, u, u.devices, "+".join(s.name for s in u.shards), members, [d for d, _ in members],
                         position[u.op], tuple(n + l for l in ring_links(topology, u.devices)),
                         ("fwd", *again, "bwd") if u.zero == 3 else ()))
    for j in range(lowered.strategy.microbatches):
        for g, u, devs, names, members, simulated, i, links, phases in uses:
            at, block = int(first[i]), blocks[i]
            chunk = chunks[g]
            for phase in phases:
                backward = phase != "fwd"
                key = of.get((g, phase, j))
                done = made.get(key)
                if done is None:
                    if key is None:
                        label, nbytes = f"allgather {phase} {names} {u.op}@mb{j} zero{u.zero}", chunk
                    else:  # one call for the unit's groups on this device set
                        (_, _, (b, c)), _ = key
                        label = f"allgather {phase} block{b}.{c} {format_devices(devs)} @mb{j} zero3"
                        nbytes = sum(chunks[x] for x, _, _ in calls[key])
                    ag = add(label, TaskKind.COLLECTIVE, allgather_time(topology, devs, nbytes), links, devs[0],
                             nbytes * len(devs))
                    for d, k in members:
                        a = add(f"call {label} device {d}", TaskKind.COLLECTIVE, 0.0, (), d)
                        edge(a, ag)
                        arrivals += (a, issue[(d, Step(backward, u.op, k, j))])
                    done = dict(zip(simulated, member_ends(add, edge, topology, ag, devs, label,
                                                           TaskKind.COLLECTIVE, simulated)))
                    if key is not None:
                        made[key] = done
                fwd = block.fwd[j]
                for d, k in members:
                    edge(done[d], at + fwd[k] + int(backward))
            label = f"reducescatter grad {names} {u.op}@mb{j} zero{u.zero}"
            rs = add(label, TaskKind.COLLECTIVE, reduce_scatter_time(topology, devs, chunk * len(devs)), links,
                     devs[0], chunk * len(devs))
            done_b = block.bwd_done[j]
            for _, k in members:
                edge(at + done_b[k], rs)
            for d, e in zip(simulated, member_ends(add, edge, topology, rs, devs, label, TaskKind.COLLECTIVE,
                                                   simulated)):
                ends.setdefault(d, []).append(e)
    return np.asarray(arrivals, dtype=INDEX).reshape(-1, 2).T, ends


def _issue_tasks(lowered: Lowered, groups: Sequence, blocks: Sequence, first: np.ndarray,
                 position: dict[str, int], keep: frozenset[int] | None = None) -> dict[tuple[int, Step], int]:
    """(device, step reading level-3 weights) -> the first task of the step at whose start the
    all-gathers that step reads are issued there (``strategies.prefetch.issue_positions``),
    found once per class of devices reading alike (``strategies.zero_alike``)."""
    at = first.tolist()  # each block's first task, as ints
    orders = device_order(lowered)
    out = {}
    for c in alike_readers(lowered):
        mine = c.devices if keep is None else [d for d in c.devices if d in keep]
        if not mine:
            continue
        flags = [any(groups[g].zero == 3 for g in gs) for gs in c.reads]
        # only a reading step's gathers are issued (a step of no gather is its own position)
        pairs = [(q, p) for q, (p, f) in enumerate(zip(issue_positions(flags, step_units(lowered, c.order)), flags))
                 if f]
        issuers = []  # (reader's position, issuer's, the issuer block's first task + backward, its forwards)
        for q, p in pairs:
            i = c.order[p]  # op, pass and micro-batch alike on every member: the partition index is each one's
            b = position[i.op]
            issuers.append((q, p, at[b] + i.backward, blocks[b].fwd[i.microbatch]))
        for d in mine:
            order = orders[d]
            for q, p, base, fwd in issuers:
                out[(d, order[q])] = base + fwd[order[p].index]
    return out


def _unit_calls(lowered: Lowered, groups: Sequence, keep: frozenset[int] | None = None) -> tuple[dict, dict]:
    """Under ``fsdp_unit`` "block": each level-3 gather (group's index in ``groups``, phase,
    micro-batch) of a unit's call -> the call's key, and each such key -> its gathers
    (``strategies.prefetch.calls_at``, the rule the executor runs: a unit's groups on one device
    set move in one all-gather), found once per class of devices reading alike
    (``strategies.zero_alike``: the same calls). ``keep``: the devices simulated; a call with a
    simulated member is found from its order."""
    keys = [call_key(u) if u.zero == 3 else None for u in groups]  # once per group: its items are keyed by it
    of: dict = {}
    calls: dict = {}
    phases_of = {}
    for c in alike_readers(lowered):
        if keep is not None and not any(d in keep for d in c.devices):
            continue
        each = []
        for s, gs in zip(c.order, c.reads):
            us = [g for g in gs if keys[g] is not None]
            if not us:
                each.append(())
                continue
            phases = phases_of.get((s.op, s.backward))
            if phases is None:
                phases = phases_of[(s.op, s.backward)] = ((("recompute", "bwd") if lowered.strategy[s.op].recompute
                                                          else ("bwd",)) if s.backward else ("fwd",))
            each.append(tuple((g, phase, s.microbatch, keys[g]) for g in us for phase in phases))
        for at in calls_at(each, step_units(lowered, c.order), _last):
            for key, items in at:
                if key[0] != "own":
                    gathers = [x[:3] for x in items]
                    calls.setdefault(key, gathers)
                    of.update(dict.fromkeys(gathers, key))
    return of, calls


def _last(item: tuple):
    """The call key ``_unit_calls`` carries last in each gather."""
    return item[-1]
