"""``delta_time.py --one-op N``: where a one-op proposal's time goes (issue 22, item 6).

For each model and each of two start plans (data parallel; a random plan, every op a drawn
candidate config of the search's, ``soapsearch.search.moves.candidate_configs``), a fixed
sequence of N one-op proposals: a drawn op with a choice gets a drawn candidate config, its
sharding level and recompute flag kept. The start plan is evaluated once before the sequences
(as MCMC's current plan is: its proposals patch its device-use counts). One ``Evaluator``
scores the start plan and then each proposal after it (a chain after rejections: each proposal
differs from the graph simulated before it in two ops at most). The sequence runs three times
through fresh Evaluators: once checking each proposal's iteration time and peak memory against
a from-scratch simulation (the first ``CHECKED``), once timed plainly (ms per proposal,
proposals/s), once under cProfile (ms per proposal by phase: the cumulative time of the
functions ``PHASES`` names, divided by N; cProfile's own overhead inflates them against the
plain pass), then the functions that spend the most in themselves.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import random
import time

from _paper import paper_graph  # benchmarks/_paper.py
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import paused_gc, simulate_plan
from soapsearch.search.api import Evaluator
from soapsearch.search.moves import candidate_configs
from strategies.baselines import BASELINES
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.strategy import Strategy

PHASES = (
    ("lower", "strategies/lowering.py", "lower"),
    ("tasks", "simulator/simulate.py", "task_graph"),
    ("  blocks", "simulator/tasks.py", "_blocks"),
    ("  join", "simulator/taskcache.py", "join"),
    ("  collectives", "simulator/collectives.py", "add_collectives"),
    ("  gathers", "simulator/zero3.py", "add_gathers"),
    ("  schedule", "simulator/step_order.py", "link_schedule"),
    ("  buckets", "strategies/overlap.py", "bucket_plan"),
    ("  step end", "simulator/step.py", "link_step"),
    ("  bucket ready", "simulator/step_order.py", "bucket_ready"),
    ("events", "simulator/simulate.py", "run_timeline"),
    ("memory", "simulator/memory.py", "peak_memory"),
    ("summary", "simulator/result.py", "summarize"),
    ("total", "soapsearch/search/api.py", "__call__"),
)
"""(row, file, function): a phase is the cumulative time of the function (indented: inside the
row above it)."""

CHECKED = 40
"""Proposals checked against a from-scratch simulation (a random plan's takes seconds)."""


def start_plans(graph, n: int, candidates: dict, seed: int) -> dict[str, Strategy]:
    """Data parallel, and the first random plan of the candidates (seeds from ``seed``) that lowers."""
    rng = random.Random(seed)
    for _ in range(100):
        plan = Strategy.of({node.name: rng.choice(candidates[node.name]) for node in graph}, n)
        try:
            lower(graph, plan)
        except PlanError:
            continue
        return {"data_parallel": BASELINES["data_parallel"](graph, n), "random": plan}
    raise SystemExit("no random plan of 100 lowers")


def proposals(graph, plan: Strategy, candidates: dict, count: int, seed: int) -> list[Strategy]:
    """``count`` one-op proposals from ``plan`` (see the module docstring), each one that lowers."""
    rng = random.Random(seed)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    out = []
    while len(out) < count:
        op = rng.choice(ops)
        cfg = rng.choice(candidates[op]).with_memory(zero=plan[op].zero, recompute=plan[op].recompute)
        if cfg == plan[op]:
            continue
        proposal = plan.replace(op, cfg)
        try:
            lower(graph, proposal)
        except PlanError:
            continue
        out.append(proposal)
    return out


def _walk(graph, topo, cost, plan: Strategy, walk: list[Strategy], check: int = 0) -> float:
    """The seconds ``walk`` takes through one fresh Evaluator after ``plan`` (see the module
    docstring); the first ``check`` proposals compared with a full simulation."""
    evaluate = Evaluator(graph, topo, cost)
    evaluate(plan)
    spent = 0.0
    for i, proposal in enumerate(walk):
        evaluate(plan)  # the chain's current plan: a plan seen, no simulation
        t0 = time.perf_counter()
        got = evaluate(proposal)
        spent += time.perf_counter() - t0
        if i < check:
            full = simulate_plan(graph, proposal, topo, cost, summary=False)
            if (got.iteration_time, got.peak_memory_bytes) != (full.iteration_time, full.peak_memory_bytes):
                raise SystemExit(f"proposal {i}: delta {got.iteration_time} != full {full.iteration_time}")
    return spent


def one_op(args) -> None:
    topo, cost = get_topology(args.topology), get_cost_model("analytical")
    n, count = args.devices, args.one_op
    for name in args.models.split(","):
        graph = paper_graph(name, n)
        candidates = candidate_configs(graph, n, 1, topo.node_size)
        for start, plan in start_plans(graph, n, candidates, args.seed).items():
            # the start plan evaluated first, as MCMC's current plan: its proposals patch its device-use counts
            Evaluator(graph, topo, cost)(plan)
            walk = proposals(graph, plan, candidates, count, args.seed)
            gc.collect()
            with paused_gc():  # as the search's chains
                _walk(graph, topo, cost, plan, walk, min(count, CHECKED))
                plain = _walk(graph, topo, cost, plan, walk)
                profile = cProfile.Profile()
                profile.enable()
                _walk(graph, topo, cost, plan, walk)
                profile.disable()
            stats = pstats.Stats(profile)
            print(f"\n{name} x {n} on {topo.name}, start {start}, {count} one-op proposals: "
                  f"{1e3 * plain / count:.2f} ms each, {count / plain:.1f} proposals/s (no profiler)")
            print(f"{'phase (cProfile)':20s} {'ms/proposal':>12s}")
            for row, path, fn in PHASES:
                cum = sum(v[3] for k, v in stats.stats.items() if k[0].endswith(path) and k[2] == fn)
                if cum or not row.startswith(" "):
                    print(f"{row:20s} {1e3 * cum / count:12.3f}")
            print(f"{'own ms/proposal':>15s} {'calls/proposal':>15s}  function")
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
            for (path, line, fn), (_, calls, own, _, _) in rows:
                where = "/".join(path.split("/")[-2:])
                print(f"{1e3 * own / count:15.3f} {calls / count:15.1f}  {where}:{line}({fn})")
