"""The cached lowering (``lower``: each call patches the previous one where a config changed)
equals the plain one (``lower_reference``: everything derived afresh) on random plans of tiny
zoo models, and on walks of one-op changes through one cache, as a search makes them."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from soapsearch import trace
from strategies import Strategy, enumerate_configs
from strategies.lowering import lower, lower_reference
from strategies.region import intersect
from tests.conftest import traced
from tests.strategies.test_lowering import Tied

MODELS = ["mlp", "gpt", "alexnet", "rnnlm", "inception_v3"]
SETTINGS = [(1, "gpipe"), (1, "1f1b"), (2, "gpipe"), (2, "1f1b")]
DEVICES = 4


def _assert_equal(got, want):
    """Field by field first (a failure names what differs), then the whole ``Lowered``."""
    assert got.partitions == want.partitions
    assert got.transfers == want.transfers
    assert got.reductions == want.reductions
    assert got.weight_shards == want.weight_shards
    assert got.device_bytes == want.device_bytes
    assert got.gradient_sync == want.gradient_sync
    assert got == want


@pytest.mark.parametrize("microbatches,schedule", SETTINGS, ids=[f"mb{m}-{s}" for m, s in SETTINGS])
@pytest.mark.parametrize("name", MODELS)
def test_the_cached_lowering_equals_the_reference(name, microbatches, schedule):
    graph = traced(name)
    rng = random.Random(f"{name}-{microbatches}-{schedule}")
    configs = {node.name: list(enumerate_configs(node, DEVICES, microbatches)) for node in graph}
    ops = [op for op, cfgs in configs.items() if len(cfgs) > 1]
    cache: dict = {}
    for _ in range(3):  # three random plans, each the start of a walk through the same cache
        plan = Strategy.of({op: rng.choice(cfgs) for op, cfgs in configs.items()}, DEVICES, microbatches, schedule)
        _assert_equal(lower(graph, plan, cache), lower_reference(graph, plan))
        for _ in range(12):  # one-op changes, about half kept (a search's proposals)
            op = rng.choice(ops)
            proposal = plan.replace(op, rng.choice(configs[op]))
            _assert_equal(lower(graph, proposal, cache), lower_reference(graph, proposal))
            if rng.random() < 0.5:
                plan = proposal


def test_partly_overlapping_weight_regions_agree_too():
    # a weight read by two ops cut differently (Tied: one Linear applied twice) is held in
    # regions that partly overlap, cut into cells: random plans of it, plenty of such cuts
    graph = trace(Tied(), (torch.randn(4, 8),))
    rng = random.Random(11)
    configs = {node.name: list(enumerate_configs(node, DEVICES)) for node in graph}
    overlapping = 0
    for _ in range(40):
        plan = Strategy.of({op: rng.choice(cfgs) for op, cfgs in configs.items()}, DEVICES)
        want = lower_reference(graph, plan)
        _assert_equal(lower(graph, plan), want)
        regions = {r.region for p in want.pieces.values() for r in p.weight_reads}
        overlapping += any(a != b and intersect(a, b) is not None for a, b in itertools.combinations(regions, 2))
    assert overlapping >= 10
