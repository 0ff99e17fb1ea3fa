"""How often the search reaches the optimum (issue 23): on each small graph of
``tests/search/optimum_graphs.py`` every plan of the op configs is simulated (the exact
optimum, ``soapsearch.search.exhaustive``), then one MCMC chain per seed starts from data
parallel, without the enumeration shortcut, with the search's op, group and block moves, and
runs until it reaches the optimum or its proposal budget. Prints, per graph: the space, the
optimum vs data parallel, the rate of seeds reaching it and the median proposals they needed.

    python benchmarks/search_optimum.py [--seeds 20] [--proposals 5000] [--constant]

Goal: every graph's optimum reached on >= 95 % of seeds within 5,000 proposals. ``--beta``
runs the constant-temperature chain for comparison (one plan at β = BETA_C / cost(data
parallel), mcmc's rule before the pilot, annealing and tempering).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.cost import get_cost_model  # noqa: E402
from simulator.presets import get_topology  # noqa: E402
from soapsearch.search.api import Evaluator  # noqa: E402
from soapsearch.search.blockmove import BlockMoves  # noqa: E402
from soapsearch.search.chains import chain_rng  # noqa: E402
from soapsearch.search.exhaustive import search_exhaustively  # noqa: E402
from soapsearch.search.mcmc import BETA_C, Budget, ChainStats, candidate_configs, neighbor_ops, run_chain  # noqa: E402
from strategies.baselines import data_parallel  # noqa: E402
from tests.search.optimum_graphs import CASES, Case  # noqa: E402

TOLERANCE = 1e-9
"""A chain has reached the optimum when its best costs at most optimum × (1 + TOLERANCE)."""


def optimum(case: Case):
    """(graph, evaluator, candidates, optimum cost, space size, data parallel's cost), costs in
    ms (``plan_cost``: every plan here fits)."""
    graph, topo = case.graph(), get_topology(case.topology)
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"))
    cands = candidate_configs(graph, case.num_devices, 1, None)
    stats = ChainStats()
    size = search_exhaustively(cands, evaluate, stats, 0.0, case.num_devices, 1, "gpipe", "model")
    dp = evaluate(data_parallel(graph, case.num_devices)).iteration_ms
    return graph, evaluate, cands, stats.best_cost, size, dp


def reach(graph, evaluate, cands, best: float, num_devices: int, seed: int, proposals: int,
          beta: float | None = None) -> int | None:
    """Proposals a chain from data parallel needed to reach ``best`` (None: it did not)."""
    stats = ChainStats()
    run_chain(data_parallel(graph, num_devices), evaluate, cands, Budget(proposals=proposals), chain_rng(seed, 0),
              beta=beta, stats=stats, should_stop=lambda: stats.best_cost <= best * (1 + TOLERANCE),
              neighbors=neighbor_ops(graph, cands), blocks=BlockMoves(graph, num_devices, 1) or None)
    return stats.proposals if stats.best_cost <= best * (1 + TOLERANCE) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--proposals", type=int, default=5000)
    ap.add_argument("--constant", action="store_true",
                    help="constant β = BETA_C / cost(data parallel) (default: pilot, annealing, tempering)")
    args = ap.parse_args()
    print(f"{'graph':22s} {'plans':>7s} {'opt ms':>9s} {'DP ms':>9s} {'reached':>9s} {'median prop':>11s}")
    for case in CASES:
        graph, evaluate, cands, best, size, dp = optimum(case)
        beta = BETA_C / dp if args.constant else None
        runs = [reach(graph, evaluate, cands, best, case.num_devices, s, args.proposals, beta)
                for s in range(args.seeds)]
        hit = [r for r in runs if r is not None]
        med = f"{statistics.median(hit):.0f}" if hit else "-"
        print(f"{case.name:22s} {size:7d} {best:9.4f} {dp:9.4f} {len(hit):4d}/{len(runs):<4d} {med:>11s}", flush=True)


if __name__ == "__main__":
    main()
