"""memory_plans.py: GPT-3's shapes on A100 nodes with memory as a searched resource (issue 21,
"Measure"): each expert plan's iteration time, peak memory and whether it fits, and the plan the
search finds from the best of them that fits, with its sharding levels, recompute and
micro-batches searched too.

Models: zoo variants gpt3-1.3b, gpt3-6.7b, gpt3-13b (Brown et al. 2020, Table 2.1), built on
meta with one sequence of 2048 per GPU (Megatron-LM's --micro-batch-size 1), Adam, bf16 mixed
precision (``Strategy.precision``: bf16 compute, fp32 master weights and Adam moments, 16 bytes
per parameter as the ZeRO paper counts them), analytical costs. Baselines:

- data parallel; ``zero1`` (ZeRO-1) and ``fsdp`` (every weighted op at ZeRO-3, FSDP2's
  ``fully_shard`` of every block), both data parallel's cuts;
- Megatron-LM (``strategies.megatron``, sequence parallel) at the best T of 2, 4, 8 (the one
  that fits first, then the fastest), M = T micro-batches so each data-parallel rank's
  micro-batch is one sequence;
- the best pipeline: ``model_parallel``'s balanced stages, GPipe or 1F1B over 2, 4, 8
  micro-batches (fits first, then the fastest).

The search (``soapsearch.search.search``, two chains) starts from the best fitting baseline
with its micro-batches and schedule; it scores its own baselines first, so it is never worse.
Columns: ms and peak GiB per plan, ``*`` = does not fit in the device's 80 GiB; "m" the found
plan's micro-batches; "zero"/"rc" how many of its ops have a sharding level / recompute; the
ratios are the baseline's ms over the found plan's (> 1: found is faster). The issue's goal:
every found plan fits; on 6.7B × 8 A100s found ≥ 1.5× faster than the pipeline baseline and no
slower than fsdp and megatron.

    python benchmarks/memory_plans.py [--models gpt3-6.7b] [--topologies a100-1x8] [--budget 20]
    python benchmarks/memory_plans.py --full   # the issue's table: 3 models x 2 topologies

Default: GPT-3 1.3B and 6.7B on a100-1x8 (a few minutes on two cores); ``--full``: 1.3B, 6.7B
and 13B on a100-1x8 and a100-4x8.
"""

from __future__ import annotations

import argparse
import time

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.result import SimResult
from soapsearch.search import search
from soapsearch.search.api import PIPELINE_MICROBATCHES, Evaluator
from strategies import PlanError, Strategy, baseline
from strategies.megatron import megatron
from _paper import paper_graph  # benchmarks/_paper.py

MODELS = ["gpt3-1.3b", "gpt3-6.7b"]
TOPOLOGIES = ["a100-1x8"]
FULL_MODELS = ["gpt3-1.3b", "gpt3-6.7b", "gpt3-13b"]
FULL_TOPOLOGIES = ["a100-1x8", "a100-4x8"]
PLANS = ["data_parallel", "zero1", "fsdp", "megatron", "pipeline"]
TP = (2, 4, 8)
BUDGET_S = 20.0
"""Search seconds per row."""
PRECISION = "bf16"
OPTIMIZER = "adam"


def _key(item: tuple[Strategy, SimResult]) -> tuple[bool, float]:
    """Fits first, then the fastest."""
    return (not item[1].fits, item[1].iteration_time)


def experts(graph, n: int, evaluate: Evaluator) -> dict[str, tuple[Strategy, SimResult]]:
    """Each baseline of ``PLANS`` (module docstring), simulated."""
    out: dict[str, tuple[Strategy, SimResult]] = {}
    for name in ("data_parallel", "zero1", "fsdp"):
        plan = evaluate.planned(baseline(name, graph, n))
        out[name] = (plan, evaluate(plan, summary=True))
    tried = []
    for t in TP:
        try:
            plan = evaluate.planned(megatron(graph, n, tp=t, microbatches=t, sequence_parallel=True))
        except PlanError:  # T does not divide the heads or the batch
            continue
        tried.append((plan, evaluate(plan, summary=True)))
    pipes = []
    for m in PIPELINE_MICROBATCHES:
        for schedule in ("gpipe", "1f1b"):
            try:
                plan = evaluate.planned(baseline("pipeline", graph, n, m).with_microbatches(m, schedule))
            except PlanError:
                continue
            pipes.append((plan, evaluate(plan, summary=True)))
    for name, found in (("megatron", tried), ("pipeline", pipes)):
        if found:
            out[name] = min(found, key=_key)
    return out


def cell(r: SimResult | None) -> str:
    if r is None:
        return f"{'-':>8s} {'-':>5s}"
    return f"{r.iteration_ms:7.0f}{' ' if r.fits else '*'} {max(r.peak_memory_bytes) / 2**30:5.0f}"


def run(models: list[str], topologies: list[str], budget_s: float, seed: int) -> None:
    print(f"{OPTIMIZER}, {PRECISION}; ms and peak GiB per iteration, * = does not fit; ratios: baseline ms / found ms",
          flush=True)
    head = " ".join(f"{p[:8]:>8s} {'GiB':>5s}" for p in PLANS)
    print(f"{'model':9s} {'topology':8s} {'dev':>3s} {'from':>8s} {head} {'found':>8s} {'GiB':>5s} {'m':>2s} "
          f"{'zero':>4s} {'rc':>4s} {'vs pipe':>7s} {'vs fsdp':>7s} {'vs MP':>7s} {'vs best':>7s} {'s':>5s}",
          flush=True)
    for topo_name in topologies:
        topo = get_topology(topo_name)
        n = topo.num_devices
        for model in models:
            graph = paper_graph("gpt", n, model)
            evaluate = Evaluator(graph, topo, get_cost_model("analytical"), OPTIMIZER, PRECISION)
            t0 = time.perf_counter()
            rows = experts(graph, n, evaluate)
            start_name, (start, best) = min(rows.items(), key=lambda kv: _key(kv[1]))
            found = search(graph, topology=topo, budget_s=budget_s, init=(start,), seed=seed, chains=2,
                           optimizer=OPTIMIZER, precision=PRECISION, microbatches=start.microbatches,
                           schedule=start.schedule if start.microbatches > 1 else "1f1b")
            f = found.result
            plan = found.strategy
            zero = sum(1 for _, c in plan.items() if c.zero)
            rc = sum(1 for _, c in plan.items() if c.recompute)

            def ratio(name: str) -> str:
                r = rows.get(name, (None, None))[1]
                return f"{r.iteration_ms / f.iteration_ms:6.2f}x" if r is not None else f"{'-':>7s}"

            print(f"{model:9s} {topo_name:8s} {n:3d} {start_name[:8]:>8s} "
                  + " ".join(cell(rows.get(p, (None, None))[1]) for p in PLANS)
                  + f" {cell(f)} {plan.microbatches:2d} {zero:4d} {rc:4d} {ratio('pipeline')} {ratio('fsdp')}"
                  f" {ratio('megatron')} {best.iteration_ms / f.iteration_ms:6.2f}x {time.perf_counter() - t0:5.0f}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help=f"default: {','.join(MODELS)} (--full: {','.join(FULL_MODELS)})")
    ap.add_argument("--topologies", help=f"default: {','.join(TOPOLOGIES)} (--full: {','.join(FULL_TOPOLOGIES)})")
    ap.add_argument("--full", action="store_true", help="the issue's table: every model on every topology")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"search seconds per row (default {BUDGET_S:g})")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    models = args.models.split(",") if args.models else FULL_MODELS if args.full else MODELS
    topologies = args.topologies.split(",") if args.topologies else FULL_TOPOLOGIES if args.full else TOPOLOGIES
    run(models, topologies, args.budget, args.seed)


if __name__ == "__main__":
    main()
