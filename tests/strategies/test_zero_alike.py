"""``strategies.zero_alike.alike_readers``: the devices reading level-2/3 weights, one class per
run order that reads them alike; what is found once per class (the prefetched bytes, the
simulated gathers' issue points and unit calls) equals what each device's own walk finds."""

from __future__ import annotations

import random

import pytest

import simulator.zero3
import strategies.prefetch
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import run_timeline
from simulator.tasks import build_tasks
from strategies import enumerate_configs
from strategies.baselines import fsdp
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.prefetch import gathered_bytes
from strategies.schedule import device_order
from strategies.zero import gather_groups
from strategies.zero_alike import AlikeReaders, alike_readers
from tests.conftest import traced


def _reads(low, d):
    """Device ``d``'s run order as (op, pass, micro-batch, groups read) per position, by hand."""
    groups = gather_groups(low)
    return [(s.op, s.backward, s.microbatch,
             tuple(g for g, u in enumerate(groups) if s.op == u.op and d in u.devices
                   and u.partitions[u.devices.index(d)] == s.index))
            for s in device_order(low)[d]]


def _per_device(low):
    """One class per reading device, its reads found by hand: each device's own walk over its
    whole run order (the steps reading nothing included)."""
    out = []
    for d in sorted({d for u in gather_groups(low) for d in u.devices}):
        order = device_order(low)[d]
        out.append(AlikeReaders((d,), order, tuple(r[3] for r in _reads(low, d)), ([s.index for s in order],)))
    return tuple(out)


def test_data_parallel_replicas_are_one_class():
    g = traced("gpt", batch_size=16)  # the walk's graph: traced once
    low = lower(g, fsdp(g, 4))
    (alike,) = alike_readers(low)
    assert alike.devices == (0, 1, 2, 3)  # device 0 alone runs wpe (one partition), which reads no group
    for c in (alike,):  # the reading order: the run order's steps that read a group
        assert [(s.op, s.backward, s.microbatch, gs) for s, gs in zip(c.order, c.reads)] == [
            r for r in _reads(low, c.devices[0]) if r[3]]
        for d, ks in zip(c.devices, c.indices):
            assert [s._replace(index=k) for s, k in zip(c.order, ks)] == [
                s for s, r in zip(device_order(low)[d], _reads(low, d)) if r[3]]
    assert len(alike.reads) == 2 * len({u.op for u in gather_groups(low)})
    assert len(device_order(low)[0]) == len(device_order(low)[1]) + 2 > len(alike.order)  # wpe's two steps


@pytest.mark.parametrize("microbatches", [1, 2])
def test_classes_walk_as_each_device(monkeypatch, microbatches):
    """gpt tiny, fsdp on 4 devices (layer units), one-op proposals at levels 0/2/3: every
    member of a class reads as its first member, every reading device is in one class, and the
    prefetched bytes and the iteration time equal those of one class per device."""
    g = traced("gpt", batch_size=16)
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    plan = fsdp(g, 4).with_microbatches(microbatches, "1f1b")
    rng = random.Random(microbatches)
    ops = [n.name for n in g if any(w.trainable for w in n.weights)]
    checked = split = 0
    for _ in range(10):
        op = rng.choice(ops)
        cfg = rng.choice(list(enumerate_configs(g[op], 4))).with_memory(zero=rng.choice((0, 2, 3)))
        try:
            low = lower(g, plan.replace(op, cfg))
        except PlanError:
            continue
        classes = alike_readers(low)
        members = [d for c in classes for d in c.devices]
        assert sorted(members) == sorted({d for u in gather_groups(low) for d in u.devices})  # each in one class
        assert [c.devices[0] for c in classes] == sorted(c.devices[0] for c in classes)
        for c in classes:
            reading = [[r for r in _reads(low, d) if r[3]] for d in c.devices]
            assert all(r == reading[0] for r in reading)
        split += len(classes) > 1
        alike = gathered_bytes.__wrapped__(low), float(run_timeline(build_tasks(low, topo, cost), topo)[1].max())
        with monkeypatch.context() as m:
            for module in (strategies.prefetch, simulator.zero3):
                m.setattr(module, "alike_readers", _per_device)
            each = gathered_bytes.__wrapped__(low), float(run_timeline(build_tasks(low, topo, cost), topo)[1].max())
        assert alike == each and max(alike[0]) > 0
        checked += 1
        plan = plan.replace(op, cfg) if rng.random() < 0.5 else plan
    assert checked >= 5 and split >= 1
