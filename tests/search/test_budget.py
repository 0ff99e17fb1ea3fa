"""The time budget counts the baselines' scoring (a search returns within it with the best plan
scored so far, naming the baselines left unscored), and a chain whose best stops improving
stops early (``SearchConfig.patience``)."""

import importlib
import random
import time

import pytest

from simulator.result import SimResult
from simulator.simulate import simulate_plan
from soapsearch.search.api import search
from soapsearch.search.mcmc import Budget, candidate_configs, run_chain
from soapsearch.search.pace import SUMMARY, Pace
from strategies import data_parallel
from tests.conftest import traced


@pytest.fixture(scope="module")
def gpt():
    return traced("gpt", batch_size=16)


def test_a_tiny_budget_ends_while_scoring_the_baselines(gpt):
    r = search(gpt, topology="p100-4x4", budget_s=1e-6, workers=1)  # far below one baseline's scoring
    assert r.elapsed_s < 1e-6 + 2.0  # one baseline scored (the first always is) and the answer
    assert list(r.baselines) == ["data_parallel"] and r.strategy == r.baseline_plans["data_parallel"]
    assert r.unscored == ("model_parallel", "owt", "zero1", "fsdp", "single_device", "megatron", "megatron_lm",
                          "pipeline")
    assert r.proposals == 0


def test_the_budget_is_wall_time_with_the_baselines(gpt):
    r = search(gpt, topology="p100-4x4", budget_s=3.0, workers=1, patience=0)
    assert r.elapsed_s < 3.0 + 2.0 and len(r.baselines) + len(r.unscored) == 9 and r.stopped_early == 0
    assert r.predicted_ms <= min(r.baselines.values()) * (1 + 1e-12)


def _flat(plan, summary=False):  # every plan costs the same: the best never improves
    return SimResult(1e-3, (), (0.5,), (1.0,), {}, 1)


def test_scored_counts_the_proposals_that_made_a_plan():
    # an op drawn its own config makes no plan: a proposal of the budget, not scored; every other
    # proposal is scored once (the start is scored before the first proposal)
    g = traced("mlp", "default")
    scored = []

    def counted(plan, summary=False):
        scored.append(plan)
        return _flat(plan)

    stats = run_chain(data_parallel(g, 2), counted, candidate_configs(g, 2, 1, None), Budget(proposals=200),
                      random.Random(0), beta=0.5, patience=0)
    assert stats.proposals == 200 and stats.scored == len(scored) - 1 and 100 < stats.scored < 200


@pytest.mark.parametrize("beta", [None, 0.5])
@pytest.mark.parametrize("patience,proposals,stopped", [(None, 101, 1), (30, 30, 1), (0, 200, 0)])
def test_a_chain_that_gains_nothing_stops_early(beta, patience, proposals, stopped):
    g = traced("mlp", "default")
    stats = run_chain(data_parallel(g, 2), _flat, candidate_configs(g, 2, 1, None), Budget(proposals=200),
                      random.Random(0), beta=beta, patience=patience)
    assert (stats.proposals, stats.stopped_early) == (proposals, stopped)


def test_early_stops_are_the_same_with_1_and_3_workers():
    g = traced("alexnet", "default")
    kw = dict(topology="p100-1x4", budget_s=None, proposals=600, seed=1, chains=3, patience=40)
    one, three = (search(g, workers=w, **kw) for w in (1, 3))
    assert one.stopped_early == three.stopped_early >= 1 and one.proposals == three.proposals < 600
    assert one.strategy == three.strategy and one.predicted_ms == three.predicted_ms
    assert 0 < one.scored == three.scored <= one.proposals  # summed over the chains alike


def test_a_time_budget_alone_is_spent_whole():
    """No gain for its whole budget, yet a chain under seconds alone runs to their end (its
    annealing turns greedy only there); 30 proposals of patience still stop it."""
    g = traced("mlp", "default")
    for patience, stopped in ((None, 0), (30, 1)):
        t0 = time.perf_counter()
        stats = run_chain(data_parallel(g, 2), _flat, candidate_configs(g, 2, 1, None), Budget(seconds=0.4),
                          random.Random(0), patience=patience)
        assert stats.stopped_early == stopped
        assert (time.perf_counter() - t0 >= 0.4) == (not stopped) and stats.proposals >= 30


SLACK = 1.0
"""Seconds a search may end past its budget in the tests below: the last step's error against
its prediction (the real simulations, a fraction of a second on gpt × 16 devices under load),
far below the injected delays."""


def _slowed(monkeypatch, delay: float) -> list[float]:
    """Every summary a search's simulation makes takes ``delay`` s more (a baseline's, the
    answer's); the times (perf_counter) each of them ends are returned, as they come."""
    scorer = importlib.import_module("soapsearch.search.evaluator")
    real, ends = scorer.simulate_plan, []

    def slow(*args, summary=True, **kw):
        if callable(summary):  # asked of the result without its summary: slowed where it says yes
            ask = summary

            def summary(quick):
                return ask(quick) and (time.sleep(delay) or True)
        elif summary:
            time.sleep(delay)
        result = real(*args, summary=summary, **kw)
        if result.memory:
            ends.append(time.perf_counter())
        return result

    monkeypatch.setattr(scorer, "simulate_plan", slow)
    return ends


def test_a_baseline_whose_scoring_would_end_past_the_budget_is_not_scored(gpt, monkeypatch):
    # Each baseline's summarized simulation takes 3 s more: data parallel and model parallel
    # end at about 6.5 s, and OWT (predicted from their mean) would end past 7.5 s, so it and
    # the rest are not scored, and no chain starts (its start is not predicted to fit either).
    # Before, OWT started and the search ended at about 9.7 s.
    ends = _slowed(monkeypatch, 3.0)
    t0 = time.perf_counter()
    r = search(gpt, topology="p100-4x4", budget_s=7.5, workers=1, patience=0, seed=0)
    assert r.elapsed_s < 7.5 + SLACK and max(ends) - t0 < 7.5 + SLACK
    assert "owt" in r.unscored and 1 <= len(r.baselines) <= 2 and r.proposals == 0


def _paced(plan, summary=False):  # every plan costs the same and takes 1 s to score
    time.sleep(1.0)
    return _flat(plan)


def test_a_proposal_that_would_end_past_the_budget_does_not_start():
    # The start scores in 1 s, the first proposal (predicted from it) ends at 2 s, and a
    # second would end at 3 s, past the 2.5 s budget: the chain ends at 2 s. Before, it
    # started and the chain ended at 3 s.
    g = traced("mlp", "default")
    t0 = time.perf_counter()
    stats = run_chain(data_parallel(g, 2), _paced, candidate_configs(g, 2, 1, None), Budget(seconds=2.5),
                      random.Random(0), patience=0)
    elapsed = time.perf_counter() - t0
    assert stats.proposals == 1 and elapsed < 2.5 + 0.4


@pytest.mark.parametrize("workers", [1, 2])
def test_the_answer_is_summarized_when_scored_not_simulated_again(workers, monkeypatch):
    # The chains' best plan came with its summary when it was scored (it led the search then):
    # nothing is simulated after the chains, and its figures are a fresh simulation's.
    api = importlib.import_module("soapsearch.search.api")
    g = traced("mlp")
    scorer = importlib.import_module("soapsearch.search.evaluator")
    real_chains, real_sim, after = api.run_chains, scorer.simulate_plan, []

    def chains(*args, **kw):
        out = real_chains(*args, **kw)
        after.append("chains")
        return out

    def sim(*args, **kw):
        if after:
            after.append("simulated")
        return real_sim(*args, **kw)

    monkeypatch.setattr(api, "run_chains", chains)
    monkeypatch.setattr(scorer, "simulate_plan", sim)
    r = search(g, topology="p100-1x4", budget_s=None, proposals=100, seed=1, chains=2, workers=workers)
    assert after == ["chains"] and r.history and r.history[-1][1] > 0  # a chain's plan, scored once
    assert not any(r.strategy == p for p in r.baseline_plans.values())
    full = simulate_plan(g, r.strategy, "p100-1x4", summary=True)
    assert (r.result.iteration_time, r.result.peak_memory_bytes, r.result.busy_time, r.result.bytes_moved,
            r.result.memory) == (full.iteration_time, full.peak_memory_bytes, full.busy_time, full.bytes_moved,
                                 full.memory)


def test_a_kind_not_timed_is_predicted_by_its_family_then_by_the_least_family():
    pace = Pace()
    assert pace.predict("proposal/op") == 0.0 and pace.fits("proposal/op", time.perf_counter() + 1e-3)
    pace.record("baseline/owt", 3.0)
    pace.record("baseline/megatron", 5.0)
    pace.record(SUMMARY, 0.5)  # a summary's pass predicts no step
    assert (pace.predict("baseline/owt"), pace.predict("baseline/pipeline"), pace.predict("proposal/op")) == (
        3.0, 4.0, 4.0)
    pace.record("proposal/global", 2.0)
    assert (pace.predict("proposal/op"), pace.predict("start")) == (2.0, 2.0)
    now = time.perf_counter()
    assert pace.fits("proposal/global", now + 10.0, SUMMARY) and not pace.fits("proposal/global", now + 2.4, SUMMARY)
