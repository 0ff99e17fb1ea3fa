"""Parity of convs cut on their input channels (an R dim: each partition reads its channels of
x and W and holds a Partial sum, the bias added once; ``strategies.rules.conv``): every conv of
the zoo's alexnet that the degree divides (``conv_in``) and random plans that cut every op with
a reduction dim on it (``random_r<seed>``: convs, linears, the loss's classes), on 2 and 4 gloo
processes, float64, SGD and Adam, against one device (``harness.compare``)."""

from __future__ import annotations

import pytest

from strategies.lowering import lower
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan, partial_sources

pytestmark = pytest.mark.distributed

CASES_2 = [("alexnet", "conv_in"), ("alexnet", "random_r7")]
CASES_4 = [("alexnet", "conv_in"), ("alexnet", "random_r8")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_cut_conv_in_channels(world, cases):
    """Each plan cuts some conv on its in channels: its consumers read Partial pieces."""
    for model, plan in cases:
        g = traced(model)
        strategy = make_plan(g, plan, world)
        cut = [n.name for n in g if n.kind == "conv2d" and strategy[n.name].degrees[4] > 1]
        assert len(cut) >= (4 if plan == "conv_in" else 2), (model, plan, cut)
        assert partial_sources(lower(g, strategy)) & set(cut), (model, plan)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
