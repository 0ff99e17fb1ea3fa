"""scale.py: how one full simulation's cost grows with the device count (issue 22, "Measure").

Rows: GPT-124M (zoo ``gpt`` default, batch 12 per device) and GPT-3 175B's shape (zoo
``gpt3-175b``, Brown et al. 2020 Table 2.1, built on meta, one sequence per device), each under
data parallel and the Megatron-LM baseline (175B: the plan Megatron-LM ran it with,
``strategies.baselines.megatron_lm``: T=8 tensor parallel, P=16 pipeline stages, one sequence a
micro-batch (m = 128 at 1,024 devices), 1F1B, sequence parallel, every layer recomputed, the
distributed optimizer (ZeRO-1), bf16; GPT-124M, 12 heads and 12 layers: ``strategies.megatron``
at T=4, P=4, 8 micro-batches, 1F1B, sequence parallel, every block recomputed, bf16), on
``a100-<N>x8`` at 8,
64, 512 and 1,024 devices (megatron where T x P divides them). ``--plans`` may also name
``fsdp`` (``strategies.baselines.fsdp``: data parallel, every weighted op at ZeRO-3, a layer a
prefetch unit) and ``megatron-zero3`` (the megatron plan with its layers' linears at ZeRO-3):
weights sharded per use, folded on copies and members as the others. Each row runs in its own process (its peak RSS is the row's own) and prints the
milliseconds of each phase of one full simulation as ``simulator.simulate_plan`` runs them
(lower: the copies found and copy 0 lowered, ``simulate.Lowerings``; task graph, with any
lowering again for fewer copies; event loop; memory) and its process time (cpu ms: less
sensitive than the wall to other jobs on the cores), the copies a replicated plan is folded on
(``simulator.fold``; ``--per-device``: none, every device simulated), the task count, and the
process's peak RSS, and the tensor-parallel member classes found (``strategies.member_symmetry``,
outside the timed phases: ``8:1+7`` is 8 members, member 0 a class of its own, members 1-7 one;
``none``; ``apart`` where the lowering's pieces cross members) with the ms to find them, or
``8:fold`` where members 0 and 1 were simulated for all (``simulator.fold_members``; ``--members
both``: each row without, then with, and the ratios); a row that
fails (too many devices for the preset, MemoryError, past ``--timeout``) prints why. The last
lines fit total ms = c * devices^k over each model and plan's rows (least squares in log-log).

    python benchmarks/scale.py [--models gpt,gpt3-175b] [--plans dp,megatron,fsdp,megatron-zero3]
                               [--devices 8,64,512,1024] [--timeout 240] [--per-device]
                               [--members on|off|both]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _paper, in a spawned child too

MODELS = {"gpt": ("gpt", "default"), "gpt3-175b": ("gpt", "gpt3-175b")}
PLANS = ("dp", "megatron")
DEVICES = (8, 64, 512, 1024)
MEGATRON = {"gpt": (4, 4, 8), "gpt3-175b": (8, 16, None)}
"""Each model's megatron T, P and micro-batches (None: one sequence a micro-batch, as Narayanan et
al. 2021 ran 175B at T=8, P=16, ``megatron_lm``)."""


def _plan(model: str, graph, kind: str, n: int):
    from strategies import data_parallel
    from strategies.baselines import fsdp, megatron_lm, recomputed
    from strategies.megatron import megatron
    from strategies.megatron_layers import layer_ops

    if kind == "dp":
        return data_parallel(graph, n)
    if kind == "fsdp":
        return fsdp(graph, n)
    if kind == "megatron-zero3":  # the layers' linears (the tied embedding table is read twice a device)
        plan = _plan(model, graph, "megatron", n)
        layers = set().union(*layer_ops(graph))
        return plan.with_configs({op: cfg.with_memory(zero=3) if op in layers and graph[op].kind == "linear" else cfg
                                  for op, cfg in plan.items()})
    tp, pp, m = MEGATRON[model]
    if m is None:
        return megatron_lm(graph, n, tp, pp)
    plan = megatron(graph, n, tp=tp, pp=pp, microbatches=m, sequence_parallel=True)
    return recomputed(plan.with_microbatches(m, "1f1b"), graph).with_precision("bf16")


def _row(model: str, kind: str, n: int, fold: bool, out, members: bool = True) -> None:  # out: the child's end of a Pipe
    """One full simulation, timed by phase (simulate_plan's phases, in its order)."""
    try:
        from _paper import paper_graph
        from simulator.cost import get_cost_model
        from simulator.memory import memory_breakdown
        from simulator.presets import get_topology
        from simulator.simulate import Lowerings, paused_gc, timed_graph

        topo = get_topology(f"a100-{max(n // 8, 1)}x{min(n, 8)}")
        cost = get_cost_model("analytical")
        name, variant = MODELS[model]
        graph = paper_graph(name, n, variant)
        plan = _plan(model, graph, kind, n)
        with paused_gc():
            c0 = time.process_time()
            t0 = time.perf_counter()
            lowerings = Lowerings(graph, plan)  # copy 0's where it folds (simulate_plan's order)
            lowered = lowerings.first(topo, fold, members)
            t1 = time.perf_counter()
            phases: dict[str, float] = {}
            tg, _, _, end = timed_graph(lowered, topo, cost, "adam", fold=fold, phases=phases, relower=lowerings)
            t3 = time.perf_counter()
            peak = max(m.total for m in memory_breakdown(lowerings.last, "adam"))
            t4 = time.perf_counter()
            c4 = time.process_time()
            member, member_s = _members(graph, plan, lowerings.last)
        out.send({"members": member, "member_ms": member_s * 1e3, "tasks": len(tg), "copies": tg.copies.count if tg.copies else 1, "lower": t1 - t0,
                  "build": phases["tasks"], "events": phases["events"],
                 "memory": t4 - t3, "total": t4 - t0, "cpu": c4 - c0, "iter_ms": float(end.max()) * 1e3,
                 "peak_gib": peak / 2**30, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    except (MemoryError, ValueError) as e:  # ValueError: a preset refused, a plan that does not apply
        out.send({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"})


def _members(graph, plan, lowered) -> tuple[str, float]:
    """The member classes (``strategies.member_symmetry``, not yet folded) as ``T:sizes`` (``8:1+7``:
    8 members, member 0 a class, the other 7 one) or why there are none, and the seconds to find them."""
    from strategies.lowering_members import MemberFold
    from strategies.member_symmetry import find_members, member_classes, members_apart

    if isinstance(lowered.copies, MemberFold):  # folded on them (simulator.fold_members)
        return f"{lowered.copies.members.count}:fold", 0.0
    t0 = time.perf_counter()
    found = find_members(graph, plan)
    why = members_apart(lowered, found) if found is not None else "none"
    text = why if why is not None else f"{found.count}:" + "+".join(str(len(c)) for c in member_classes(lowered, found))
    return (text if why is None or why == "none" else "apart"), time.perf_counter() - t0


def _run(model: str, kind: str, n: int, timeout: float, fold: bool = True, members: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_row, args=(model, kind, n, fold, theirs, members))
    proc.start()
    theirs.close()
    try:
        got = mine.recv() if mine.poll(timeout) else None
    except EOFError:  # the child died without a word
        got = None
    if got is None and proc.is_alive():
        proc.kill()
    proc.join()
    return got if got is not None else {"error": f"past {timeout:.0f} s" if proc.exitcode == -9 else
                                        f"exit code {proc.exitcode}"}


def _exponent(points: list[tuple[int, float]]) -> float | None:
    """k of total = c * devices^k, least squares on (log devices, log total)."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(n) for n, _ in points], [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--devices", default=",".join(map(str, DEVICES)))
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per row (default 240)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--per-device", action="store_true",
                    help="simulate every device (no replica folding, simulator.fold): the baseline")
    ap.add_argument("--members", choices=("on", "off", "both"), default="on",
                    help="fold tensor-parallel members (simulator.fold_members): on, off (copies alone), or both: "
                         "each row twice, off then on, with the on row's ratios to the off row's")
    args = ap.parse_args()
    runs = {"on": (True,), "off": (False,), "both": (False, True)}[args.members]
    print(f"{'model':10s} {'plan':9s} {'devices':>7s} {'copies':>6s} {'tasks':>8s} {'lower ms':>9s} {'tasks ms':>9s} "
          f"{'events ms':>9s} {'memory ms':>9s} {'total ms':>9s} {'cpu ms':>8s} {'RSS MiB':>8s} {'iter ms':>9s} {'peak GiB':>8s} "
          f"{'members':>8s} {'member ms':>9s}",
          flush=True)
    rows, fits = [], {}
    for model in args.models.split(","):
        for kind in args.plans.split(","):
            for n in map(int, args.devices.split(",")):
                if kind.startswith("megatron") and n % (MEGATRON[model][0] * MEGATRON[model][1]):
                    continue
                off = None
                for members in runs:
                    r = _run(model, kind, n, args.timeout, not args.per_device, members)
                    rows.append({"model": model, "plan": kind, "devices": n, "fold_members": members, **r})
                    if "error" in r:
                        print(f"{model:10s} {kind:9s} {n:7d} {r['error']}", flush=True)
                        continue
                    if members or len(runs) == 1:
                        fits.setdefault((model, kind), []).append((n, r["total"]))
                    print(f"{model:10s} {kind:9s} {n:7d} {r['copies']:6d} {r['tasks']:8d} {r['lower'] * 1e3:9.0f} "
                          f"{r['build'] * 1e3:9.0f} {r['events'] * 1e3:9.0f} {r['memory'] * 1e3:9.0f} {r['total'] * 1e3:9.0f} "
                          f"{r['cpu'] * 1e3:8.0f} {r['rss_mib']:8.0f} {r['iter_ms']:9.1f} {r['peak_gib']:8.1f} "
                          f"{r['members']:>8s} {r['member_ms']:9.0f}", flush=True)
                    if off is not None and members:
                        print(f"{'':10s} {'on/off':9s} {'':7s} {'':6s} {r['tasks'] / off['tasks']:8.2f} "
                              + " ".join(f"{r[k] / off[k]:9.2f}" for k in ("lower", "build", "events", "memory", "total"))
                              + f" {r['cpu'] / off['cpu']:8.2f} {r['rss_mib'] / off['rss_mib']:8.2f} "
                              f"{'same' if r['iter_ms'] == off['iter_ms'] else 'DIFFERS':>9s}", flush=True)
                    off = r if not members else None
    for (model, kind), points in fits.items():
        k = _exponent(points)
        print(f"growth {model} {kind}: total ms ~ devices^{k:.2f}" if k is not None
              else f"growth {model} {kind}: one row, no fit")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
