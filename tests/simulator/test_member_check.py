"""The member check decided per op (``strategies.member_symmetry``: ``members_apart``,
``member_classes``) equals the check read one record at a time
(``strategies.member_reference``): the same verdict, the same line naming the piece, the same
classes, on the plans of test_fold_members and on plans whose ops take random configs of the
search's candidates (which often move an op's pieces across members), lowered per device and
as copy 0, one lowering cache through a sequence of plans as a search keeps it; per op, for
members reshuffled per group too (a pipeline stage's δ then matters). A lowering with one
record broken in one micro-batch is caught as the per-record check catches it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from soapsearch.search.mcmc import candidate_configs
from strategies import Strategy
from strategies.baselines import megatron_lm
from strategies.errors import PlanError
from strategies.lowered import WEIGHT_KINDS, Lowered
from strategies.lowering import lower
from strategies.megatron import megatron
from strategies.member_pieces import ops_crossing_members, ops_splitting_groups, origins
from strategies.member_reference import member_classes_reference, members_apart_reference, transfers_apart
from strategies.member_symmetry import TensorMembers, find_members, member_classes, members_apart
from strategies.symmetry import CrossCopy, find_copies
from tests.conftest import traced
from tests.simulator.test_fold_members import _plans


def _same(lowered: Lowered, found: TensorMembers) -> str | None:
    """Assert the per-op check equals the per-record one on ``lowered``; the verdict."""
    why = members_apart_reference(lowered, found)
    assert members_apart(lowered, found) == why
    assert member_classes(lowered, found) == member_classes_reference(lowered, found)
    return why


def _lowerings(graph, plan, cache: dict) -> list[Lowered]:
    """``plan`` lowered per device and, where it has copies that do not cross, as copy 0."""
    out = [lower(graph, plan, cache)]
    copies = find_copies(graph, plan)
    if copies is not None:
        try:
            out.append(lower(graph, plan, cache, copies))
        except CrossCopy:
            pass
    return out


@pytest.mark.parametrize("graph,plan,preset,count,classes", _plans())
def test_equal_on_the_fold_plans(graph, plan, preset, count, classes):
    found = find_members(graph, plan)
    for lowered in _lowerings(graph, plan, {}):
        assert _same(lowered, found) is None
        assert member_classes(lowered, found) == classes


def test_equal_where_a_transfer_crosses_members():
    graph = traced("llama", "tiny")
    plan = megatron(graph, 8, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    found = find_members(graph, plan)
    for lowered in _lowerings(graph, plan, {}):
        assert _same(lowered, found).startswith("transfer view[1] -> transpose[0]: device 1 -> 0 crosses members")


def _random_plans(graph, base: Strategy, rng: random.Random, count: int, changes: int):
    """``count`` plans, each ``base`` with ``changes`` ops given a random config of the search's
    candidates (at ``base``'s devices and micro-batches; one on the op's own devices in half the
    draws) or the other recompute flag."""
    candidates = candidate_configs(graph, base.num_devices, base.microbatches, None)
    ops = [node.name for node in graph if node.kind not in WEIGHT_KINDS and len(candidates[node.name]) > 1]
    for _ in range(count):
        configs = dict(base.configs)
        for op in rng.sample(ops, changes):
            draw = rng.random()
            if draw < 0.4:  # on any devices
                configs[op] = rng.choice(candidates[op])
            elif draw < 0.8:  # on its own devices, cut another way
                own = sorted(configs[op].devices)
                configs[op] = rng.choice([c for c in candidates[op] if sorted(c.devices) == own] or [configs[op]])
            elif graph.needs_grad[op] and graph[op].kind != "input":
                configs[op] = configs[op].with_memory(configs[op].zero, not configs[op].recompute)
        yield Strategy.of(configs, base.num_devices, base.microbatches, base.schedule, base.precision)


@pytest.mark.parametrize("model,seed", [("gpt", 0), ("gpt", 1), ("llama", 2), ("gpt-small", 3)])
def test_equal_on_random_plans(model, seed):
    """Members of the megatron plan (T 2 or 4), checked on its random neighbours' lowerings: a
    neighbour's op on other devices moves its transfers or collectives across members, or
    changes what a member holds; the two checks agree on every one."""
    rng = random.Random(seed)
    if model == "gpt-small":
        graph = traced("gpt", "small")
        base = megatron_lm(graph, 16, 4, 2)
    else:
        graph = traced(model, "tiny")
        base = megatron(graph, 8, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    found = find_members(graph, base)
    assert found is not None
    cache: dict = {}
    verdicts, classes = [], set()
    for plan in _random_plans(graph, base, rng, 16, 1 + seed % 2):
        try:
            lowerings = _lowerings(graph, plan, cache)
        except PlanError:
            continue
        for lowered in lowerings:
            verdicts.append(_same(lowered, found))
            classes.add(member_classes(lowered, found))
    kinds = {None if v is None else v.split(" ", 1)[0] for v in verdicts}
    assert len(verdicts) >= 12 and {None, "transfer"} <= kinds  # some keep the members, some do not
    assert len(classes) >= (2 if found.count > 2 else 1)  # T 4: ops cut otherwise split members 1-3


def _broken(lowered: Lowered, op: str, **records) -> Lowered:
    """``lowered`` with ``op``'s pieces given ``records`` (and no twin: its pieces are its own)."""
    pieces = lowered.pieces[op]._replace(**records)
    twins = {k: v for k, v in lowered.twins.items() if k != op and v[0] != op}
    return dataclasses.replace(lowered, pieces={**lowered.pieces, op: pieces},
                               partitions={**lowered.partitions, op: pieces.partitions}, twins=twins)


def test_one_broken_record_is_found():
    """One transfer of the last micro-batch moved to another member's device, one partition of
    member 2 cut to other extents in one micro-batch, one collective moved onto one member's
    devices: each found, named as the per-record check names it."""
    graph = traced("gpt", "small")
    plan = megatron_lm(graph, 16, 4, 2)
    found = find_members(graph, plan)
    lowered = lower(graph, plan)
    assert _same(lowered, found) is None
    index = found.index
    # a remote transfer of the last micro-batch, its source moved to another member of its group
    op, i, t = next((op, i, t) for op, p in lowered.pieces.items() if op not in lowered.twins
                    for i, t in enumerate(p.transfers)
                    if not t.local and t.microbatch == plan.microbatches - 1 and t.src_device in index)
    m, g = index[t.src_device]
    other = found.members[(m + 1) % found.count][g]
    transfers = list(lowered.pieces[op].transfers)
    transfers[i] = t._replace(src_device=other)
    why = _same(_broken(lowered, op, transfers=tuple(transfers)), found)
    assert why == (f"transfer {t.src_op}[{t.src_index}] -> {op}[{t.dst_index}]: device {other} -> {t.dst_device} "
                   "crosses members; a member's transfers must stay among its own devices")
    # member 2's partition of one micro-batch one row shorter: member 2 a class of its own
    op = next(op for op in lowered.partitions if op not in lowered.twins and graph[op].kind not in WEIGHT_KINDS
              and any(index.get(p.device, (0,))[0] == 2 for p in lowered.partitions[op][-1]))
    parts = [list(mb) for mb in lowered.partitions[op]]
    k = next(k for k, p in enumerate(parts[-1]) if index.get(p.device, (0,))[0] == 2)
    p = parts[-1][k]
    parts[-1][k] = p._replace(box=((p.box[0][0], p.box[0][1] - 1),) + p.box[1:])
    broken = _broken(lowered, op, partitions=tuple(map(tuple, parts)))
    _same(broken, found)
    assert member_classes(broken, found) == ((0,), (1, 3), (2,))
    # a collective of the last micro-batch moved onto member 0's devices of two groups
    op, i, r = next((op, i, r) for op, p in lowered.pieces.items() if op not in lowered.twins
                    for i, r in enumerate(p.collective_reads) if r.collective.microbatch == plan.microbatches - 1)
    reads = list(lowered.pieces[op].collective_reads)
    devices = tuple(sorted(found.members[0][:len(r.collective.devices)]))
    reads[i] = r._replace(collective=r.collective._replace(devices=devices))
    why = _same(_broken(lowered, op, collective_reads=tuple(reads)), found)
    assert why is not None and why.startswith(f"{r.collective.kind} of {r.collective.op} (micro-batch "
                                              f"{plan.microbatches - 1}): devices {list(devices)}")


def _reshuffled(found: TensorMembers) -> list[TensorMembers]:
    """Other member sets on the same devices: group i's members rotated by i (ψ then differs
    from group to group, so from stage to stage), and the first half of the groups only (the
    other devices in no group)."""
    t, g = found.count, found.size
    rotated = tuple(tuple(found.members[(m + i) % t][i] for i in range(g)) for m in range(t))
    half = tuple(row[:max(g // 2, 1)] for row in found.members)
    return [TensorMembers(rotated), TensorMembers(half)]


def _splits(lowered: Lowered, members: TensorMembers, op: str) -> bool:
    """Some collective ``op`` reads is not whole groups of ``members``, read one at a time."""
    index, groups = members.index, members.groups
    for r in lowered.pieces[op].collective_reads:
        at = [index.get(d) for d in r.collective.devices]
        if any(x is None for x in at) or set(r.collective.devices) != set().union(*(groups[i] for _, i in at)):
            return True
    return False


@pytest.mark.parametrize("plan,seed", [("megatron_lm-T4-P2-D2", 0), ("megatron-T2-P4-D2", 1)])
def test_each_op_judged_as_its_records(plan, seed):
    """Per op, the verdict from its first op's pieces moved by δ (``origins``) equals the one
    from its own records, on megatron_lm (gpt small, T 4, P 2, D 2) or megatron (gpt tiny, T 2,
    P 4, D 2: a stage's first op is the one before's moved) and random neighbours, for its
    members and for members reshuffled per group (so a stage's δ matters): the ops whose
    transfers cross members, those that read a collective of part of some groups, and the
    classes."""
    if plan.startswith("megatron_lm"):
        graph = traced("gpt", "small")
        base = megatron_lm(graph, 16, 4, 2)
    else:
        graph = traced("gpt", "tiny")
        base = megatron(graph, 16, tp=2, pp=4, microbatches=2, sequence_parallel=True)
    found = find_members(graph, base)
    rng = random.Random(seed)
    cache: dict = {}
    moved = crossed = split = 0
    for plan in [base, *_random_plans(graph, base, rng, 6, 1)]:
        try:
            lowerings = _lowerings(graph, plan, cache)
        except PlanError:
            continue
        for lowered in lowerings:
            origin = origins(lowered)
            for op, pieces in lowered.pieces.items():  # each op's records are its first op's moved by δ
                first, delta = origin[op]
                moved += delta != 0
                assert [(t.src_device, t.dst_device) for t in pieces.transfers] == \
                    [(t.src_device + delta, t.dst_device + delta) for t in first.transfers]
                assert [[(p.device, p.box) for p in mb] for mb in pieces.partitions] == \
                    [[(p.device + delta, p.box) for p in mb] for mb in first.partitions]
                assert [r.collective.devices for r in pieces.collective_reads] == \
                    [tuple(d + delta for d in r.collective.devices) for r in first.collective_reads]
            for members in (found, *_reshuffled(found)):
                _same(lowered, members)
                crossing = {op for op, p in lowered.pieces.items() if transfers_apart(p.transfers, members.index)}
                assert list(ops_crossing_members(lowered, members)) == [op for op in lowered.pieces if op in crossing]
                splitting = [op for op in lowered.pieces if _splits(lowered, members, op)]
                assert list(ops_splitting_groups(lowered, members)) == splitting
                crossed += bool(crossing)
                split += bool(splitting)
    assert moved and crossed and split
