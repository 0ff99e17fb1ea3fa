"""Parity of Megatron-LM's vocab-parallel cross-entropy (Shoeybi et al. 2019;
``strategies.rules.cross_entropy``): the loss cut on its classes, the linear that makes the
logits column-parallel on the vocabulary, on the same devices (``vocab``: 2-way classes, times
the samples on 4 processes), and random plans that cut every op with a reduction dim, the loss
on its classes included (``random_r<seed>``), on 2 and 4 gloo processes, float64, SGD and Adam,
against one device (``harness.compare``)."""

from __future__ import annotations

import pytest

from strategies.lowering import lower
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("gpt", "vocab"), ("mlp", "vocab"), ("mlp", "random_r5")]
CASES_4 = [("gpt", "vocab"), ("mlp", "vocab"), ("gpt", "random_r6")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_cut_the_loss_on_its_classes(world, cases):
    """Each plan cuts the loss on its classes: class-shard sums, each of the partition's
    samples; under ``vocab`` no piece of the logits crosses devices."""
    for model, plan in cases:
        g = traced(model)
        low = lower(g, make_plan(g, plan, world))
        loss = g[g.outputs[0]]
        names = {r.name for r in low.reductions if r.op == loss.name}
        assert {"class_max", "class_sum", "loss_sum"} <= names, (model, plan, names)
        if plan == "vocab":
            assert all(t.local for t in low.transfers if t.dst_op == loss.name and t.slot == 0), (model, plan)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
