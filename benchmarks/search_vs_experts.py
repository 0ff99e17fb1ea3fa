"""The found plan against the experts: the FlexFlow paper's six models at paper scale (the zoo's
per-device batch 64 × devices) on its clusters, analytical costs. For each model and topology:
simulated ms of data parallel, model parallel, OWT, the best pipeline and the plan found by plain
MCMC from data parallel and OWT (FlexFlow, Jia et al. 2019, section 6) in ``--budget`` seconds,
its speedup over data parallel, data parallel's busy time on its busiest device (forward, backward and
update: the same work split evenly takes at least this long on some device, so "bound" = DP ms /
DP busy caps the speedup over data parallel of any plan that does not cut the work itself), and
proposals per second; a plan that does not fit in device memory is marked. ``--optuna`` adds, at equal time, the
TPE outer loop (``study_search``; Bergstra et al. 2011) next to plain MCMC. Asserts nothing.

``--suite gpt``: transformers on A100 nodes (``_gpt_suite.py``): zoo gpt, GPT-3 1.3B and 6.7B's
shapes and zoo llama against data parallel, Megatron-LM (T = 8 and the best T of 2, 4, 8) and the
best pipeline, the search starting from those plans.

    python benchmarks/search_vs_experts.py [--models alexnet,rnnlm] [--topologies p100-4x4]
        [--budget 60] [--seed 0] [--optuna]
    python benchmarks/search_vs_experts.py --suite gpt [--models gpt3-6.7b] [--topologies a100-1x8]
        [--budget 15] [--optimizer adam]
"""

from __future__ import annotations

import argparse
import time

from simulator.presets import get_topology
from soapsearch.search import search
from soapsearch.search.study import study_search
from _paper import paper_graph  # benchmarks/_paper.py
import _gpt_suite  # benchmarks/_gpt_suite.py

MODELS = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt"]
TOPOLOGIES = ["p100-4x4", "k80-16x4"]
EXPERTS = ["data_parallel", "model_parallel", "owt", "pipeline"]


def fmt(ms: float | None) -> str:
    return f"{ms:9.1f}" if ms is not None else f"{'-':>9s}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("flexflow", "gpt"), default="flexflow",
                    help="flexflow: the paper's six models (default); gpt: transformers on A100 nodes")
    ap.add_argument("--models", help=f"default: {','.join(MODELS)} (gpt: {','.join(_gpt_suite.MODELS)})")
    ap.add_argument("--topologies", help=f"default: {','.join(TOPOLOGIES)} (gpt: {','.join(_gpt_suite.TOPOLOGIES)})")
    ap.add_argument("--budget", type=float, help="search seconds per model and topology (default 60; gpt: "
                    f"{_gpt_suite.BUDGET_S:g})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=("sgd", "adam"),
                    help="whose state the simulator counts in memory (default sgd; gpt: adam)")
    ap.add_argument("--optuna", action="store_true",
                    help="also run study_search with the same budget and print it beside MCMC")
    args = ap.parse_args()
    if args.suite == "gpt":
        _gpt_suite.run((args.models or ",".join(_gpt_suite.MODELS)).split(","),
                       (args.topologies or ",".join(_gpt_suite.TOPOLOGIES)).split(","),
                       args.budget or _gpt_suite.BUDGET_S, args.seed, args.optimizer or "adam")
        return
    args.models = args.models or ",".join(MODELS)
    args.topologies = args.topologies or ",".join(TOPOLOGIES)
    args.budget = args.budget or 60.0

    rows, study_rows = [], []
    head = (f"{'model':13s} {'topology':9s} {'dev':>3s} {'batch':>5s} {'DP ms':>9s} {'MP ms':>9s} "
            f"{'OWT ms':>9s} {'pipe ms':>9s} {'found ms':>9s} {'vs DP':>6s} {'DP busy':>9s} {'bound':>6s} "
            f"{'prop/s':>7s} {'search s':>8s}")
    print(head, flush=True)
    for topo_name in args.topologies.split(","):
        topo = get_topology(topo_name)
        n = topo.num_devices
        for name in args.models.split(","):
            graph = paper_graph(name, n)
            found = search(graph, topology=topo, budget_s=args.budget, init=("data_parallel", "owt"),
                           seed=args.seed, optimizer=args.optimizer or "sgd")
            b = found.baselines
            dp = b.get("data_parallel")
            rate = found.proposals / max(found.elapsed_s, 1e-9)
            # data parallel's busiest device computes this long: a plan that does the same work
            # split evenly cannot be faster, so DP ms / busy bounds the speedup over DP
            busy = max(found.baseline_results["data_parallel"].busy_time)  # always scored: the first
            fits = "" if found.result.fits else " (does not fit)"
            overflow = [k for k in EXPERTS if k in found.baseline_results and not found.baseline_results[k].fits]
            fits += f" (baselines that do not fit: {', '.join(overflow)})" if overflow else ""
            fits += f" (not scored in the budget: {', '.join(found.unscored)})" if found.unscored else ""
            row = (f"{name:13s} {topo_name:9s} {n:3d} {graph.batch_size:5d} "
                   + " ".join(fmt(b.get(k)) for k in EXPERTS)
                   + f" {found.predicted_ms:9.1f} {dp / found.predicted_ms if dp else float('nan'):5.2f}x"
                   f" {busy * 1e3:9.1f} {dp / (busy * 1e3):5.2f}x {rate:7.1f} {found.elapsed_s:8.1f}{fits}")
            print(row, flush=True)
            rows.append(row)
            if args.optuna:
                t0 = time.perf_counter()
                st = study_search(graph, topology=topo, budget_s=found.elapsed_s, seed=args.seed,
                                  trial_budget_s=found.elapsed_s / 8)
                wall = time.perf_counter() - t0
                done = [t for t in st.trials if t.value is not None]
                p = st.best_params
                knobs = (f"n={p.get('num_devices')} m={p.get('microbatches')} {p.get('schedule')} "
                         f"init={p.get('init')} beta×{p.get('beta_scale', 1):.2g}")
                study_rows.append(f"{name:13s} {topo_name:9s} {found.elapsed_s:7.1f} {found.predicted_ms:9.1f} "
                                  f"{wall:7.1f} {st.predicted_ms:9.1f} {len(done):6d} "
                                  f"{found.predicted_ms / st.predicted_ms:6.2f}x  {knobs}")
    if study_rows:
        print()
        print(f"{'model':13s} {'topology':9s} {'mcmc s':>7s} {'mcmc ms':>9s} {'study s':>7s} "
              f"{'study ms':>9s} {'trials':>6s} {'gain':>7s}  best trial's knobs")
        for r in study_rows:
            print(r)


if __name__ == "__main__":
    main()
