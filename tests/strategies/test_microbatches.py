"""Micro-batch j of every op reads micro-batch j of its producers (``check_microbatches``), as the
lowering assumes: an op that mixes samples across micro-batches is refused with its reason, not
lowered into transfers that bring part of what it reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from soapsearch import trace, zoo
from soapsearch.search import search
from strategies import PlanError, data_parallel
from strategies.lowering import lower
from strategies.lowering_shared import shapes_of
from strategies.pieces import check_microbatches
from tests.conftest import traced



class SeqFirst(nn.Module):
    """[B, T, H] -> [T, B, H] -> [T·B, H]: the flattened dim is T-major, so its first half is
    the first time steps of every sample, not the first samples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.permute(1, 0, 2).reshape(-1, 4)).sum()


@pytest.fixture(scope="module")
def seq_first():
    return trace(SeqFirst(), (torch.randn(4, 4, 4),))


@pytest.mark.parametrize("name", zoo.names())
def test_the_zoo_keeps_micro_batches_apart(name):
    g = traced(name, batch_size=8)
    for m in (1, 2, 4, 8):
        check_microbatches(g, m)


def test_an_op_that_mixes_micro_batches_is_refused(seq_first):
    check_microbatches(seq_first, 1)
    with pytest.raises(PlanError, match=r"op 'reshape': microbatches = 2: its micro-batch 0 reads \[0, 4\) of "
                                        r"'permute''s sample dim \(4\), outside that op's micro-batch 0 \[0, 2\)"):
        check_microbatches(seq_first, 2)
    plan = data_parallel(seq_first, 1)
    lower(seq_first, plan)  # one micro-batch: fine
    with pytest.raises(PlanError, match=r"op 'reshape': microbatches = 2"):  # not lowered into half the transfers
        lower(seq_first, plan.with_microbatches(2, "gpipe"))
    with pytest.raises(PlanError, match=r"op 'reshape': microbatches = 2"):
        search(seq_first, topology="p100-1x2", budget_s=None, proposals=5, microbatches=2)
    found = search(seq_first, topology="p100-1x2", budget_s=None, proposals=5)
    assert "pipeline" not in found.baselines  # every pipeline needs micro-batches
    assert found.strategy.microbatches == 1 and {"data_parallel", "model_parallel"} <= set(found.baselines)


def test_the_shape_ids_are_found_once_per_graph(monkeypatch):
    import weakref
    import strategies.pieces as pieces
    found = []
    monkeypatch.setattr(pieces, "_SHAPE_IDS", weakref.WeakKeyDictionary())  # the graphs checked before: forgotten
    monkeypatch.setattr(pieces, "_CHECKED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(pieces, "shapes_of", lambda graph: found.append(graph) or shapes_of(graph))
    g = traced("gpt", batch_size=8)
    for m in (2, 4, 2):
        check_microbatches(g, m)
    assert found == [g] and pieces.shape_ids(g) == shapes_of(g)
    assert pieces._CHECKED[g] == {2, 4}  # each count checked once: a pure function of the graph and m
    seq_first = trace(SeqFirst(), (torch.randn(4, 3, 4),))
    for _ in range(2):  # a count refused is refused again, not remembered as checked
        with pytest.raises(PlanError, match="micro-batch"):
            check_microbatches(seq_first, 2)
    assert found == [g, seq_first]  # another graph: its own ids
