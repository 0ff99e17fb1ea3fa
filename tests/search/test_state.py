"""Micro-batches are part of a chain's state (issue 23): every plan a chain holds — its start, a
reset target, another chain's best — carries its own micro-batches and schedule, and every
proposal made from it is valid for them."""

import random

import pytest

from simulator.presets import get_topology
from soapsearch import trace, zoo
from soapsearch.search import search
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import Budget, ChainStats, candidate_configs, consider, plan_cost, run_chain
from soapsearch.search.moves import MoveRates, Moves, Space, neighbor_ops
from simulator.cost import get_cost_model
from strategies import baseline
from strategies.config import validate_config


@pytest.fixture(scope="module")
def gpt():
    return trace(*zoo.build("gpt", "tiny", batch_size=32))


def test_resets_across_plans_with_other_micro_batch_counts(gpt):
    """A chain at 1 micro-batch whose best is a pipeline plan at 8 (and one started from it) resets
    to it every 7 proposals and keeps proposing: every plan it scores is valid for its own
    count. Before, a reset to the 8-micro-batch best then applied a config made for 1."""
    n, topo = 4, get_topology("p100-1x4")
    evaluate = Evaluator(gpt, topo, get_cost_model("analytical"))
    checked = []

    def checking(plan):
        for node in gpt:
            validate_config(node, plan[node.name], n, plan.microbatches)
        checked.append(plan.microbatches)
        return evaluate(plan)

    pipe = baseline("pipeline", gpt, n, 8).with_microbatches(8, "1f1b")
    dp = baseline("data_parallel", gpt, n)
    candidates = candidate_configs(gpt, n, 1, None)
    for start, best in ((dp, pipe), (pipe, dp)):
        moves = Moves(gpt, n, MoveRates(microbatches=0.0), (1, 8), None,
                      {1: Space(candidates, neighbor_ops(gpt, candidates))})
        stats = ChainStats()
        res = evaluate(best)
        consider(stats, best, res, plan_cost(res) * 1e-3, 0.0)  # the reset target, whatever the chain finds
        run_chain(start, checking, candidates, Budget(proposals=300), random.Random(3), reset_every=7,
                  stats=stats, moves=moves)
        assert stats.proposals >= 150 and {1, 8} <= set(checked)
        checked.clear()


@pytest.mark.parametrize("workers", [1, 2])
def test_chains_from_plans_with_other_counts_never_raise(gpt, workers):
    """Chains started from the pipeline baseline at 8 micro-batches and from data parallel at 1,
    resetting often to the best plan (which may hold either count): the search runs to its
    budget, the same plan with 1 or 2 workers."""
    pipe = baseline("pipeline", gpt, 4, 8).with_microbatches(8, "gpipe")
    runs = [search(gpt, topology="p100-1x4", budget_s=None, proposals=400, chains=4, workers=workers, seed=s,
                   init=(pipe, "data_parallel"), reset_every=5, microbatch_move=0.1) for s in (0, 1)]
    for r in runs:
        assert r.proposals >= 4 and r.result.iteration_ms <= min(r.baselines.values())
    again = search(gpt, topology="p100-1x4", budget_s=None, proposals=400, chains=4, workers=3 - workers, seed=0,
                   init=(pipe, "data_parallel"), reset_every=5, microbatch_move=0.1)
    assert again.strategy == runs[0].strategy
