"""Ops lowered once per shape (``strategies.lowering_cache.update``): an op whose pieces are
already known for another op of the same shape is given that op's pieces with the names
swapped, instead of being lowered again. GPT-3 175B's 96 transformer layers are the same op
kinds, shapes and weight shapes, so under one config per layer position 2,123 ops lower as ~25
(PyTorch AutoParallel's ``repeated_subgraphs`` and Calculon lower one layer for all alike).

Two ops get equal pieces up to names when ``lower_op`` reads the same of both: the op (kind,
dims, output and input specs, attrs, its weights' roles, specs and trainability), whether it
and each producer carry a gradient (``OpGraph.moves_grad``), whether it is a graph output
(``pieces.gates``), its consumers' kinds (``drops.drops_output``; their whole op, for brevity), which inputs are the same
producer, each producer's own such facts (its grid, reduction dims, Partial sums and
collectives read them), and the configs: its own, its producers', its consumers' recompute
flags (``recompute_key``), the micro-batches, devices and copy 0's devices. ``shape_key`` is
that key; ``renamed`` gives one op's pieces the other's names (op, producers, weights), every
record otherwise the same object or equal, so a lowering that shares equals one that does not
(tests/strategies/test_lowering_shared.py checks it plan by plan).

Across device blocks: a pipeline stage's layer is stage 0's cut alike on other devices, so the
first op of each shape is also kept under ``relative_key`` (its and its producers' configs with
every device counted from its own first device, and which partitions copy 0 keeps), and an op
whose shape and relative key match takes those pieces renamed and moved (``renamed(delta=)``).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Hashable, Sequence

from strategies.config import ParallelConfig
from strategies.graph import OpGraph, OpNode
from strategies.lowered import WEIGHT_KINDS, Collective, CollectiveRead, OpPieces, WeightRead
from strategies.lowering_copies import kept_indices
from strategies.members import Hashed
from strategies.renamed_rows import moved_partitions, renamed_transfers
from strategies.repeats import signature

__all__ = ["shapes_of", "names_of", "name_map", "renamed", "relative_key"]

_new = tuple.__new__
_COLLECTIVE = operator.attrgetter("collective")  # a CollectiveRead's


def _alone(node: OpNode) -> Hashable:
    """What ``lower_op`` reads of ``node`` itself, names left out."""
    return signature(node), node.dims


def shapes_of(graph: OpGraph) -> dict[str, int]:
    """Op -> the id of its shape (module docstring), equal ids for ops ``lower_op`` lowers alike
    under equal configs; found once per graph (the lowering cache keeps it)."""
    ids: dict[Hashable, int] = {}
    alone = {node.name: ids.setdefault(_alone(node), len(ids)) for node in graph}  # small ints: cheap to hash
    ids = {}
    grad, outputs = graph.needs_grad, set(graph.outputs)
    out = {}
    for node in graph:
        inputs = node.inputs
        key = (alone[node.name], grad[node.name], node.name in outputs,
               tuple(alone[u] for u in graph.users(node.name)),
               tuple(inputs.index(x) for x in inputs),
               tuple((alone[x], grad[x]) for x in inputs))
        out[node.name] = ids.setdefault(key, len(ids))
    return out


def names_of(graph: OpGraph, node: OpNode) -> tuple[str, ...]:
    """The names ``node``'s pieces hold, in one order for every op of its shape: the op, its
    producers, its weights, and each weight op producer's weight."""
    return (node.name, *node.inputs, *(w.name for w in node.weights),
            *(graph[x].weights[0].name if graph[x].kind in WEIGHT_KINDS else "" for x in node.inputs))


def name_map(old: tuple[str, ...], new: tuple[str, ...]) -> dict[str, str] | None:
    """Each of ``old``'s names -> the name in its place in ``new``; None where one stands for two."""
    to: dict[str, str] = {}
    for a, b in zip(old, new):
        if to.setdefault(a, b) != b:
            return None
    return to


def renamed(pieces: OpPieces, old: tuple[str, ...], new: tuple[str, ...], delta: int = 0) -> OpPieces | None:
    """``pieces`` (of the op ``old`` names, ``names_of``) with ``new``'s names and every device
    moved ``delta`` on (``relative_key``: another block of devices cut alike); None where one of
    ``old``'s names stands for two of ``new``'s (the op then lowers on its own) or a device's
    bytes would move past the last device."""
    if old == new and not delta:
        return pieces
    to = name_map(old, new)
    if to is None:
        return None
    op = new[0]
    at = to.__getitem__
    per_device = _moved_bytes(pieces, delta)
    if per_device is None:
        return None
    # partitions and transfers renamed when first read (``strategies.renamed_rows``): most are
    # never read (``simulator.twins`` copies the twin's tasks); the rest made as tuples, their
    # fields unpacked by name (``CollectiveRead``: collective, dst_op, dst_index, slot, device)
    parts = moved_partitions(pieces.partitions, op, delta)
    transfers = renamed_transfers(pieces.transfers, to, op, delta)
    reductions = tuple(dataclasses.replace(g, op=op, devices=_plus(g.devices, delta)) for g in pieces.reductions)
    reads = tuple(_new(WeightRead, (at(r[0]), r[1], r[2] + delta, op, *r[4:])) for r in pieces.weight_reads)
    # each collective object (kind, op, microbatch, devices, holders, ...) and device group moved
    # once; by identity (a lowering's reads of one collective share it), not by its nested hash
    unique = {id(c): c for c in map(_COLLECTIVE, pieces.collective_reads)}
    groups = {g: _plus(g, delta) for g in dict.fromkeys([c[3] for c in unique.values()])}
    collectives = {i: _new(Collective, (kind, at(src), j, groups[g], *rest))
                   for i, (kind, src, j, g, *rest) in unique.items()}
    col_reads = tuple([_new(CollectiveRead, (collectives[id(c)], op, k, slot, d + delta))
                       for c, _, k, slot, d in pieces.collective_reads])
    couples = pieces.couples if not delta else frozenset((a + delta, b + delta) for a, b in pieces.couples)
    return pieces._replace(partitions=parts, transfers=transfers, reductions=reductions, weight_reads=reads,
                           weights_read=tuple(map(at, pieces.weights_read)), collective_reads=col_reads,
                           couples=couples, **per_device)


def relative_key(config: ParallelConfig, producers: Sequence[ParallelConfig], keep: frozenset[int] | None
                 ) -> tuple[Hashable, int]:
    """(key, base): what ``lower_op`` reads of an op's and its producers' configs with every
    device counted from ``base``, the op's first device, and, of a copy-0 lowering's ``keep``,
    which partitions of each it keeps (``kept_indices``: all it reads of ``keep``). Two ops of
    one shape with equal keys lower to equal pieces up to names and a move of every device by
    the difference of their bases (a pipeline stage's layer is stage 0's on devices s·N/p on:
    ``strategies.megatron``)."""
    base = config.devices[0] if config.devices else 0
    key = tuple((c.degrees, tuple([d - base for d in c.devices]), c.zero, c.recompute,
                 None if keep is None else kept_indices(c, keep), _members(c, keep)) for c in (config, *producers))
    return key, base


def _members(config: ParallelConfig, keep) -> tuple | None:
    """A member fold's keep (``strategies.lowering_members``): each partition's member index and
    whether it is kept (its weight reads are derived for all); None otherwise."""
    member = getattr(keep, "member", None)
    return None if member is None else tuple(member.get(d, -1) for d in config.devices)


def _plus(devices: tuple[int, ...], delta: int) -> tuple[int, ...]:
    """``devices`` moved ``delta`` on, of their type (a ``Hashed`` stays one)."""
    if not delta:
        return devices
    moved = [d + delta for d in devices]
    return type(devices)(moved) if isinstance(devices, Hashed) else tuple(moved)


def _moved_bytes(pieces: OpPieces, delta: int) -> dict | None:
    """The per-device byte tuples of ``pieces`` with entry d moved to d + ``delta``; None where
    a nonzero entry would fall off either end."""
    if not delta:
        return {}
    out = {}
    for field, rows in (("activations", pieces.activations), ("receives", pieces.receives),
                        ("dropped", pieces.dropped)):
        moved = []
        for row in ((rows,) if field != "receives" else rows):
            if not row:
                moved.append(row)
                continue
            n = len(row)
            if delta > 0:
                if any(row[n - delta:]):
                    return None
                moved.append((0,) * delta + row[:n - delta])
            else:
                if any(row[:-delta]):
                    return None
                moved.append(row[-delta:] + (0,) * -delta)
        out[field] = moved[0] if field != "receives" else tuple(moved)
    return out
