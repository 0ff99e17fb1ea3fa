"""Delta vs full simulation per MCMC proposal: each model at paper scale (64 samples per device)
on the 16 devices of p100-4x4, analytical costs. From data parallel, draws random one-op
proposals (as the search does) and times, per proposal, (a) a full simulation from scratch and
(b) the search's Evaluator, which re-derives only the changed op's and its consumers' lowering
and task blocks (delta: the chain's current plan is evaluated before each proposal, as after an
accepted one; chain: each proposal right after the last, as MCMC after a rejected one, whose
ops go back to the current plan's). Checks all give the same iteration time and prints the
medians, by phase, and the ratio to full. The proposals are drawn from the start plan once it
is evaluated, as MCMC draws them from its current plan (``Strategy.replace`` then patches the
plan's device-use counts instead of counting them again). Asserts nothing but that equality. ``--plan fsdp``
starts from the fsdp plan (ZeRO-3 on every weighted op; proposals keep each op's level).
``--search S``: instead, one ``search()`` of S seconds per model from its defaults, printing its
proposals per second of the whole wall time (baselines scored included), the issue's measure.
``--walk N``: the same with a walk of N proposals and no time budget instead (a chain still stops
after half of them without a better plan): the same walk for a seed whatever the speed, so two
versions of the code compare on equal work (a time budget's walks differ in length and mix).
``--moves``: instead, the moves a chain makes between counts and sharding levels (data parallel
and fsdp at 1, 2 and 4 micro-batches, in ``MOVES``' order, coming back to counts and plans seen
before) through one Evaluator, each timed and checked against a full simulation.
``--one-op N``: instead, a fixed sequence of N one-op proposals (a drawn candidate config of a
drawn op, each level kept) from each of two start plans, data parallel and a random plan of
the search's candidate configs, through one Evaluator as a chain after rejections evaluates
them (the start plan, then each proposal); timed once plainly (proposals/s) and once under
cProfile (ms per proposal by phase, and the functions that spend most), each proposal's
iteration time checked against a full simulation first.

    python benchmarks/delta_time.py [--models resnet101,inception_v3] [--proposals 30] [--recompute 0.5]
                                    [--fold] [--plan data_parallel|fsdp] [--search 60 | --walk 1500 [--phases]]
                                    [--moves] [--one-op 200 [--top 25]]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import statistics
import time

from simulator.cost import get_cost_model
from simulator.memory import peak_memory
from simulator.presets import get_topology
from simulator.simulate import paused_gc, simulate_plan, timed_graph
from simulator.tasks import TaskCache, build_tasks
from soapsearch.search.mcmc import candidate_configs
from _paper import paper_graph  # benchmarks/_paper.py
from _phases import phase_clock, print_phases  # benchmarks/_phases.py
from strategies.baselines import BASELINES
from strategies.lowering import lower

PHASES = ("lower", "tasks", "events", "memory", "total")
MOVES = (("data_parallel", 1), ("data_parallel", 2), ("fsdp", 2), ("data_parallel", 1), ("fsdp", 1),
         ("data_parallel", 4), ("fsdp", 4), ("data_parallel", 2), ("fsdp", 2), ("data_parallel", 4))
"""``--moves``: (baseline, micro-batches) in turn."""


def _timed(graph, plan, topo, cost, lowering_cache, task_cache, fold: bool = False) -> tuple[float, list[float]]:
    """One simulation as ``simulate_plan`` runs it (``fold``: a replicated plan on one copy,
    ``simulator.fold``; ``simulate_plan`` folds from ``FOLD_FROM`` devices), timed by phase."""
    t0 = time.perf_counter()
    low = lower(graph, plan, lowering_cache)
    t1 = time.perf_counter()
    phases: dict[str, float] = {}
    _, _, _, end = timed_graph(low, topo, cost, "sgd", task_cache, fold, phases)  # as simulate_plan
    t3 = time.perf_counter()
    peak_memory(low)
    t4 = time.perf_counter()
    return float(end.max()), [t1 - t0, phases["tasks"], phases["events"], t4 - t3, t4 - t0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="resnet101,inception_v3")
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--topology", default="p100-4x4")
    ap.add_argument("--proposals", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recompute", type=float, default=0.0,
                    help="fraction of the ops with a backward set to recompute in the start plan "
                         "(kept by the proposals): the memory timeline's walk runs")
    ap.add_argument("--fold", action="store_true",
                    help="fold replicated plans on one copy (simulator.fold) below FOLD_FROM devices too")
    ap.add_argument("--plan", default="data_parallel", choices=("data_parallel", "fsdp"),
                    help="the start plan of the proposals")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--search", type=float, default=None,
                        help="seconds: run one search per model and print proposals per second of its wall time")
    budget.add_argument("--walk", type=int, default=None, metavar="N",
                        help="run one search per model of N proposals, no time budget (the same walk for a seed "
                             "whatever the speed: two versions compared on equal work), proposals per second of "
                             "its wall")
    ap.add_argument("--phases", action="store_true",
                    help="with --search or --walk: each evaluated plan's time by phase and kind of proposal "
                         "(_phases.py)")
    ap.add_argument("--moves", action="store_true", help="time MOVES through one Evaluator instead")
    ap.add_argument("--one-op", type=int, default=None, metavar="N",
                    help="time N fixed one-op proposals through one Evaluator, by phase under cProfile")
    ap.add_argument("--top", type=int, default=25, help="with --one-op: functions listed by own time")
    args = ap.parse_args()
    if args.one_op is not None:
        from _one_op import one_op  # benchmarks/_one_op.py
        return one_op(args)
    if args.search is not None or args.walk is not None:
        return _search(args)
    if args.moves:
        return _moves(args)
    fold = args.fold
    topo = get_topology(args.topology)
    cost = get_cost_model("analytical")
    print(f"{'model':14s} {'tasks':>6s} {'mode':6s} " + " ".join(f"{p + ' ms':>10s}" for p in PHASES)
          + f" {'proposals/s':>12s} {'full/mode':>10s}")
    for name in args.models.split(","):
        graph = paper_graph(name, args.devices)
        plan = BASELINES[args.plan](graph, args.devices)
        candidates = candidate_configs(graph, args.devices, 1, topo.node_size)
        ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
        rng = random.Random(args.seed)
        redo = [n.name for n in graph if graph.needs_grad[n.name] and n.kind not in ("input", "parameter", "constant")]
        for op in rng.sample(redo, int(args.recompute * len(redo))):
            plan = plan.replace(op, plan[op].with_memory(recompute=True))
        lowering_cache: dict = {}
        task_cache = TaskCache(topo, cost)
        chain_lowering: dict = {}
        chain_tasks = TaskCache(topo, cost)
        gc.collect()
        with paused_gc():  # as simulate_plan and the search's chains do
            _timed(graph, plan, topo, cost, None, None, fold)  # fills the cost model's memo
            _timed(graph, plan, topo, cost, chain_lowering, chain_tasks, fold)  # the chain's start
            proposals = []  # from the evaluated plan, as MCMC: each patches its device-use counts
            while len(proposals) < args.proposals:
                op = rng.choice(ops)
                cfg = rng.choice(candidates[op]).with_memory(zero=plan[op].zero, recompute=plan[op].recompute)
                if cfg != plan[op]:
                    proposals.append(plan.replace(op, cfg))
            rows: dict[str, list[list[float]]] = {"full": [], "delta": [], "chain": []}
            for proposal in proposals:
                full_ms, full_t = _timed(graph, proposal, topo, cost, None, None, fold)
                _timed(graph, plan, topo, cost, lowering_cache, task_cache, fold)  # the chain's current plan
                delta_ms, delta_t = _timed(graph, proposal, topo, cost, lowering_cache, task_cache, fold)
                chain_ms, chain_t = _timed(graph, proposal, topo, cost, chain_lowering, chain_tasks, fold)
                if not full_ms == delta_ms == chain_ms:
                    raise SystemExit(f"{name}: delta {delta_ms}, chain {chain_ms} != full {full_ms} s")
                rows["full"].append(full_t)
                rows["delta"].append(delta_t)
                rows["chain"].append(chain_t)
        tasks = len(build_tasks(lower(graph, plan), topo, cost))
        med = {mode: [statistics.median(r[i] for r in rs) * 1e3 for i in range(len(PHASES))]
               for mode, rs in rows.items()}
        for mode in rows:
            ratio = f"{med['full'][-1] / med[mode][-1]:10.1f}" if mode != "full" else f"{'':10s}"
            print(f"{name:14s} {tasks:6d} {mode:6s} " + " ".join(f"{x:10.1f}" for x in med[mode])
                  + f" {1e3 / med[mode][-1]:12.1f} {ratio}")


def _moves(args) -> None:
    """``MOVES`` through one Evaluator per model: ms of each, and what it came back to (a count
    not seen, a count seen under other sharding levels, a plan seen)."""
    from soapsearch.search.api import Evaluator  # the search only here
    topo, cost = get_topology(args.topology), get_cost_model("analytical")
    print(f"{'model':14s} {'plan':14s} {'m':>2s} {'seen':>12s} {'ms':>9s}")
    for name in args.models.split(","):
        graph = paper_graph(name, args.devices)
        evaluate = Evaluator(graph, topo, cost)
        plans, seen, total = {}, set(), 0.0
        for base, m in MOVES:
            if base not in plans:
                plans[base] = BASELINES[base](graph, args.devices)
            plan = plans[base].with_microbatches(m)
            what = "plan" if (base, m) in seen else "count" if any(k == m for _, k in seen) else "-"
            seen.add((base, m))
            t0 = time.perf_counter()
            got = evaluate(plan)
            ms = 1e3 * (time.perf_counter() - t0)
            total += ms
            full = simulate_plan(graph, plan, topo, cost, summary=False)
            if got.iteration_time != full.iteration_time or got.peak_memory_bytes != full.peak_memory_bytes:
                raise SystemExit(f"{name} {base} m={m}: delta {got.iteration_time} != full {full.iteration_time}")
            print(f"{name:14s} {base:14s} {m:2d} {what:>12s} {ms:9.1f}")
        print(f"{name:14s} {'total':14s} {'':2s} {'':>12s} {total:9.1f}")


def _search(args) -> None:
    """One search per model (``search()``'s defaults, ``args.search`` seconds or a walk of
    ``args.walk`` proposals, one worker per chain): proposals over the whole wall time,
    baselines included, and the scored ones (the others made no plan: ``SearchResult.scored``)."""
    from soapsearch.search.api import search  # the search only here: the rest times the simulator
    topo = get_topology(args.topology)
    budget = dict(budget_s=args.search) if args.walk is None else dict(budget_s=None, proposals=args.walk)
    shown = f"{args.search:.0f} s" if args.walk is None else f"{args.walk} walk"
    print(f"{'model':14s} {'budget':>10s} {'wall s':>8s} {'proposals':>10s} {'proposals/s':>12s} {'scored':>7s} "
          f"{'scored/s':>9s} {'found ms':>9s}")
    for name in args.models.split(","):
        graph = paper_graph(name, args.devices)
        with phase_clock() if args.phases else contextlib.nullcontext() as rows:
            t0 = time.perf_counter()
            found = search(graph, topology=topo, seed=args.seed, num_devices=args.devices,
                           workers=1 if args.phases else None, **budget)
            wall = time.perf_counter() - t0
        print(f"{name:14s} {shown:>10s} {wall:8.1f} {found.proposals:10d} {found.proposals / wall:12.1f} "
              f"{found.scored:7d} {found.scored / wall:9.1f} {found.predicted_ms:9.2f}")
        if rows is not None:
            print_phases(rows, wall)


if __name__ == "__main__":
    main()
