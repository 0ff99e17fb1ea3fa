"""Parity of plans with reduction cuts (docs/design.md, "The lowering": Partial sums): every
linear row-parallel (``row``), Megatron-LM's MLP (``colrow``: fc column-parallel, proj
row-parallel, Shoeybi et al. 2019), the ``megatron`` baseline (tensor parallel 2 ways, sequence
parallel between the blocks, a vocab-parallel embedding) and random plans that cut every op with a reduction dim on it
(``random_r<seed>``: linears, the embedding's vocabulary rows, matmuls), on 2 and 4 gloo
processes, float64, SGD and Adam, against one device (``harness.compare``)."""

from __future__ import annotations

import pytest

from strategies.lowering import lower
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES_2 = [("gpt", "row"), ("gpt", "colrow"), ("gpt", "megatron"), ("mlp", "row"), ("gpt", "random_r1"),
           ("mlp", "random_r2")]
CASES_4 = [("gpt", "colrow"), ("gpt", "megatron"), ("gpt", "row"), ("gpt", "random_r3"), ("mlp", "random_r4")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_hold_partial_sums(world, cases):
    """Each plan really cuts a reduction dim: some transfer carries a Partial piece."""
    for model, plan in cases:
        g = traced(model)
        assert any(t.partial for t in lower(g, make_plan(g, plan, world)).transfers), (model, plan)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
