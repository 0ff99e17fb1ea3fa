"""A search's results do not depend on returning freed memory to the OS (``simulator.heap``):
with a trim after every simulation (``TRIM_FROM`` 0) and with none (no glibc), the same plan,
the same predicted time and the same proposals, for a seed under a proposal budget."""

from __future__ import annotations

import pytest

from simulator import heap
from soapsearch.search import search
from tests.conftest import traced


def _searched(graph):
    r = search(graph, topology="p100-2x2", budget_s=None, proposals=40, seed=0, chains=2, workers=1)
    return r.strategy, r.predicted_ms, r.proposals


@pytest.mark.skipif(heap._malloc_trim() is None, reason="malloc_trim is glibc's")
def test_search_is_the_same_with_and_without_the_trim(monkeypatch):
    graph = traced("gpt", batch_size=16)
    monkeypatch.setattr(heap, "TRIM_FROM", 0)
    calls = heap.TRIMS.calls
    trimming = _searched(graph)
    assert heap.TRIMS.calls > calls  # the baselines and proposals simulated, then trimmed
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    calls = heap.TRIMS.calls
    assert _searched(graph) == trimming
    assert heap.TRIMS.calls == calls
