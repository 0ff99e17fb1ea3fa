"""``CostModel.partition_time`` (the times from the regions the lowering stored on a partition)
equals ``op_time`` (the regions recomputed from the box) on every partition of zoo plans: GPT
megatron with sequence parallelism and micro-batches, ResNet cut spatially (edge partitions
read a smaller halo), LLaMA hybrid; and both calls share the memo by shapes."""

from __future__ import annotations

import pytest

from simulator import cost
from simulator.presets import get_topology
from strategies import Strategy, enumerate_configs
from strategies.baselines import baseline, recomputed
from strategies.lowering import lower
from strategies.megatron import megatron
from tests.conftest import traced
from tests.simulator.test_cost import Counting  # counts _op_time calls


def spatial(graph, n: int) -> Strategy:
    """Every op cut n ways on its dim 2 (a conv's height) where it can be, else its first config."""
    configs = {}
    for node in graph:
        options = list(enumerate_configs(node, n, 2))
        cut = [c for c in options if len(c.degrees) > 2 and c.degrees[2] == n]
        configs[node.name] = (cut or options)[0]
    return Strategy.of(configs, n, 2, "gpipe")


def plan(case: str):
    """(graph, plan) of ``case``, traced when its test runs."""
    if case == "gpt megatron sp":
        gpt = traced("gpt", batch_size=8)
        return gpt, recomputed(megatron(gpt, 8, tp=2, pp=2, microbatches=2, sequence_parallel=True), gpt)
    if case == "resnet spatial":
        resnet = traced("resnet101", batch_size=4)
        return resnet, spatial(resnet, 4)
    llama = traced("llama", batch_size=8)
    return llama, baseline("hybrid", llama, 8, microbatches=2)


@pytest.mark.parametrize("case", ["gpt megatron sp", "resnet spatial", "llama hybrid"])
def test_partition_time_equals_op_time_on_every_partition(case):
    graph, plan_ = plan(case)
    devices = get_topology("a100-1x8").devices
    low = lower(graph, plan_)
    shared, recomputed_ = Counting(), Counting()
    halos = compared = 0
    for name, per_mb in low.partitions.items():
        node = graph[name]
        for parts in per_mb:
            for p in parts:
                device = devices[p.device]
                want = recomputed_.op_time(node, p.box, device)
                assert shared.partition_time(node, p, device) == want, (name, p.index, p.microbatch)
                compared += 1
            shapes = {tuple(None if r is None else tuple(b - a for a, b in r) for r in p.input_regions)
                      for p in parts}
            halos += len(shapes) > 1
    assert compared > 50
    # one _op_time per distinct shape key, the same keys either way
    assert shared.calls == recomputed_.calls > 0
    calls = shared.calls
    for name, per_mb in low.partitions.items():  # op_time after partition_time: all memo hits
        for p in per_mb[-1]:
            shared.op_time(graph[name], p.box, devices[p.device])
    assert shared.calls == calls
    if case == "resnet spatial":
        assert halos > 0  # edge and inner partitions of a conv read different input shapes


def test_partition_time_memo_by_partition_answers_again_and_stays_bounded(monkeypatch):
    # the task blocks ask for every partition's times: a second ask is the memo's same tuple,
    # no shape key built again; past _BY_PARTITION entries the memo empties and starts over
    graph, plan_ = plan("gpt megatron sp")
    devices = get_topology("a100-1x8").devices
    low = lower(graph, plan_)
    parts = [(graph[name], p) for name, per_mb in low.partitions.items() for ps in per_mb for p in ps]
    model = Counting()
    first = [model.partition_time(node, p, devices[p.device]) for node, p in parts]
    shapes = model.calls
    timed = []
    monkeypatch.setattr(model, "_timed", lambda *args: timed.append(args))
    again = [model.partition_time(node, p, devices[p.device]) for node, p in parts]
    assert timed == [] and all(a is b for a, b in zip(first, again)) and len(parts) > 100
    monkeypatch.setattr(cost, "_BY_PARTITION", 8)
    bounded = Counting()
    assert [bounded.partition_time(node, p, devices[p.device]) for node, p in parts] == first
    assert 0 < len(bounded._by_partition) <= 8 and bounded.calls == shapes  # the memo by shapes keeps all
