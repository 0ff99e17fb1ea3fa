"""Opaque ops run: an op no rule covers (a module with weights, a function, an in-place method)
runs whole on one device, its inputs gathered there and its output sent on, and one step
equals one device (``tests/executor/test_parity.py``'s comparison) whatever the plan around it."""

from __future__ import annotations

import pytest

from soapsearch.executor import build_model
from strategies.rules import OPAQUE
from tests.executor.harness import parity_tests
from tests.executor.models import SPEC as M

pytestmark = pytest.mark.distributed

MODEL = M + "opaque"
CASES_2 = [(MODEL, "dp"), (MODEL, "mp"), (MODEL, "random1"), (MODEL, "random2")]
CASES_4 = [(MODEL, "owt"), (MODEL, "random3")]


def test_the_model_has_opaque_ops_with_weights():
    graph = build_model(MODEL, "tiny").graph
    opaque = {n.attrs["target"]: n for n in graph if n.kind == OPAQUE}
    assert set(opaque) >= {"bilinear", "flip", ".relu_()", ".repeat()"}
    assert [w.name for w in opaque["bilinear"].weights] == ["bilinear.weight", "bilinear.bias"]


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
