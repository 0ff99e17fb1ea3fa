"""Parity of plans with reduction cuts (docs/design.md, "The lowering": Partial sums): every
linear row-parallel (``row``), Megatron-LM's MLP (``colrow``: fc column-parallel, proj
row-parallel, Shoeybi et al. 2019), the ``megatron`` baseline (tensor parallel 2 ways, sequence
parallel between the blocks, a vocab-parallel embedding) and random plans that cut every op with a reduction dim on it
(``random_r<seed>``: linears, the embedding's vocabulary rows, matmuls), on 2 and 4 gloo
processes, a linear reading a linear cut row- then column-parallel (``rowcol``: an all-reduce),
float64, SGD and Adam, against one device (``harness.compare``). The Partial sums
move as collectives where their readers form one (``strategies.collectives``: the row-parallel
linears' all-reduces, the megatron plan's reduce-scatters and all-gathers), point to point
elsewhere (the random plans have both)."""

from __future__ import annotations

import pytest

from strategies.lowering import lower
from tests.conftest import traced
from soapsearch.executor import build_model
from tests.executor.harness import parity_tests
from tests.executor.models import SPEC
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

BOTTLENECK = SPEC + "bottleneck"
CASES_2 = [("gpt", "row"), ("gpt", "colrow"), ("gpt", "megatron"), ("mlp", "row"), ("gpt", "random_r1"),
           ("mlp", "random_r2"), (BOTTLENECK, "rowcol")]
CASES_4 = [("gpt", "colrow"), ("gpt", "megatron"), ("gpt", "row"), ("gpt", "random_r3"), ("mlp", "random_r4"),
           (BOTTLENECK, "rowcol")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_hold_partial_sums(world, cases):
    """Each plan really cuts a reduction dim: some Partial sum moves, as a point-to-point piece
    or a collective that sums (all-reduce, reduce-scatter); and between them the cases run
    every collective kind and Partial pieces point to point."""
    kinds, pieces = set(), False
    for model, plan in cases:
        g = traced(model) if ":" not in model else build_model(model, "tiny", dtype="float64").graph
        low = lower(g, make_plan(g, plan, world))
        sums = [c for c in low.collectives if c.kind != "all_gather"]
        assert any(t.partial for t in low.transfers) or sums, (model, plan)
        kinds |= {c.kind for c in low.collectives}
        pieces = pieces or any(t.partial and not t.local for t in low.transfers)
    assert kinds == {"all_reduce", "reduce_scatter", "all_gather"} and pieces


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_moves_partial_sums_as_collectives(world):
    """The megatron plan on zoo gpt: reduce-scatters of the row-parallel linears' Partial sums
    into the sequence-cut ops, all-gathers of the sequence shards into the column-parallel
    linears, and no Partial piece point to point."""
    g = traced("gpt")
    low = lower(g, make_plan(g, "megatron", world))
    kinds = {(c.kind, g[c.op].kind) for c in low.collectives}
    assert {("reduce_scatter", "linear"), ("all_gather", "layernorm")} <= kinds
    assert not any(t.partial and not t.local for t in low.transfers)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
