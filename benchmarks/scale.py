"""scale.py: how the cost of one full simulation, and of one search proposal, grows with the
device count (issue 22, "Measure").

Rows: GPT-124M (zoo ``gpt`` default, batch 12 per device) and GPT-3 175B's shape (zoo
``gpt3-175b``, Brown et al. 2020 Table 2.1, built on meta on Megatron-LM's padded vocabulary of
51,200 rows, ``PADDED``, one sequence per device), each under
data parallel and the Megatron-LM baseline (175B: the plan Megatron-LM ran it with,
``strategies.baselines.megatron_lm``: T=8 tensor parallel, P=16 pipeline stages, one sequence a
micro-batch (m = 128 at 1,024 devices), 1F1B, sequence parallel, every layer recomputed, the
distributed optimizer (ZeRO-1), bf16; GPT-124M, 12 heads and 12 layers: ``strategies.megatron``
at T=4, P=4, 8 micro-batches, 1F1B, sequence parallel, every block recomputed, bf16), on
``a100-<N>x8`` at 8,
64, 512 and 1,024 devices (megatron where T x P divides them). ``--plans`` may also name
``fsdp`` (``strategies.baselines.fsdp``: data parallel, every weighted op at ZeRO-3, a layer a
prefetch unit), ``megatron-zero3`` (the megatron plan with its layers' linears at ZeRO-3):
weights sharded per use, folded on copies and members as the others, and for 175B
``megatron-mbK`` (``megatron_lm`` at K sequences a micro-batch, m = 1,024 / (8·K) at 1,024
devices). Each row runs in its own process (its peak RSS is the row's own) and prints the
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
fails (too many devices for the preset, MemoryError, past ``--timeout``) prints why.
``--plans`` may name ``found``: the plan ``search()`` returns in ``--found-budget`` seconds (60 by
default; bf16, Adam, two chains from the factorization sweep, one worker, seed 0), searched in a
process of its own before the row's. ``--proposals N``: after the row's simulation, N one-op
proposals from its plan as the search's op moves draw them, each scored by the search's
``Evaluator`` right after the plan (the delta simulation, as a chain after a rejection):
process ms a scored proposal, proposals a second, scored of drawn (a draw that makes no
proposal, or that the lowering refuses, is drawn again, its time not counted), and "draw ms": the
process ms of making every draw alike in the copies and checking it keeps the members (the
search's ``SymmetricMoves`` with ``Evaluator.keeps_members``, which lowers members 0 and 1 of
a proposal that keeps their cuts) over the scored proposals. The last lines fit total
ms = c * devices^k over each model and plan's rows (least squares in log-log), and ms a
proposal likewise.

    python benchmarks/scale.py [--models gpt,gpt3-175b] [--plans dp,megatron,fsdp,megatron-zero3,megatron-mbK,found]
                               [--devices 8,64,512,1024] [--timeout 240] [--per-device]
                               [--members on|off|both] [--proposals N] [--found-budget 60]
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
PADDED = ("gpt3-175b",)
"""Models built on Megatron-LM's padded vocabulary for their megatron T (``_paper.megatron_vocab``:
GPT-2's 50,257 rows to 51,200 at T = 8, as Megatron-LM ran 175B), so that the plan Megatron-LM ran
cuts the tied embedding and head on the vocabulary."""
PLANS = ("dp", "megatron")
DEVICES = (8, 64, 512, 1024)
MEGATRON = {"gpt": (4, 4, 8), "gpt3-175b": (8, 16, None)}
"""Each model's megatron T, P and micro-batches (None: one sequence a micro-batch, as Narayanan et
al. 2021 ran 175B at T=8, P=16, ``megatron_lm``)."""
FOUND_S = 60.0
"""Seconds of the search whose plan is the ``found`` row's (``--found-budget``)."""
PROPOSAL_SEED = 0
"""The seed of the one-op proposals ``--proposals`` times."""
DRAWS = 100
"""Draws per proposal asked for before ``_proposals`` gives up (most one-op draws from a plan
replicated over many copies cannot be imaged over them)."""


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
    sequences = int(kind[len("megatron-mb"):]) if kind.startswith("megatron-mb") else 1
    if m is None:
        return megatron_lm(graph, n, tp, pp, micro_batch=sequences)
    if sequences != 1:
        raise ValueError(f"plan {kind!r}: {model}'s megatron row has {m} micro-batches, not a sequence count")
    plan = megatron(graph, n, tp=tp, pp=pp, microbatches=m, sequence_parallel=True)
    return recomputed(plan.with_microbatches(m, "1f1b"), graph).with_precision("bf16")


def _graph(model: str, n: int):
    """``model`` traced at paper scale for ``n`` devices (on Megatron-LM's padded vocabulary where
    it is in ``PADDED``)."""
    from _paper import GPT2_VOCAB, megatron_vocab, paper_graph

    name, variant = MODELS[model]
    padded = {"vocab_size": megatron_vocab(GPT2_VOCAB, MEGATRON[model][0])} if model in PADDED else {}
    return paper_graph(name, n, variant, **padded)


def _found(out, model: str, n: int, seconds: float) -> None:  # out: the child's end of a Pipe
    """The plan ``search()`` finds for ``model`` on ``a100-<n/8>x8`` in ``seconds`` (wall,
    baselines included), sent as {"plan": ...}: bf16 mixed precision, Adam, two chains from the
    factorization sweep, one worker, seed 0, as ``llama_search.py`` runs it. In a process of its
    own, so the row's peak RSS is its simulation's."""
    try:
        from simulator.presets import get_topology
        from soapsearch.search.api import search

        topo = get_topology(f"a100-{max(n // 8, 1)}x{min(n, 8)}")
        found = search(_graph(model, n), topology=topo, budget_s=seconds, optimizer="adam",
                       precision="bf16", init=("swept", "swept"), chains=2, workers=1, seed=0)
        out.send({"plan": found.strategy})
    except (MemoryError, ValueError) as e:
        out.send({"error": f"search: {type(e).__name__}: {str(e).splitlines()[0][:80]}"})


def _proposals(graph, plan, topo, cost, count: int) -> dict:
    """Process seconds of ``count`` one-op proposals from ``plan`` as the search's op moves draw
    them, each scored by the search's ``Evaluator`` right after ``plan`` (as MCMC scores a
    proposal after a rejection: the delta simulation reuses every unchanged op's lowering and
    task block): an op with a choice gets another of its candidate configs (``candidate_configs``
    at the plan's micro-batch count) with its sharding level and recompute flag kept
    (``moves.keep``), and from ``FOLD_FROM`` devices the change is made alike in every copy of
    the plan and kept on its tensor-parallel members, its lowering included
    (``symmove.SymmetricMoves`` with ``Evaluator.keeps_members``, as ``search`` sets it). A draw
    that makes no proposal there, or that the lowering refuses (``PlanError``), is drawn again;
    only the scored proposals' time counts ("drawn": every draw; "draw_s": the imaging and member
    check of every draw, over the scored proposals)."""
    import random

    from simulator.simulate import FOLD_FROM
    from soapsearch.search.api import Evaluator
    from soapsearch.search.moves import candidate_configs, keep
    from soapsearch.search.symmove import SymmetricMoves
    from strategies.errors import PlanError

    candidates = candidate_configs(graph, plan.num_devices, plan.microbatches, topo.node_size)
    ops = sorted(op for op, cfgs in candidates.items() if len(cfgs) > 1)
    rng = random.Random(PROPOSAL_SEED)
    evaluate = Evaluator(graph, topo, cost, optimizer="adam", precision=plan.precision)
    evaluate(plan)
    symmetric = SymmetricMoves(graph, evaluate.keeps_members) if plan.num_devices >= FOLD_FROM else None
    spent, imaging, done, drawn = 0.0, 0.0, 0, 0
    while done < count and ops and drawn < DRAWS * count:
        drawn += 1
        op = rng.choice(ops)
        cfg = keep(plan[op], rng.choice(candidates[op]))
        if cfg == plan[op]:
            continue
        proposal = plan.replace(op, cfg)
        if symmetric is not None:
            c0 = time.process_time()
            proposal = symmetric.image(plan, proposal, "op")
            imaging += time.process_time() - c0
            if proposal is None:
                continue
        evaluate(plan)  # the chain's current plan: a plan seen, not simulated again
        c0 = time.process_time()
        try:
            evaluate(proposal)
        except PlanError:
            continue
        spent += time.process_time() - c0
        done += 1
    return {"proposals": done, "drawn": drawn, "proposal_s": spent / done if done else None,
            "draw_s": imaging / done if done else None}


def _row(out, model: str, kind: str, n: int, fold: bool, members: bool = True, proposals: int = 0,
         plan=None) -> None:  # out: the child's end of a Pipe
    """One full simulation, timed by phase (simulate_plan's phases, in its order), of ``plan`` (None:
    ``kind``'s); ``proposals``: then that many one-op proposals from the plan (``_proposals``)."""
    try:
        from simulator.cost import get_cost_model
        from simulator.memory import memory_breakdown
        from simulator.presets import get_topology
        from simulator.simulate import Lowerings, paused_gc, timed_graph

        topo = get_topology(f"a100-{max(n // 8, 1)}x{min(n, 8)}")
        cost = get_cost_model("analytical")
        graph = _graph(model, n)
        plan = _plan(model, graph, kind, n) if plan is None else plan
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
        row = {"members": member, "member_ms": member_s * 1e3, "tasks": len(tg),
               "copies": tg.copies.count if tg.copies else 1, "lower": t1 - t0, "build": phases["tasks"],
               "events": phases["events"], "memory": t4 - t3, "total": t4 - t0, "cpu": c4 - c0,
               "iter_ms": float(end.max()) * 1e3, "peak_gib": peak / 2**30,
               "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        del lowerings, lowered, tg
        if proposals:
            with paused_gc():  # as the search's chains
                row.update(_proposals(graph, plan, topo, cost, proposals))
        out.send(row)
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


def _run(model: str, kind: str, n: int, timeout: float, fold: bool = True, members: bool = True,
         proposals: int = 0, found_s: float = FOUND_S) -> dict:
    """One row in a process of its own (the ``found`` plan searched in another first), or why not."""
    plan = None
    if kind == "found":
        got = _child(_found, (model, n, found_s), timeout + found_s)
        if "error" in got:
            return got
        plan = got["plan"]
    return _child(_row, (model, kind, n, fold, members, proposals, plan), timeout)


def _child(target, args: tuple, timeout: float) -> dict:
    """What ``target(out, *args)`` sends on ``out`` from a spawned process, or the error why none."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(theirs, *args))
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


def _rate(r: dict, asked: int) -> str:
    """A row's proposal columns: process ms a scored proposal, scored proposals a second, and
    scored of drawn (``_proposals``)."""
    if not asked:
        return ""
    ms = f"{r['proposal_s'] * 1e3:9.1f} {1 / r['proposal_s']:7.1f}" if r.get("proposal_s") else f"{'–':>9s} {'–':>7s}"
    draw = f"{r['draw_s'] * 1e3:8.1f}" if r.get("draw_s") is not None else f"{'–':>8s}"
    return f" {ms} {r['proposals']:>5d}/{r['drawn']:<5d} {draw}"


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
    ap.add_argument("--proposals", type=int, default=0,
                    help="also time this many one-op proposals from each row's plan through the search's Evaluator "
                         "(process ms each, proposals per second)")
    ap.add_argument("--found-budget", type=float, default=FOUND_S,
                    help=f"seconds of the search whose plan is the found row's (default {FOUND_S:.0f})")
    args = ap.parse_args()
    runs = {"on": (True,), "off": (False,), "both": (False, True)}[args.members]
    print(f"{'model':10s} {'plan':9s} {'devices':>7s} {'copies':>6s} {'tasks':>8s} {'lower ms':>9s} {'tasks ms':>9s} "
          f"{'events ms':>9s} {'memory ms':>9s} {'total ms':>9s} {'cpu ms':>8s} {'RSS MiB':>8s} {'iter ms':>9s} {'peak GiB':>8s} "
          f"{'members':>8s} {'member ms':>9s}" + (f" {'prop ms':>9s} {'prop/s':>7s} {'scored/drawn':>11s} {'draw ms':>8s}" if args.proposals else ""),
          flush=True)
    rows, fits, rates = [], {}, {}
    for model in args.models.split(","):
        for kind in args.plans.split(","):
            for n in map(int, args.devices.split(",")):
                if kind.startswith("megatron") and n % (MEGATRON[model][0] * MEGATRON[model][1]):
                    continue
                off = None
                for members in runs:
                    r = _run(model, kind, n, args.timeout, not args.per_device, members, args.proposals,
                             args.found_budget)
                    rows.append({"model": model, "plan": kind, "devices": n, "fold_members": members, **r})
                    if "error" in r:
                        print(f"{model:10s} {kind:9s} {n:7d} {r['error']}", flush=True)
                        continue
                    if members or len(runs) == 1:
                        fits.setdefault((model, kind), []).append((n, r["total"]))
                        if r.get("proposal_s"):
                            rates.setdefault((model, kind), []).append((n, r["proposal_s"]))
                    print(f"{model:10s} {kind:9s} {n:7d} {r['copies']:6d} {r['tasks']:8d} {r['lower'] * 1e3:9.0f} "
                          f"{r['build'] * 1e3:9.0f} {r['events'] * 1e3:9.0f} {r['memory'] * 1e3:9.0f} {r['total'] * 1e3:9.0f} "
                          f"{r['cpu'] * 1e3:8.0f} {r['rss_mib']:8.0f} {r['iter_ms']:9.1f} {r['peak_gib']:8.1f} "
                          f"{r['members']:>8s} {r['member_ms']:9.0f}" + _rate(r, args.proposals), flush=True)
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
    for (model, kind), points in rates.items():
        k = _exponent(points)
        if k is not None:
            print(f"growth {model} {kind}: ms a proposal ~ devices^{k:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
