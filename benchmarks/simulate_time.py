"""Full-simulation time per plan: each zoo model at paper scale, data parallel on 16 devices of
p100-4x4, analytical costs. Prints the median over repeats of each phase (lowering, task graph,
event loop, memory) with task counts, and the whole as a ratio to the event loop alone (the
floor a task-by-task simulation cannot beat). Asserts nothing.

    python benchmarks/simulate_time.py [--models resnet101,inception_v3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from simulator.cost import get_cost_model
from simulator.engine import run_events
from simulator.memory import peak_memory
from simulator.presets import get_topology
from simulator.result import summarize
from simulator.tasks import build_tasks
from _paper import paper_graph  # benchmarks/_paper.py
from strategies import data_parallel
from strategies.lowering import lower

ZOO = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--topology", default="p100-4x4")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    topo = get_topology(args.topology)
    cost = get_cost_model("analytical")
    print(f"{'model':14s} {'batch':>5s} {'tasks':>6s} {'lower ms':>9s} {'tasks ms':>9s} "
          f"{'events ms':>9s} {'memory ms':>9s} {'total ms':>9s} {'total/events':>12s} {'iter ms':>9s}")
    for name in args.models.split(","):
        graph = paper_graph(name, args.devices)
        plan = data_parallel(graph, args.devices)
        phases = {"lower": [], "tasks": [], "events": [], "memory": [], "total": []}
        gc.collect()
        gc.disable()  # as simulate_plan does
        for _ in range(args.repeats + 1):  # the first run fills the cost model's memo
            t0 = time.perf_counter()
            lowered = lower(graph, plan)
            t1 = time.perf_counter()
            tg = build_tasks(lowered, topo, cost)
            t2 = time.perf_counter()
            start, end = run_events(tg)
            t3 = time.perf_counter()
            peak = peak_memory(lowered)
            result = summarize(tg, topo, start, end, peak, keep_timeline=False)
            t4 = time.perf_counter()
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                phases[k].append(v)
        gc.enable()
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in phases.items()}
        print(f"{name:14s} {graph.batch_size:5d} {len(tg):6d} {med['lower']:9.1f} {med['tasks']:9.1f} "
              f"{med['events']:9.1f} {med['memory']:9.1f} {med['total']:9.1f} "
              f"{med['total'] / med['events']:12.1f} {result.iteration_ms:9.1f}")


if __name__ == "__main__":
    main()
