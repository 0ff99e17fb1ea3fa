"""The chain's temperature (issue 23): set from a pilot of proposals, annealed, over replicas
that exchange plans by parallel tempering."""

import math
import random
from types import SimpleNamespace

import pytest

from soapsearch.search import search
from soapsearch.search.mcmc import ANNEAL, BETA_C, annealed, exchange, pilot_beta
from tests.conftest import traced


def test_pilot_accepts_a_median_worse_proposal_with_probability_one_half():
    worse = [0.5, 4.0, 1.0, 9.0, 2.0]
    beta = pilot_beta(worse, 10.0)
    assert math.exp(-beta * 2.0) == pytest.approx(0.5)
    assert pilot_beta([], 10.0) == BETA_C / 10.0  # nothing worse around the start
    assert annealed(beta, 0.0) == beta and annealed(beta, 1.0) == pytest.approx(ANNEAL * beta)
    assert annealed(beta, 0.5) == pytest.approx(math.sqrt(ANNEAL) * beta)


def test_exchange_follows_the_tempering_rule():
    """Hot (β=1) holds cost 1, cold (β=2) cost 2: the better plan always goes to the cold one;
    the other way round the swap is taken with probability exp((1 − 2)(2 − 1)) = e^-1."""
    rng = random.Random(0)
    hot, cold = SimpleNamespace(cost=1.0), SimpleNamespace(cost=2.0)
    swaps = 0
    for _ in range(20000):
        chain = [hot, cold]
        exchange(chain, [1.0, 2.0], rng)
        swaps += chain[1] is hot
    assert swaps / 20000 == pytest.approx(0.5, abs=0.02)  # pair (0, 1) is tried in half the rounds
    swaps = 0
    for _ in range(40000):
        chain = [cold, hot]  # the worse plan cold
        exchange(chain, [1.0, 2.0], rng)
        swaps += chain[1] is cold
    # half the rounds try pair (0, 1); each accepted with probability e^-1
    assert swaps / 40000 == pytest.approx(0.5 * math.exp(-1), abs=0.01)


def test_the_tempered_chain_is_deterministic_for_a_seed_with_any_workers():
    g = traced("mlp", batch_size=8)
    runs = [search(g, topology="p100-1x4", budget_s=None, proposals=600, chains=3, workers=w, seed=5,
                   exhaustive_limit=0, patience=0) for w in (1, 3)]
    assert runs[0].strategy == runs[1].strategy and runs[0].proposals == runs[1].proposals == 600
    assert runs[0].predicted_ms == runs[1].predicted_ms


def test_the_coldest_replica_starts_from_the_best_scored_plan():
    """The best plan scored before the chain (a baseline: every op on device 0, 1 ms) is
    isolated, every other plan costing 10 ms, so no walk from data parallel reaches it; the
    coldest replica starts there and its proposals (a quarter: one sweep in four) lie within an
    op and its neighbours of it."""
    from simulator.result import SimResult
    from soapsearch.search.mcmc import Budget, ChainStats, candidate_configs, consider, neighbor_ops, run_chain
    from strategies import ParallelConfig, Strategy, data_parallel

    g = traced("mlp")
    best = Strategy.of({n.name: ParallelConfig((1,) * len(n.dims), (0,)) for n in g}, 2)
    seen = []

    def evaluate(plan, summary=False):
        seen.append(plan)
        return SimResult(1e-3 if plan == best else 1e-2, (), (0.5, 0.5), (1.0, 1.0), {}, 1)

    stats = ChainStats()
    consider(stats, best, evaluate(best), 1.0, 0.0)
    candidates = candidate_configs(g, 2, 1, None)
    run_chain(data_parallel(g, 2), evaluate, candidates, Budget(proposals=232), random.Random(0),
              stats=stats, neighbors=neighbor_ops(g, candidates), patience=0)
    near = [p for p in seen[2 + 32:] if sum(p[n.name] != best[n.name] for n in g) <= 3]
    assert stats.best is best and stats.proposals == 232
    assert len(near) == 45  # the coldest's 5 sweeps of 10 after the pilot, less 5 proposals of no change
