"""The time budget counts the baselines' scoring (a search returns within it with the best plan
scored so far, naming the baselines left unscored), and a chain whose best stops improving
stops early (``SearchConfig.patience``)."""

import random

import pytest

from simulator.result import SimResult
from soapsearch.search.api import search
from soapsearch.search.mcmc import Budget, candidate_configs, run_chain
from strategies import data_parallel
from tests.conftest import traced


@pytest.fixture(scope="module")
def gpt():
    return traced("gpt", batch_size=16)


def test_a_tiny_budget_ends_while_scoring_the_baselines(gpt):
    r = search(gpt, topology="p100-4x4", budget_s=1e-6, workers=1)  # far below one baseline's scoring
    assert r.elapsed_s < 1e-6 + 2.0  # one baseline scored (the first always is) and the answer
    assert list(r.baselines) == ["data_parallel"] and r.strategy == r.baseline_plans["data_parallel"]
    assert r.unscored == ("model_parallel", "owt", "zero1", "fsdp", "single_device", "megatron", "pipeline")
    assert r.proposals == 0


def test_the_budget_is_wall_time_with_the_baselines(gpt):
    r = search(gpt, topology="p100-4x4", budget_s=3.0, workers=1, patience=0)
    assert r.elapsed_s < 3.0 + 2.0 and len(r.baselines) + len(r.unscored) == 8 and r.stopped_early == 0
    assert r.predicted_ms <= min(r.baselines.values()) * (1 + 1e-12)


def _flat(plan, summary=False):  # every plan costs the same: the best never improves
    return SimResult(1e-3, (), (0.5,), (1.0,), {}, 1)


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


def test_a_time_budget_alone_is_spent_whole():
    """No gain for its whole budget, yet a chain under seconds alone runs to their end (its
    annealing turns greedy only there); 30 proposals of patience still stop it."""
    import time
    g = traced("mlp", "default")
    for patience, stopped in ((None, 0), (30, 1)):
        t0 = time.perf_counter()
        stats = run_chain(data_parallel(g, 2), _flat, candidate_configs(g, 2, 1, None), Budget(seconds=0.4),
                          random.Random(0), patience=patience)
        assert stats.stopped_early == stopped
        assert (time.perf_counter() - t0 >= 0.4) == (not stopped) and stats.proposals >= 30
