"""``soapsearch search`` and ``soapsearch show-plan``."""

from __future__ import annotations

import itertools
import json
import math
import sys

from soapsearch.api import DEFAULT_TOPOLOGY, TOPOLOGY_HELP
from soapsearch.search.api import FoundPlan, search
from soapsearch.search.config import SearchConfig
from soapsearch.search.output import check_plan_output, wrote
from soapsearch.search.study import study_search
from strategies.config import format_devices
from strategies.serialize import atomic_open, check_writable, parse_plan
from strategies.strategy import DTYPE_FLAGS, REDUCE_DTYPES, REDUCE_HELP, SCHEDULES

__all__ = ["add_search_parsers", "config_of", "table"]


def add_search_parsers(sub, model_args, graph_of) -> None:
    """``search`` (flags mapped onto a SearchConfig, their defaults read from its fields) and
    ``show-plan``; ``graph_of(args)`` traces the model the flags name."""
    c = SearchConfig
    sp = sub.add_parser("search", help="search a plan (MCMC scored by the simulator)")
    model_args(sp)
    sp.add_argument("--topology", default=DEFAULT_TOPOLOGY, help=TOPOLOGY_HELP)
    sp.add_argument("--budget", type=float, default=c.budget_s,
                    help=f"seconds (default {c.budget_s:g}; 0: no time limit, stop after --proposals)")
    sp.add_argument("--proposals", type=int, default=c.proposals,
                    help="also stop after this many proposals (with --optuna: per trial)")
    sp.add_argument("--init", default=c.init,
                    help="comma list of initial plans: baseline names, 'random', 'factorized', 'swept', plan JSON paths "
                         "(default data_parallel, or hybrid where the batch does not divide by the devices)")
    sp.add_argument("--seed", type=int, default=c.seed, help=f"seed of the chains (default {c.seed})")
    sp.add_argument("--cost-model", default=c.cost_model, choices=["analytical", "profiled"],
                    help=f"kernel times (default {c.cost_model})")
    sp.add_argument("--microbatches", type=int, default=c.microbatches,
                    help=f"micro-batches of the chains' plans (default {c.microbatches})")
    sp.add_argument("--schedule", default=c.schedule, choices=SCHEDULES,
                    help=f"pipeline schedule of the chains' plans (default {c.schedule})")
    sp.add_argument("--optimizer", default=c.optimizer, choices=["sgd", "adam"],
                    help=f"the optimizer whose state counts in device memory (default {c.optimizer})")
    sp.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_FLAGS),
                    help="the plans' precision: fp32 computes in the model's dtype, bf16/fp16 in mixed "
                         "precision (default fp32)")
    sp.add_argument("--reduce-dtype", default=c.reduce_dtype, choices=REDUCE_DTYPES,
                    help=REDUCE_HELP.format("compute"))
    sp.add_argument("--devices", type=int, default=c.num_devices,
                    help="use only the first N devices (default all of the topology's)")
    sp.add_argument("--chains", type=int, default=c.chains,
                    help="MCMC chains (default one per --init plan; chain i starts from the i-th, cycling)")
    sp.add_argument("--patience", type=int, default=c.patience,
                    help="a chain stops where its best has not improved for this many proposals "
                         "(default: for half its --proposals; a time budget alone is spent whole; 0: never)")
    sp.add_argument("--exhaustive-limit", type=int, default=c.exhaustive_limit,
                    help="simulate every plan where the op configs make at most this many (and no more than "
                         f"--proposals); 0: always MCMC (default {c.exhaustive_limit})")
    sp.add_argument("--workers", type=int, default=c.workers,
                    help="chains run side by side in processes (default one per chain up to the cores; "
                         "1 with the profiled cost model)")
    sp.add_argument("--beta", type=float, default=c.beta,
                    help="constant inverse temperature per ms, one plan per chain (default: set by a pilot, "
                         "annealed, over --replicas tempered plans)")
    sp.add_argument("--replicas", type=int, default=c.replicas,
                    help=f"plans each chain walks at temperatures exchanging them (default {c.replicas})")
    sp.add_argument("--reset-every", type=int, default=c.reset_every,
                    help=f"a chain returns to its best plan every N proposals; 0: never (default {c.reset_every})")
    sp.add_argument("--microbatch-choices", default=",".join(map(str, c.microbatch_choices)),
                    help="comma list of the counts a micro-batch move draws from (default "
                         f"{','.join(map(str, c.microbatch_choices))})")
    for field, what in MOVE_FLAGS:
        sp.add_argument(f"--{field.replace('_', '-')}", type=float, default=getattr(c, field),
                        help=f"probability of a proposal {what} (default {getattr(c, field):g})")
    sp.add_argument("--repeat-stages", action="store_true", default=c.repeat_stages,
                    help="a repeated-block move lets instances on other pipeline stages keep their devices")
    sp.add_argument("-o", "--output", default="plan.json",
                    help="where to write the plan (default plan.json); a file holding another model's "
                         "plan is refused unless --force")
    sp.add_argument("--force", action="store_true",
                    help="overwrite -o even where it holds another model's plan or is no plan")
    sp.add_argument("--optuna", action="store_true",
                    help="an optuna study over micro-batches, schedule, beta, initial plan and "
                         "device count, each trial a short MCMC chain")
    sp.add_argument("--trials", type=int, default=None, help="with --optuna: stop after N trials")
    sp.add_argument("--study", default=None,
                    help="optuna storage to resume from (sqlite:///x.db or a .log journal file); "
                         "implies --optuna")
    sp.add_argument("--study-name", default=None, help="name of the study in --study")
    sp.set_defaults(fn=lambda args: _cmd_search(args, graph_of))
    show = sub.add_parser("show-plan", help="print a plan: per op its degrees, devices, ZeRO level and recompute")
    show.add_argument("plan")
    show.add_argument("--png", default=None, help="also draw op x device placement (matplotlib)")
    show.set_defaults(fn=_cmd_show_plan)


MOVE_FLAGS = (("zero_move", "setting a sharding level (ZeRO 0-3)"),
              ("recompute_move", "turning recompute on or off"),
              ("microbatch_move", "giving the plan another micro-batch count or schedule"),
              ("subgraph_move", "placing a connected set of ops on one device set"),
              ("repeat_move", "(of the others) setting an op of every repeated block's instance alike"),
              ("global_move", "(of the others) re-deriving every op from a data x tensor x pipeline factorization"))
"""The SearchConfig move rates the CLI sets, each ``--zero-move`` and so on."""


def _counts(text: str) -> tuple[int, ...]:
    """``--microbatch-choices 1,2,4``: whole numbers (SearchConfig checks them further)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"search microbatch_choices = {text!r}: must be a comma list of whole numbers, "
                         "e.g. 1,2,4,8") from None


def config_of(args, cost_model) -> SearchConfig:
    """The SearchConfig the ``search`` flags say (``--budget 0``: no time limit)."""
    return SearchConfig(budget_s=args.budget or None, proposals=args.proposals, cost_model=cost_model,
                        init=None if args.init is None else tuple(args.init.split(",")), seed=args.seed,
                        microbatches=args.microbatches, schedule=args.schedule, optimizer=args.optimizer,
                        precision=DTYPE_FLAGS[args.dtype], reduce_dtype=args.reduce_dtype,
                        num_devices=args.devices,
                        chains=args.chains, workers=args.workers, exhaustive_limit=args.exhaustive_limit,
                        patience=args.patience, beta=args.beta, replicas=args.replicas,
                        reset_every=args.reset_every, microbatch_choices=_counts(args.microbatch_choices),
                        repeat_stages=args.repeat_stages,
                        **{field: getattr(args, field) for field, _ in MOVE_FLAGS})


def _cmd_search(args, graph_of) -> int:
    from simulator.profiled import cost_model_for

    check_writable(args.output)
    cost = cost_model_for(args.cost_model, args.topology)  # profiled: the cache calibrated beside a topology JSON
    config = config_of(args, cost)  # its checks said before the model is traced
    graph = graph_of(args)
    replacing = check_plan_output(args.output, graph, args.force)
    bar = None

    def on_step(progress):
        nonlocal bar
        if bar is None and not args.json:  # made at the first proposal: an error before it prints alone
            from tqdm import tqdm
            bar = tqdm(total=args.proposals, unit="prop", file=sys.stderr, dynamic_ncols=True,
                       desc=f"search {graph.name}")
        if bar is not None:
            bar.update(progress.proposals - bar.n)
            bar.set_postfix(best_ms=f"{progress.best_ms:.3f}",
                            accept=f"{progress.accepted / max(1, progress.proposals):.2f}", refresh=False)

    try:
        if args.optuna or args.study:
            result = study_search(graph, topology=args.topology, config=config, trials=args.trials,
                                  storage=args.study, study_name=args.study_name)
        else:
            result = search(graph, topology=args.topology, config=config, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()
    result.save(args.output)
    path = wrote(args.output)
    if args.json:
        print(json.dumps({"iteration_ms": result.predicted_ms, "baselines": result.baselines,
                          "plan": path, "proposals": result.proposals, "scored": result.scored,
                          "fits": result.result.fits, "peak_memory": result.result.to_json().get("peak_memory"),
                          "interrupted": result.interrupted,
                          "workers": result.workers, "exhaustive": getattr(result, "exhaustive", 0), "space": getattr(result, "space", 0),
                          "exact": getattr(result, "exact", False),
                          "unscored": list(getattr(result, "unscored", ())),
                          "stopped_early": getattr(result, "stopped_early", 0)}))
        return 0
    print(table(result))
    stop = "stopped by Ctrl-C; " if result.interrupted else ""
    side = f", {result.workers} chains side by side" if result.workers > 1 else ""
    if getattr(result, "exact", False):
        print(f"exact: every one of the {result.space} plans of the op configs simulated in "
              f"{result.elapsed_s:.1f} s (at most --exhaustive-limit): the optimum of that space")
    elif getattr(result, "space", 0):  # enumerated, the budget out first (it may be before the first plan)
        print(f"not exact: {result.exhaustive} of the {result.space} plans of the op configs simulated before "
              f"the time budget ran out ({result.elapsed_s:.1f} s)")
    else:
        print(f"{stop}{result.proposals} proposals in {result.elapsed_s:.1f} s, {result.scored} scored "
              f"({result.scored / max(result.elapsed_s, 1e-9):.0f}/s{side}; the others made no plan)")
    if getattr(result, "unscored", ()):
        print(f"not scored, the time budget spent first: {', '.join(result.unscored)}")
    if getattr(result, "stopped_early", 0):
        print(f"{result.stopped_early} chain(s) stopped early, their best not improved for "
              + (f"{args.patience} proposals" if args.patience else "half their proposals"))
    print(f"wrote the plan for {graph.name} to {path}{replacing}")
    return 0


def table(result: FoundPlan) -> str:
    """Found plan vs each baseline: ms, speedup over data parallel (over ``hybrid`` where it
    stands in for data parallel: a batch the devices do not divide), bytes moved, peak memory;
    then one line of the found plan's peak by its largest categories (its busiest device)."""
    rows = [("found", result.result)] + list(result.baseline_results.items())
    ref = "data_parallel" if "data_parallel" in result.baselines else "hybrid"
    dp = result.baselines.get(ref)
    vs = "vs DP" if ref == "data_parallel" else "vs hybrid"
    lines = [f"{'plan':16s} {'iter ms':>10s} {vs:>9s} {'moved MiB':>10s} {'peak MiB':>9s} fits"]
    for name, r in rows:
        speed = f"{dp / r.iteration_ms:6.2f}x" if dp else "     -"
        lines.append(f"{name:16s} {r.iteration_ms:10.3f} {speed:>9s} "
                     f"{sum(r.bytes_moved.values()) / 2**20:10.1f} "
                     f"{max(r.peak_memory_bytes) / 2**20:9.1f} {'yes' if r.fits else 'NO'}")
    top = result.result.peak_breakdown
    if top is not None:
        lines.append(f"found plan's memory, device {result.result.busiest_device}: {top.describe()}")
    return "\n".join(lines)


def _cmd_show_plan(args) -> int:
    if args.png:  # said before the plan is printed
        check_writable(args.png, "--png")
        plt = _pyplot()
    obj, where, plan = parse_plan(args.plan)  # checked as far as it can be without the model
    from simulator.presets import check_plan_topology
    check_plan_topology(obj["topology"], where)
    model, topo, pred = obj["model"], obj["topology"], obj.get("predicted") or {}
    print(f"{model.get('name', '?')} on {topo.get('name', '?')} ({plan.num_devices} devices), "
          f"{plan.microbatches} micro-batch(es), {plan.schedule}"
          + ("" if plan.overlap_grad_reduce else ", gradients synced after the backward"))
    ms = pred.get("iteration_ms") if isinstance(pred, dict) else None
    if isinstance(ms, (int, float)) and not isinstance(ms, bool):
        print(f"predicted {ms:.3f} ms per iteration")
    width = max(len(name) for name in plan)
    for o, (name, cfg) in zip(obj["ops"], plan.configs):
        dims = o.get("dims") if isinstance(o.get("dims"), list) else []
        cuts = [f"{d}={g}" if dims else f"{g}" for d, g in itertools.zip_longest(dims, cfg.degrees, fillvalue="?")
                if isinstance(g, int) and g > 1]
        kind = o.get("kind") if isinstance(o.get("kind"), str) else ""
        memory = (f" zero{cfg.zero}" if cfg.zero else "") + (" recompute" if cfg.recompute else "")
        print(f"  {name:{width}s}  {kind:12s} {'·'.join(cuts)} @ {format_devices(cfg.devices)}{memory}")
    if args.png:
        _draw(plt, [{"name": name, "devices": list(cfg.devices)} for name, cfg in plan.configs],
              plan.num_devices, args.png)
        print(f"wrote {wrote(args.png)}")
    return 0


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'soapsearch[plot]'") from None
    return plt


def _draw(plt, ops, num_devices: int, path: str) -> None:
    grid = [[0.0] * num_devices for _ in ops]
    for i, o in enumerate(ops):
        for d in o["devices"]:
            grid[i][d] = math.log2(1 + len(o["devices"]))
    fig, ax = plt.subplots(figsize=(2 + 0.4 * num_devices, 1 + 0.18 * len(ops)))
    ax.imshow(grid, aspect="auto", cmap="Blues", interpolation="nearest")
    ax.set_yticks(range(len(ops)), [o["name"] for o in ops], fontsize=6)
    ax.set_xticks(range(num_devices), [str(d) for d in range(num_devices)], fontsize=7)
    ax.set_xlabel("device")
    ax.set_title("op placement (darker: cut over more devices)")
    fig.tight_layout()
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
