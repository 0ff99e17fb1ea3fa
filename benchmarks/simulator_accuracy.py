"""Simulator accuracy on the machine it runs on: predicted vs measured iteration time of many plans.

    python benchmarks/simulator_accuracy.py --nproc 2 [--nproc 4] [--models mlp,gpt,rnntc]
        [--variant small|tiny] [--topology calibrated.json] [--cost-model analytical|profiled]
        [--steps 7] [--repeat] [--out DIR]
    python benchmarks/simulator_accuracy.py --repredict DIR [--send LATENCY,BANDWIDTH]

Calibrates ``calibrated-cpu-N`` (unless --topology), then per model (its ``--variant``) writes
data parallel, model parallel, OWT, GPipe and 1F1B pipelines (2 micro-batches), a parameter
split (every linear cut on out_features) and a plan searched with 200 proposals on the
calibrated topology; runs each for real (median of --steps after 2 warm-up steps; a model's
plans take turns step by step) and simulates it. The calibration fits the executor's overheads
beyond the same cost model's kernel times. ``--cost-model profiled`` first times every
fixed plan's partitions of the model about to run into ``calN.profile.json`` with the threads
one rank has, in interleaved rounds (``calibrate.warm_profile``), right before its plans run
(a shared host's speed drifts from one minute to the next); the searched plan's other
partitions are timed when first simulated, at that thread count.
``--repeat`` runs each model's plans a second time, in a new launch right after the first, and
scores that second measurement as if it were a prediction of the first: the agreement of this
host with itself seconds later, the floor under the simulator's figures (a perfect model
of the first launch scores no better against the second).
Prints a table, the median and max |relative error| and Spearman's rank correlation. With
--out the topologies, their fit reports, the profiles, the plans and ``results.json`` (every
row) stay in DIR; ``--repredict DIR [--send LATENCY,BANDWIDTH]`` runs nothing and predicts
such a run's plans again with the current code against its measurements (``repredict``).
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.cost import get_cost_model  # noqa: E402
from simulator.simulate import simulate_plan  # noqa: E402
from simulator.topology import Topology  # noqa: E402
from soapsearch.calibrate import calibrate, run_plans, spearman  # noqa: E402
from simulator.devices import OVERHEAD_FIELDS  # noqa: E402
from soapsearch.calibrate._spawn import rank_threads, threads_per_process  # noqa: E402
from soapsearch.calibrate.measure import Calibration, fit_executor_overheads, warm_profile  # noqa: E402
from soapsearch.executor import build_model  # noqa: E402
from strategies import Strategy, baseline, load_strategy, save_strategy  # noqa: E402
from strategies.baselines import param_split  # noqa: E402
from strategies.lowering import lower  # noqa: E402


def plan_makers(graph, n: int) -> dict[str, Callable[[], Strategy]]:
    """The fixed plans of the table, each made when called (a model may not take one)."""
    return {
        "data_parallel": lambda: baseline("data_parallel", graph, n),
        "model_parallel": lambda: baseline("model_parallel", graph, n),
        "owt": lambda: baseline("owt", graph, n),
        "pipeline_gpipe_m2": lambda: baseline("pipeline", graph, n, microbatches=2),
        "pipeline_1f1b_m2": lambda: baseline("pipeline", graph, n, microbatches=2).with_microbatches(2, "1f1b"),
        "param_split": lambda: param_split(graph, n),
    }


def plans_for(graph, n: int, topo: Topology, cost) -> dict[str, Strategy]:
    from soapsearch.search import search

    makers = {**plan_makers(graph, n),
              "searched": lambda: search(graph, topology=topo, budget_s=None, proposals=200, cost_model=cost,
                                         init=("data_parallel", "owt"), seed=0).strategy}
    out = {}
    for name, make in makers.items():
        try:
            out[name] = make()
        except Exception as e:  # noqa: BLE001 - a plan this model cannot take is reported, not fatal
            print(f"  skip {name}: {type(e).__name__}: {e}")
    return out


def bench(n: int, models: list[str], variant: str, topo: Topology, cost_name: str, steps: int,
          d: Path, repeat: bool = False) -> list[tuple]:
    """Each model in turn: (profiled: its fixed plans' partitions timed, in rounds, with one
    process's threads, right before its plans run, so the two see the host in one state) its
    plans written, run for real (``repeat``: again, in a second launch right after) and
    simulated."""
    cache = d / f"cal{n}.profile.json"
    rows = []
    for model in models:
        graph = build_model(model, variant, seed=0).graph
        if cost_name == "profiled":
            fixed = []
            for make in plan_makers(graph, n).values():
                try:
                    fixed.append(make())
                except Exception:  # noqa: BLE001 - a plan this model cannot take (reported below)
                    pass
            print(f"  {model}: {warm_profile(model, topo, cache, variant, plans=fixed)} partitions profiled")
        cost = get_cost_model(cost_name, **({"cache_path": str(cache)} if cost_name == "profiled" else {}))
        plans = plans_for(graph, n, topo, cost)
        paths = []
        for name, plan in plans.items():
            paths.append(d / f"{model}-{n}-{name}.json")
            save_strategy(paths[-1], plan, graph, topology=topo.name)
        measured = run_plans(paths, model, n, variant=variant, steps=steps, warmup=2)
        again = ([m.iteration_ms for m in run_plans(paths, model, n, variant=variant, steps=steps, warmup=2)]
                 if repeat else [None] * len(measured))
        for (name, plan), m, a in zip(plans.items(), measured, again):
            rows.append(_row(n, model, name, graph, plan, topo, cost, m.iteration_ms, max(m.busy_ms),
                             max(m.wait_ms), a))
    return rows


def _row(n: int, model: str, name: str, graph, plan: Strategy, topo: Topology, cost, measured_ms: float,
         measured_busy_ms: float, measured_wait_ms: float, measured_again_ms: float | None) -> tuple:
    """One table row: the plan simulated on ``topo`` beside its measured figures (``KEYS``)."""
    low = lower(graph, plan)
    sim = simulate_plan(graph, low, topo, cost)
    tasks = max(sum(1 for per_mb in low.partitions.values() for ps in per_mb for p in ps if p.device == r)
                for r in range(n))
    remote = sum(1 for t in low.transfers if not t.local)
    return (n, model, name, sim.iteration_ms, measured_ms, max(sim.busy_time) * 1e3, measured_busy_ms,
            measured_wait_ms, tasks, remote, measured_again_ms)


KEYS = ("nproc", "model", "plan", "predicted_ms", "measured_ms", "predicted_busy_ms", "measured_busy_ms",
        "measured_wait_ms", "tasks_per_device", "remote_transfers", "measured_again_ms")
"""A row's fields, as results.json names them (``measured_again_ms``: --repeat's second launch, else null)."""


def repredict(d: Path, variant: str, send: tuple[float, float] | None = None) -> list[tuple]:
    """The rows of a run kept with --out DIR, predicted again by this code: each N's calibration
    report read back, its executor overheads refitted on the run's own probe times under the
    current simulator (``fit_executor_overheads``), every plan of the run simulated again (with
    a copy of the run's profile cache when it was profiled: the kept run is not written). The
    measured figures are the run's: a model change is judged on the same measurements, free of
    run-to-run noise. ``send``: hold each sender for its sends, at (latency s, bandwidth B/s)
    where the report has no measured figures (``Calibration.hold_sends``)."""
    stored = json.loads((d / "results.json").read_text())
    variant = stored[0].get("variant", variant) if stored else variant
    graphs: dict[str, object] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="repredict-") as tmp:
        for n in sorted({r["nproc"] for r in stored}):
            report = d / f"cal{n}.report.json"
            cal = Calibration.from_json(json.loads(report.read_text()), str(report))
            if send is not None and n > 1:  # sends held: the measured figures, else these
                if cal.send_bandwidth is None:
                    cal.send_latency, cal.send_bandwidth = send
                cal.hold_sends = True
            cache = Path(tmp) / f"cal{n}.profile.json"
            if (d / cache.name).exists():
                shutil.copyfile(d / cache.name, cache)
            cost = get_cost_model(cal.cost_model, **({"cache_path": str(cache)} if cal.cost_model == "profiled" else {}))
            if cal.overheads:  # else the run was calibrated without overhead rounds: its overheads stand
                fit_executor_overheads(cal, cal.overheads, cost)
            topo = cal.topology()
            print(f"N={n}: refitted overheads " + ", ".join(f"{f} {getattr(cal, f) * 1e6:.0f} µs" for f in OVERHEAD_FIELDS))
            with rank_threads(n):  # a partition the run's profile lacks is timed as a rank
                for r in (r for r in stored if r["nproc"] == n):
                    if r["model"] not in graphs:
                        graphs[r["model"]] = build_model(r["model"], variant, seed=0).graph
                    graph = graphs[r["model"]]
                    plan = load_strategy(d / f"{r['model']}-{n}-{r['plan']}.json", graph)
                    rows.append(_row(n, r["model"], r["plan"], graph, plan, topo, cost, r["measured_ms"],
                                     r["measured_busy_ms"], r["measured_wait_ms"], r.get("measured_again_ms")))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, action="append", help="process counts (default 2)")
    p.add_argument("--models", default="mlp,gpt,rnntc")
    p.add_argument("--variant", default="small", choices=("small", "tiny"),
                   help="zoo variant of the models (small: steps long enough that compute, rather than the "
                        "host's jitter per sync, dominates)")
    p.add_argument("--topology", default=None, help="a calibrated topology JSON (one --nproc only)")
    p.add_argument("--cost-model", choices=("analytical", "profiled"), default="analytical")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--repeat", action="store_true",
                   help="run each model's plans again in a second launch and score that against the first "
                        "(the machine's agreement with itself: the floor under the simulator's errors)")
    p.add_argument("--out", default=None, help="keep topologies, reports, plans and results.json here")
    p.add_argument("--repredict", default=None, metavar="DIR",
                   help="run nothing: predict the plans of a run kept with --out DIR again with this code, "
                        "against that run's measurements (overheads refitted on its probe times)")
    p.add_argument("--send", default=None, metavar="LATENCY,BANDWIDTH",
                   help="with --repredict: hold each sender for its sends (Calibration.hold_sends), at the "
                        "report's measured figures or, for a report that has none, these (seconds, bytes/s)")
    args = p.parse_args()
    rows = []
    if args.repredict:
        send = None
        if args.send:
            try:
                lat, bw = (float(x) for x in args.send.split(","))
            except ValueError:
                p.error(f"--send {args.send!r}: give LATENCY,BANDWIDTH in seconds and bytes/s, e.g. 1e-4,2e9")
            if not (lat >= 0 and bw > 0):
                p.error(f"--send {args.send!r}: latency must be >= 0 and bandwidth > 0")
            send = (lat, bw)
        rows = repredict(Path(args.repredict), args.variant, send)
        print_table(rows)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.out or tmp)
        d.mkdir(parents=True, exist_ok=True)
        for n in args.nproc or [2]:
            topo = (Topology.load(args.topology) if args.topology  # overheads fitted beyond the same cost model
                    else calibrate(n, out=d / f"cal{n}.json", cost_model=args.cost_model))
            dev, link = topo.devices[0], topo.links[0] if topo.links else None
            print(f"topology {topo.name}: kind {dev.kind}, {dev.peak_flops['float32'] / 1e9:.1f} GFLOP/s, "
                  f"{dev.memory_bandwidth / 1e9:.1f} GB/s"
                  + (f", link {link.latency * 1e6:.0f} µs + 1/{link.bandwidth / 1e9:.2f} GB/s, "
                     f"in a ring 1/{link.ring_bandwidth / 1e9:.2f} GB/s" if link else "")
                  + f", {dev.contention:.2f}x slower all at once"
                  + f"; executor overheads {dev.task_overhead * 1e6:.0f} µs/task, "
                    f"{dev.message_overhead * 1e6:.0f} µs/received piece, "
                    f"{dev.exchange_overhead * 1e6:.0f} µs/exchanged piece, "
                    f"{dev.collective_overhead * 1e6:.0f} µs/collective")
            torch.set_num_threads(threads_per_process(n))  # a profiled partition is timed as a rank runs it
            rows += bench(n, args.models.split(","), args.variant, topo, args.cost_model, args.steps, d,
                          args.repeat)
    if args.out:
        (d / "results.json").write_text(json.dumps([{**dict(zip(KEYS, r)), "variant": args.variant} for r in rows],
                                                   indent=1) + "\n")
    print_table(rows)
    return 0


def _score(pred: list[float], meas: list[float]) -> tuple[float, float, float]:
    """Median and max |pred - meas| / meas, and Spearman's rank correlation of the two."""
    errs = [abs(p - m) / m for p, m in zip(pred, meas)]
    return statistics.median(errs), max(errs), spearman(pred, meas)


def print_table(rows: list[tuple]) -> None:
    """The table, the median and max |error|, Spearman's rank correlation overall and per N;
    with a second measurement (--repeat), the same three for it scored against the first."""
    again = all(r[10] is not None for r in rows)
    head = ("N", "model", "plan", "pred ms", "meas ms", "error", *(("again ms", "again Δ") if again else ()),
            "pred busy", "meas busy", "meas wait", "tasks/dev", "remote xfers")
    print("\n" + " | ".join(head))
    print(" | ".join("---" for _ in head))
    for n, model, name, pred, meas, pb, mb, mw, tasks, remote, meas2 in rows:
        print(f"{n} | {model} | {name} | {pred:.2f} | {meas:.2f} | {(pred - meas) / meas:+.1%} | "
              + (f"{meas2:.2f} | {(meas2 - meas) / meas:+.1%} | " if again else "")
              + f"{pb:.2f} | {mb:.2f} | {mw:.2f} | {tasks} | {remote}")
    med, mx, rho = _score([r[3] for r in rows], [r[4] for r in rows])
    print(f"\n{len(rows)} plans: median |error| {med:.1%}, max |error| {mx:.1%}, "
          f"Spearman rank correlation (predicted vs measured ms) {rho:.3f}")
    if again:
        med, mx, rho = _score([r[10] for r in rows], [r[4] for r in rows])
        print(f"  the second launch as the prediction (the host against itself): median {med:.1%}, max {mx:.1%}, "
              f"Spearman {rho:.3f}")
    for n in sorted({r[0] for r in rows}):
        sub = [r for r in rows if r[0] == n]
        per_task = statistics.median((r[6] - r[5]) / r[8] * 1e3 for r in sub)
        med, mx, rho = _score([r[3] for r in sub], [r[4] for r in sub])
        print(f"  N={n}: median |error| {med:.1%}, max {mx:.1%}, Spearman {rho:.3f}; "
              f"median unmodelled busy per task (meas - pred busy) / tasks = {per_task:.0f} µs")
        if again:
            med, mx, rho = _score([r[10] for r in sub], [r[4] for r in sub])
            print(f"    second launch: median {med:.1%}, max {mx:.1%}, Spearman {rho:.3f}")


if __name__ == "__main__":
    sys.exit(main())
