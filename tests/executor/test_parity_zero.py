"""Parity of sharded weight state (``ParallelConfig.zero``, ZeRO stages 1-3, ``strategies.zero``; level 3
is FSDP2's ``fully_shard``: weights kept as chunks, gathered before each forward and backward):
every weighted op at a level, on data parallel (one and two GPipe micro-batches), two pipeline
stages each data parallel, the megatron baseline (tensor parallel 2 ways: the column- and
row-parallel shards replicated over the data-parallel rest, the norms' weights over every
device; with 2 1F1B pipeline stages at level 3), on 2 and 4 gloo processes, float64, SGD and Adam, against one device (``harness.compare``): the
gradients compared are the summed chunks gathered on rank 0, the weights the all-gathered ones."""

from __future__ import annotations

import pytest

from strategies.lowering import lower
from strategies.zero import per_use_shards, zero_buckets
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("gpt", "zero1_dp"), ("gpt", "zero2_dp_mb2"), ("gpt", "zero1_megatron"), ("gpt", "zero3_dp"),
           ("gpt", "zero3_dp_mb2"), ("gpt", "zero3_megatron")]
CASES_4 = [("gpt", "zero1_dp"), ("gpt", "zero2_megatron"), ("mlp", "zero1_stages_dp"), ("gpt", "zero2_stages_dp"),
           ("gpt", "zero3_megatron"), ("gpt", "zero3_stages_dp"), ("gpt", "zero3_megatron_pp2")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_shard_state(world, cases):
    """Every case shards state at its level, and at no other."""
    for model, plan in cases:
        g = traced(model)
        level = int(plan[4])
        low = lower(g, make_plan(g, plan, world))
        levels = {k.zero for k in zero_buckets(low)} | {s.zero for s in per_use_shards(low)}
        assert levels == {level}, (model, plan, levels)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
