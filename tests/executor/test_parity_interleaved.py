"""Parity of the interleaved 1F1B schedule (strategies/chunks.py, strategies/schedule.py): the
megatron baseline cut into 2 pipeline ranks x 2 chunks (``--virtual-stages 2``) on zoo gpt and
llama, 2 and 4 micro-batches, without tensor parallelism on 2 gloo processes and with it 2 ways
on 4, and 2 ways data parallel (gradient buckets) on 4 (the 4-process cases under ``-m slow``:
CI's time), float64, SGD and Adam, against one device
(``harness.compare``). Each rank sends to and
receives from the other rank both ways between its chunks; the run finishing (no deadlock) and
matching is the test."""

from __future__ import annotations

import pytest

from strategies.chunks import pipeline_chunks
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("gpt", "megatron_tp1_pp2_v2_mb4")]
CASES_4 = [("gpt", "megatron_pp2_v2"), ("gpt", "megatron_pp2_v2_mb4"), ("gpt", "megatron_pp2_sp_v2_mb4"),
           ("llama", "megatron_pp2_v2_mb4"), ("gpt", "megatron_tp1_pp2_v2")]  # the last: data parallel 2 ways


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_are_interleaved(world, cases):
    for model, name in cases:
        g = traced(model)
        plan = make_plan(g, name, world)
        c = pipeline_chunks(g, plan)
        assert (plan.schedule, c.ranks, c.chunks) == ("interleaved", 2, 2), (model, name)
        assert plan.microbatches == (4 if "_mb4" in name else 2), (model, name)


results2, results4, test_parity_2_processes, _four = parity_tests(CASES_2, CASES_4)
test_parity_4_processes = pytest.mark.slow(_four)
