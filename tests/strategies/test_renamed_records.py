"""``strategies.lowering_shared.renamed`` makes its records as the tuples they are (partitions
and transfers when first read: ``strategies.renamed_rows``; each distinct collective once):
its pieces equal those made field by field with ``_replace`` (the reference below), record
for record and type for type, under a new name and under a move to another pipeline stage's
devices; reads of one collective share one renamed collective."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from strategies.baselines import megatron_lm
from strategies.lowered import Collective, CollectiveRead, Partition, Transfer
from strategies.lowering import lower
from strategies.lowering_shared import _plus, name_map, names_of, renamed
from strategies.renamed_rows import MovedPartitions, RenamedTransfers, records
from tests.conftest import traced
from tests.strategies.test_lowering_members import random_plan


def _reference(pieces, old, new, delta):
    """``renamed``'s value made field by field (``_replace``; its byte rows moved by ``renamed``)."""
    at = name_map(old, new).__getitem__
    op = new[0]
    moved = {}

    def collective(c: Collective) -> Collective:
        if c not in moved:
            moved[c] = c._replace(op=at(c.op), devices=_plus(c.devices, delta))
        return moved[c]

    got = renamed(pieces, old, new, delta)
    return pieces._replace(
        partitions=tuple(tuple(p._replace(op=op, device=p.device + delta) for p in mb) for mb in pieces.partitions),
        transfers=tuple(t._replace(src_op=at(t.src_op), dst_op=op, src_device=t.src_device + delta,
                                   dst_device=t.dst_device + delta) for t in pieces.transfers),
        reductions=tuple(dataclasses.replace(g, op=op, devices=_plus(g.devices, delta)) for g in pieces.reductions),
        weight_reads=tuple(r._replace(name=at(r.name), device=r.device + delta, op=op) for r in pieces.weight_reads),
        weights_read=tuple(map(at, pieces.weights_read)),
        collective_reads=tuple(r._replace(collective=collective(r.collective), dst_op=op, device=r.device + delta)
                               for r in pieces.collective_reads),
        couples=got.couples, activations=got.activations, receives=got.receives, dropped=got.dropped)


def _types(pieces) -> list[type]:
    return ([type(p) for mb in pieces.partitions for p in mb] + [type(mb) for mb in pieces.partitions]
            + list(map(type, pieces.transfers)) + list(map(type, pieces.collective_reads))
            + [type(r.collective) for r in pieces.collective_reads])


@pytest.mark.parametrize("plan", ["megatron_lm", "random-0", "random-1"])
def test_renamed_equals_the_records_replaced_field_by_field(plan):
    graph = traced("gpt", "small")
    strategy = megatron_lm(graph, 16, 4, 2) if plan == "megatron_lm" else random_plan(graph, 16, int(plan[-1]))
    low = lower(graph, strategy)
    nodes = [node for node in graph if low.pieces[node.name].partitions and node.inputs]
    checked = reads = 0
    for node in nodes:
        twin = next((o for o in nodes if o is not node and o.kind == node.kind and len(o.inputs) == len(node.inputs)
                     and len(o.weights) == len(node.weights)), None)
        if twin is None:
            continue
        old, new = names_of(graph, node), names_of(graph, twin)
        pieces = low.pieces[node.name]
        for delta in (0, 8):
            got = renamed(pieces, old, new, delta)
            if got is None:
                continue
            assert got == _reference(pieces, old, new, delta)
            assert _types(got) == _types(pieces)
            assert all(type(p) is Partition for mb in got.partitions for p in mb)
            assert all(type(t) is Transfer for t in got.transfers)
            assert all(type(r) is CollectiveRead and type(r.collective) is Collective for r in got.collective_reads)
            one = {}
            for r in got.collective_reads:  # one object per distinct collective, as the lowering makes them
                assert one.setdefault(r.collective, r.collective) is r.collective
            checked += 1
            reads += len(got.collective_reads)
    assert checked > 20 and reads > 0


def test_renamed_records_are_made_when_read_and_read_as_tuples():
    """Partitions and transfers renamed when first read: their lengths known before, one
    micro-batch's row made at a time, and read as the tuples they stand for (equal, hashed,
    indexed, sliced, pickled); renaming again maps the source's records once, equal to the
    two renamings made one after the other."""
    graph = traced("gpt", "small")
    low = lower(graph, megatron_lm(graph, 16, 4, 2).with_microbatches(4, "1f1b"))
    nodes = [n for n in graph if n.kind == "linear" and low.pieces[n.name].transfers]
    first, second, third = nodes[0], nodes[1], nodes[2]
    pieces = low.pieces[first.name]
    got = renamed(pieces, names_of(graph, first), names_of(graph, second), 0)
    parts, transfers = got.partitions, got.transfers
    assert type(parts) is MovedPartitions and type(transfers) is RenamedTransfers
    assert len(parts) == 4 and records(parts) == sum(map(len, pieces.partitions)) > 0
    assert len(transfers) == len(pieces.transfers) and transfers._made is None
    assert parts[2][0].op == second.name and parts._rows.count(None) == 3  # micro-batch 2 alone made
    want = _reference(pieces, names_of(graph, first), names_of(graph, second), 0)
    assert parts == want.partitions and want.partitions == parts and hash(parts) == hash(want.partitions)
    assert parts[1:3] == want.partitions[1:3] and parts[-1] == want.partitions[-1]
    assert transfers == want.transfers and transfers[-1] == want.transfers[-1]
    assert pickle.loads(pickle.dumps(got)) == want and type(pickle.loads(pickle.dumps(parts))) is tuple
    assert parts != want.partitions[:3] and transfers != want.transfers[1:]
    again = renamed(got, names_of(graph, second), names_of(graph, third), 8)
    assert again.partitions.root is pieces.partitions and again.transfers.root is pieces.transfers
    step = renamed(_reference(pieces, names_of(graph, first), names_of(graph, second), 0),
                   names_of(graph, second), names_of(graph, third), 8)
    assert tuple(again.partitions) == tuple(step.partitions) and tuple(again.transfers) == tuple(step.transfers)
    assert again.transfers[0].dst_op == third.name and again.partitions[0][0].device == pieces.partitions[0][0].device + 8
