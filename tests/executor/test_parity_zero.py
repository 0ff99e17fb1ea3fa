"""Parity of sharded weight state (``ParallelConfig.zero``, ZeRO stages 1 and 2, ``strategies.zero``):
every weighted op at a level, on data parallel (one and two GPipe micro-batches), two pipeline
stages each data parallel, the megatron baseline (tensor parallel 2 ways: the column- and
row-parallel shards replicated over the data-parallel rest, the norms' weights over every
device), heads-split attention and a GPipe pipeline (one device per op: a documented no-op),
on 2 and 4 gloo processes, float64, SGD and Adam, against one device (``harness.compare``): the
gradients compared are the summed chunks gathered on rank 0, the weights the all-gathered ones."""

from __future__ import annotations

import pytest

from strategies.lowering import lower
from strategies.zero import zero_buckets
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("gpt", "zero1_dp"), ("gpt", "zero2_dp_mb2"), ("mlp", "zero2_dp"), ("gpt", "zero1_megatron"),
           ("gpt", "zero2_gpipe")]
CASES_4 = [("gpt", "zero1_dp"), ("gpt", "zero2_megatron"), ("mlp", "zero1_stages_dp"), ("gpt", "zero2_stages_dp"),
           ("gpt", "zero1_heads")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_shard_state(world, cases):
    """Every case but the documented no-op (a pipeline: one device per op) has a sharded bucket
    at its level, and no bucket at another level."""
    for model, plan in cases:
        g = traced(model)
        level = int(plan[4])
        keys = set(zero_buckets(lower(g, make_plan(g, plan, world))))
        noop = plan.endswith("gpipe")
        assert bool(keys) != noop, (model, plan)
        assert all(k.zero == level for k in keys), (model, plan, keys)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
