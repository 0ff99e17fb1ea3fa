"""The tasks of a plan's collectives (``strategies.lowered.Collective``), as the executor runs
them: each member calls one at the start of its schedule step that ``strategies.schedule
.collective_steps`` names, and a collective runs once every member has called it (a blocking
collective, torch.distributed's rule) and its inputs are ready.

Forward: a ring all-reduce, reduce-scatter or all-gather (``simulator.comm.collective_time``)
on the links of the group's ring, after every holder's forward and every member's call; each
member's readers of it (every consumer op reading it) wait on the member's end of it
(``step.member_ends``: its ``collective_overhead`` after it). Backward, where the gradient
moves: the dual collective after every reader's backward and every member's call, which the
member's holder partition's backward waits on; under a cost model whose
``input_grad_overlap`` is set (Megatron-LM's asynchronous tensor-parallel communication), that
dual runs beside its readers' parameter-gradient products, so it is charged only what the
shortest of them leaves (``hidden_by_readers``). An all-gather whose readers all recompute
is called again in the backward (``strategies.collective_buffers``: ``BufferLife.regather``),
at the step where its first reader is recomputed, and its readers' backwards wait on it.

A member's call is an *arrival* task of no duration in the device's schedule
(``simulator.tasks._link_schedule``'s slots): after the step before the call's step and what
the host runs between the two (its sends, the buckets' packs started there), before the
collective. Built afresh for every task graph from ``Lowered.collectives`` (a collective shared
by several consumer ops belongs to no one op's block), so delta simulation needs nothing more.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from simulator.comm import collective_time, ring_links
from simulator.cost import CostModel, has_trainable_params
from simulator.step import member_ends
from simulator.taskgraph import INDEX, TaskGraph, TaskKind
from simulator.topology import Topology
from strategies.collective_buffers import buffer_lives, regather_steps
from strategies.lowering import Lowered
from strategies.schedule import collective_steps

__all__ = ["add_collectives", "hidden_by_readers"]


def add_collectives(tg: TaskGraph, lowered: Lowered, topology: Topology, blocks: Sequence,
                    first: np.ndarray, position: dict[str, int], keep: frozenset[int] | None = None,
                    cost: CostModel | None = None) -> np.ndarray:
    """Add every collective's tasks to ``tg``; ``blocks``, ``first``, ``position``: each op's
    block (``simulator.tasks._Block``), its first task id and its index; ``cost``: the model
    that timed the blocks (its ``input_grad_overlap``; None: no overlap); ``keep``: the devices
    simulated (``simulator.fold``: a collective timed over its group, its member tasks and
    edges on them; one with no member there has no tasks). Returns the arrivals' places in the
    devices' schedules as rows (arrival task, the step's first task), global ids."""
    if not lowered.collectives:
        return np.empty((2, 0), dtype=INDEX)
    n = topology.num_devices
    readers = lowered.collective_readers
    arrivals: list[int] = []
    rings: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = {}  # a group's ring links and its devices shown, once
    times: dict[tuple, float] = {}
    lives = buffer_lives(lowered)
    starts = first.tolist()  # read per member: list items cost less than numpy scalars
    esrc, edst = tg.edge_src, tg.edge_dst  # edges appended in bulk, in ``tg.edge``'s order
    for life, (fwd_steps, bwd_steps) in zip(lives, collective_steps(lowered)):
        c = life.collective
        members = [(d, q) for d, q in zip(c.devices, c.holders) if keep is None or d in keep]
        if not members:
            continue
        if len(members) < len(c.devices):
            fwd_steps = {d: s for d, s in fwd_steps.items() if d in keep}
            bwd_steps = {d: s for d, s in bwd_steps.items() if d in keep}
        simulated = [d for d, _ in members]
        ring = rings.get(c.devices)
        if ring is None:
            ring = rings[c.devices] = (tuple(n + l for l in ring_links(topology, c.devices)),
                                       ",".join(map(str, c.devices)))
        j, (links, shown) = c.microbatch, ring
        holder = blocks[position[c.op]]
        at = starts[position[c.op]]
        label = f"{c.kind} {c.op}@mb{j} devices {shown}"
        f = tg.add(label, TaskKind.COLLECTIVE, _time(times, topology, c.kind, c.devices, c.nbytes), links,
                   c.devices[0], c.nbytes)
        done = holder.fwd_done[j]
        esrc += [at + done[q] for _, q in members]
        edst += [f] * len(members)
        _arrive(tg, f, fwd_steps, blocks, starts, position, arrivals, label)
        ends = dict(zip(simulated, member_ends(tg.add, tg.edge, topology, f, c.devices, label,
                                               TaskKind.COLLECTIVE, simulated)))
        mine = readers[c] if keep is None else [r for r in readers[c] if r.device in keep]
        places = [position[r.dst_op] for r in mine]
        forwards = [starts[i] + blocks[i].fwd[j][r.dst_index] for i, r in zip(places, mine)]
        esrc += [ends[r.device] for r in mine]
        edst += forwards
        if life.regather is not None:
            again = f"{c.kind} again {c.op}@mb{j} devices {shown}"
            g = tg.add(again, TaskKind.COLLECTIVE, _time(times, topology, c.kind, c.devices, c.nbytes), links,
                       c.devices[0], c.nbytes)
            steps = {d: s for d, s in regather_steps(lowered, life).items() if d in simulated}
            _arrive(tg, g, steps, blocks, starts, position, arrivals, again)
            ends = dict(zip(simulated, member_ends(tg.add, tg.edge, topology, g, c.devices, again,
                                                   TaskKind.COLLECTIVE, simulated)))
            esrc += [ends[r.device] for r in mine]
            edst += [t + 1 for t in forwards]  # the readers' backwards
        if not c.grad:
            continue
        label = f"{c.backward_kind} grad {c.op}@mb{j} devices {shown}"
        seconds = _time(times, topology, c.backward_kind, c.devices, c.nbytes)
        if cost is not None and cost.input_grad_overlap:
            seconds = max(0.0, seconds - hidden_by_readers(lowered, readers[c], topology, cost))
        b = tg.add(label, TaskKind.COLLECTIVE, seconds, links, c.devices[0], c.nbytes)
        esrc += [starts[i] + blocks[i].bwd_done[j][r.dst_index] for i, r in zip(places, mine)]
        edst += [b] * len(mine)
        _arrive(tg, b, bwd_steps, blocks, starts, position, arrivals, label)
        ends = dict(zip(simulated, member_ends(tg.add, tg.edge, topology, b, c.devices, label,
                                               TaskKind.COLLECTIVE, simulated)))
        forward = holder.fwd[j]
        esrc += [ends[d] for d, _ in members]
        edst += [at + forward[q] + 1 for _, q in members]
    return np.asarray(arrivals, dtype=INDEX).reshape(-1, 2).T


def hidden_by_readers(lowered: Lowered, reads: Sequence, topology: Topology, cost: CostModel) -> float:
    """Seconds of a collective's backward that its readers' parameter-gradient products hide
    where it runs beside them (``CostModel.input_grad_overlap``): the shortest reader's, half its
    backward (the cost model charges an op with trainable parameters 2F, its input and parameter
    gradients alike); 0 where a reader has no parameters (its backward has no product to hide
    the collective behind)."""
    hidden = float("inf")
    for r in reads:
        node = lowered.graph[r.dst_op]
        if not has_trainable_params(node):
            return 0.0
        part = lowered.pieces[r.dst_op].partitions[r.collective.microbatch][r.dst_index]
        hidden = min(hidden, cost.partition_time(node, part, topology.devices[r.device])[1] / 2)
    return 0.0 if hidden == float("inf") else hidden


def _time(known: dict, topology: Topology, kind: str, devices: tuple[int, ...], nbytes: int) -> float:
    """``collective_time``, once per (kind, group, bytes): a layer's collectives repeat in every
    micro-batch."""
    key = (kind, devices, nbytes)
    got = known.get(key)
    if got is None:
        got = known[key] = collective_time(topology, kind, devices, nbytes)
    return got


def _arrive(tg: TaskGraph, collective: int, steps: dict, blocks: Sequence, first: list[int],
            position: dict[str, int], arrivals: list[int], label: str) -> None:
    """Each member's call of ``collective`` at the start of its step (``steps``: device -> Step),
    appended to ``tg``'s tail column by column (``first``: each block's first task id)."""
    k, a = len(steps), len(tg)  # the calls' ids: a, a + 1, ...
    tail = tg.tail
    tail.name += [f"call {label} device {d}" for d in steps]
    tail.category += [TaskKind.COLLECTIVE] * k
    tail.duration += [0.0] * k
    tail.resources += [()] * k
    tail.device += list(steps)
    tail.nbytes += [0] * k
    tg.edge_src += range(a, a + k)
    tg.edge_dst += [collective] * k
    for i, s in enumerate(steps.values()):
        at = position[s.op]
        arrivals += (a + i, first[at] + blocks[at].fwd[s.microbatch][s.index] + s.backward)
