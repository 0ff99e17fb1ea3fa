"""The stage partitioner as an init (soapsearch/search/stageinit.py): the sweep's best pipelined
plans restaged by the dynamic program over the units' simulated compute times start the chains
where they rank before the sweep's even split; on a GPT of 4 layers whose head outweighs a
layer, the restaged start's slowest stage equals a brute-force split's, and a seeded search from
it is deterministic for 1 and 2 workers and no worse than the same seed without it."""

import functools
import importlib

import pytest
import torch

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch import trace
from soapsearch._models import GPT, GPTConfig
from soapsearch.search import search, stageinit
from soapsearch.search.api import Evaluator
from soapsearch.search.globalmove import Factorization, GlobalMoves
from soapsearch.search.mcmc import ChainStats
from soapsearch.search.pace import Pace
from soapsearch.search.stagemove import op_seconds, stage_count, stage_units
from tests.strategies.test_stages_dp import _brute


@functools.lru_cache(maxsize=1)
def _heavy_head_gpt():
    """4 layers of width 16 and a vocabulary of 1,000: the head outweighs a layer, so the even
    split of the blocks (the embedding with the first, the head with the last) is unbalanced."""
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=16, seq_len=8, vocab_size=1000)
    return trace(GPT(cfg), (torch.randint(0, 1000, (16, 8)), torch.randint(0, 1000, (16, 8))), name="gpt")


def test_the_restaged_start_is_the_brute_force_split_and_replaces_the_even_one():
    graph = _heavy_head_gpt()
    topo, cost = get_topology("p100-1x4"), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost, "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1, 2, 4), "bf16", evaluate)
    even = [moves.plan(Factorization(1, 4, 4, "gpipe", 0, False, False)),
            moves.plan(Factorization(2, 1, 4, "1f1b", 0, False, False))]
    timed = [(plan, evaluate(plan)) for plan in even]
    stats = ChainStats()
    starts = stageinit.restaged_starts(moves, evaluate, timed, stats, 0.0, None, Pace())
    assert len(starts) == 2 and starts[1] is even[1]  # one stage: kept as it is
    new = starts[0]
    assert new is not even[0] and stage_count(graph, new) == 4
    new.validate(graph)
    cut = stage_units(graph)
    assert [len(u) for u in cut][1:-1] == [22] * 4  # the layers between the embedding and the head
    per_op = op_seconds(graph, evaluate.planned(even[0]), topo, cost)
    times = [sum(per_op.get(op, 0.0) for op in u) for u in cut]
    stage_of = [{min(new[op].devices) for op in u if graph[op].kind not in ("input", "parameter")} for u in cut]
    assert all(len(s) == 1 for s in stage_of)
    slowest = max(sum(t for t, s in zip(times, stage_of) if s == {k}) for k in range(4))
    assert slowest == pytest.approx(_brute(times, 4), rel=1e-12)
    before = max(sum(t for u, t in zip(cut, times) if min(even[0][u[0]].devices) == k) for k in range(4))
    assert slowest < 0.8 * before  # the even split's last stage holds the head and a layer
    ms_even, ms_new = evaluate(even[0]).iteration_ms, evaluate(new).iteration_ms
    assert ms_new < 0.8 * ms_even
    assert stats.best is new and stats.best_result.iteration_ms == ms_new  # considered for the answer


def test_the_starts_are_ranked_by_their_results_not_simulated_again(monkeypatch):
    """The sweep may time more plans than the ``Evaluator`` keeps (``SEEN``): the restage ranks
    the starts by the results it is given, so it simulates the restaged plan alone."""
    graph = _heavy_head_gpt()
    evaluate = Evaluator(graph, get_topology("p100-1x4"), get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1, 2, 4), "bf16", evaluate)
    even = [moves.plan(Factorization(1, 4, 4, "gpipe", 0, False, False)),
            moves.plan(Factorization(2, 1, 4, "1f1b", 0, False, False))]
    timed = [(plan, evaluate(plan)) for plan in even]
    monkeypatch.setattr(importlib.import_module("soapsearch.search.evaluator"), "SEEN", 1)  # keeps the restaged plan only
    calls = evaluate.calls
    starts = stageinit.restaged_starts(moves, evaluate, timed, ChainStats(), 0.0, None, Pace())
    assert evaluate.calls == calls + 1 and starts[1] is even[1] and stage_count(graph, starts[0]) == 4
    assert evaluate(starts[0]) is not None and evaluate.calls == calls + 1  # remembered


def test_a_search_from_the_restaged_starts_is_deterministic_and_no_worse(monkeypatch):
    graph = _heavy_head_gpt()
    kw = dict(topology="p100-1x4", budget_s=None, proposals=8, seed=5, chains=2, optimizer="adam",
              precision="bf16", init=("swept", "swept"), exhaustive_limit=0)
    api = importlib.import_module("soapsearch.search.api")

    class Staged(GlobalMoves):  # the four-stage factorizations alone: the sweep's starts are pipelined
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.factorizations = [f for f in self.factorizations if f.pp == 4]

    monkeypatch.setattr(api, "GlobalMoves", Staged)
    starts = []
    spy = stageinit.restaged_starts

    def kept(*args, **kwargs):
        out = spy(*args, **kwargs)
        starts.append([args[1](p).iteration_ms for p in out[:2]])
        return out

    monkeypatch.setattr(api, "restaged_starts", kept)
    one, two = (search(graph, workers=w, **kw) for w in (1, 2))
    assert one.strategy == two.strategy and one.predicted_ms == two.predicted_ms
    monkeypatch.setattr(stageinit, "RESTAGED_STARTS", 0)
    without = search(graph, workers=1, **kw)
    with_init, even = starts[0], starts[2]
    assert starts[1] == with_init  # the chains' starts, restaged
    assert with_init[0] < 0.98 * even[0] and with_init[1] < 0.9 * even[1]
    one.strategy.validate(graph)
    assert one.predicted_ms <= min(with_init) * (1 + 1e-12)
    assert one.predicted_ms <= without.predicted_ms
