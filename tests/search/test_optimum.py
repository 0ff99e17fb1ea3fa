"""The search reaches the optimum (issue 23): on each small graph of ``optimum_graphs.py`` every
plan of the op configs is enumerated (``exhaustive.py``), and an MCMC chain started from data
parallel, without the enumeration shortcut, reaches that optimum within 5,000 proposals on
>= 95 % of seeds: all 5 seeds of each 2-device graph here, 19 of 20 of every graph under
``slow`` (the rates per graph:
``benchmarks/search_optimum.py``, benchmarks/README.md)."""

import random

import pytest

from benchmarks.search_optimum import optimum, reach
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import Budget, ChainStats, candidate_configs, neighbor_ops, run_chain
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from strategies import baseline
from tests.conftest import traced
from tests.search.optimum_graphs import CASES

PROPOSALS = 5000


@pytest.fixture(scope="module")
def optima():
    return {}


def _optimum(optima, case):
    if case.name not in optima:
        optima[case.name] = optimum(case)
    return optima[case.name]


def _rate(optima, case, seeds):
    graph, evaluate, cands, best, size, dp = _optimum(optima, case)
    assert size >= 200 and best < dp  # an optimum data parallel is not, among hundreds of plans
    runs = [reach(graph, evaluate, cands, best, case.num_devices, s, PROPOSALS) for s in seeds]
    return sum(r is not None for r in runs) / len(runs)


SMALL = [c for c in CASES if c.num_devices == 2]
"""The default run's graphs (at most 4,800 plans each: enumerated in seconds); ``slow`` adds
the 4-device ones (13,552 plans)."""


@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_reaches_the_optimum_on_every_seed(optima, case):
    assert _rate(optima, case, range(5)) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reaches_the_optimum_on_95_percent_of_20_seeds(optima, case):
    assert _rate(optima, case, range(100, 120)) >= 0.95


def test_leaves_data_parallel_where_the_constant_temperature_stays():
    """The issue's example: on mlp (8 ops) on 2 P100s, one device is 0.6 % faster than data
    parallel (and the best of the 96,000 plans: benchmarks/README.md); the tempered, annealed
    chain from data parallel reaches it on every seed (benchmarks/search_optimum.py compares the
    constant β = BETA_C / cost(start) chain's rates)."""
    g, topo = traced("mlp"), get_topology("p100-1x2")
    evaluate = Evaluator(g, topo, get_cost_model("analytical"))
    cands = candidate_configs(g, 2, 1, None)
    one = evaluate(baseline("single_device", g, 2)).iteration_ms
    dp = baseline("data_parallel", g, 2)
    assert one < evaluate(dp).iteration_ms
    for beta, reaches in ((None, True),):  # the tempered chain (beta None)
        for seed in range(2):
            stats = ChainStats()
            run_chain(dp, evaluate, cands, Budget(proposals=PROPOSALS), random.Random(seed), beta=beta,
                      stats=stats, neighbors=neighbor_ops(g, cands),
                      should_stop=lambda: stats.best_cost <= one * (1 + 1e-9))
            assert (stats.best_cost <= one * (1 + 1e-9)) == reaches
