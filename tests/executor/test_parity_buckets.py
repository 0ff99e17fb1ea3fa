"""Parity with several gradient buckets on one device set (``Strategy.bucket_cap_mb``,
``strategies.lowered.split_buckets``), each started as soon as its gradients are final
(``strategies.overlap``): zoo mlp data parallel at a 4 KiB cap (two buckets in float64) and gpt
at ZeRO level 1 (each flat bucket reduce-scattered in its own chunks) at 8 KiB (seven buckets);
and gpt at ZeRO level 3 with prefetch units of whole layers (``fsdp_unit`` "block",
``strategies.prefetch``: a layer's groups gathered in one call started at the previous layer's
first gathering step). On 2 gloo processes, float64, SGD and Adam, against one device
(``harness.compare``); ``SLOW_2``'s cases (2 micro-batches, recompute) under ``-m slow``."""

from __future__ import annotations

import pytest

from soapsearch.executor import build_model
from strategies.lowering import lower
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("mlp", "cap4k_dp"), ("gpt", "cap8k_zero1_dp"), ("gpt", "unitblock_zero3_dp")]
SLOW_2 = [("gpt", "cap8k_dp_mb2"), ("gpt", "unitblock_zero3_dp_mb2"), ("gpt", "unitblock_zero3_dp+rc_blocks"),
          ("gpt", "unitblock_zero3_dp+rc_layers")]
"""Run under ``pytest -m slow`` (tests/executor/test_parity_buckets_slow.py): the README's test
command stays within CI's time."""


@pytest.mark.parametrize("model,plan,buckets", [("mlp", "cap4k_dp", 2), ("gpt", "cap8k_dp_mb2", 7),
                                                ("gpt", "cap8k_zero1_dp", 7)])
def test_the_plans_have_several_buckets(model, plan, buckets):
    g = build_model(model, "tiny", dtype="float64").graph
    assert len(lower(g, make_plan(g, plan, 2)).gradient_sync.buckets) == buckets


def test_the_block_plans_prefetch_whole_layers():
    g = build_model("gpt", "tiny", dtype="float64").graph
    for name in ("unitblock_zero3_dp", "unitblock_zero3_dp_mb2", "unitblock_zero3_dp+rc_blocks",
                 "unitblock_zero3_dp+rc_layers"):
        plan = make_plan(g, name, 2)
        assert plan.fsdp_unit == "block" and {c.zero for _, c in plan.items() if c.zero} == {3}


results2, _, test_parity_2_processes, _ = parity_tests(CASES_2, [])
