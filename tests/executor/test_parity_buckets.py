"""Parity with several gradient buckets on one device set (``Strategy.bucket_cap_mb``,
``strategies.lowered.split_buckets``), each started as soon as its gradients are final
(``strategies.overlap``): zoo mlp data parallel at a 4 KiB cap (two buckets in float64), gpt data
parallel with 2 micro-batches and gpt at ZeRO level 1 (each flat bucket reduce-scattered in its
own chunks) at 8 KiB (seven buckets), on 2 gloo processes, float64, SGD and Adam, against one
device (``harness.compare``)."""

from __future__ import annotations

import pytest

from soapsearch.executor import build_model
from strategies.lowering import lower
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("mlp", "cap4k_dp"), ("gpt", "cap8k_dp_mb2"), ("gpt", "cap8k_zero1_dp")]


@pytest.mark.parametrize("model,plan,buckets", [("mlp", "cap4k_dp", 2), ("gpt", "cap8k_dp_mb2", 7),
                                                ("gpt", "cap8k_zero1_dp", 7)])
def test_the_plans_have_several_buckets(model, plan, buckets):
    g = build_model(model, "tiny", dtype="float64").graph
    assert len(lower(g, make_plan(g, plan, 2)).gradient_sync.buckets) == buckets


results2, _, test_parity_2_processes, _ = parity_tests(CASES_2, [])
