"""The ``soapsearch`` command: ``zoo``, ``show``, ``plan``, ``simulate``, ``search``,
``show-plan``, ``run``, ``calibrate``, ``compare``, ``export`` and ``topology show``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from soapsearch import zoo
from soapsearch.api import DEFAULT_TOPOLOGY, TOPOLOGY_HELP
from soapsearch.models import ModelLoadError, load_model
from soapsearch.calibrate._spawn import SpawnError
from soapsearch.calibrate.cli import add_calibrate_parsers
from soapsearch.executor.cli import add_run_parser
from soapsearch.export_cli import add_export_parser
from soapsearch.search.cli import add_search_parsers
from soapsearch.search.output import check_plan_output, wrote
from soapsearch.trace import CAPTURES, TraceError, check_scalar_loss, trace
from strategies import BASELINES, OpGraph, PlanError, baseline, get_rule, save_strategy
from strategies.strategy import DTYPE_FLAGS, FSDP_UNITS, REDUCE_DTYPES, REDUCE_HELP, Strategy
from strategies.baselines import RECOMPUTE
from strategies.serialize import check_writable
from strategies.config import ROLE_LETTER
from strategies.rules import OPAQUE

__all__ = ["main", "op_table", "graph_json"]


def _dims(node) -> str:
    return "×".join(f"{ROLE_LETTER[d.role]}{d.size}" for d in node.dims) or "scalar"


def _weights(node) -> str:
    return " ".join(f"{w.role}[{','.join(map(str, w.spec.shape))}]" for w in node.weights)


def op_table(graph: OpGraph) -> str:
    """The op table ``show`` prints: name, kind, dims with roles (S/A/P/R), weights, GFLOPs."""
    rows = [("op", "kind", "dims (S/A/P/R)", "weights", "GFLOPs")]
    for n in graph:
        kind = f"{n.kind}!" if n.kind == OPAQUE else n.kind
        rows.append((n.name, kind, _dims(n), _weights(n), f"{n.flops / 1e9:.3f}"))
    widths = [min(max(len(r[i]) for r in rows), 48) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _opaque_warning(graph: OpGraph) -> str:
    opaque = [n for n in graph if n.kind == OPAQUE]
    if not opaque:
        return ""
    items = "\n".join(f"  {n.name}: {n.attrs.get('target', '?')}  ({n.source or 'source unknown'})"
                      for n in opaque)
    return (f"warning: {len(opaque)} opaque op(s) have no rule; each runs unsplit on one device:\n"
            f"{items}")


def graph_json(graph: OpGraph) -> dict:
    return {
        "model": graph.name, "fingerprint": graph.fingerprint(), "batch_size": graph.batch_size,
        "capture": graph.capture, "total_flops": graph.total_flops, "weight_bytes": graph.weight_bytes,
        "ops": [{"name": n.name, "kind": n.kind, "inputs": list(n.inputs),
                 "output": {"shape": list(n.output.shape), "dtype": n.output.dtype},
                 "dims": [{"name": d.name, "size": d.size, "role": d.role} for d in n.dims],
                 "splittable": list(get_rule(n.kind).splittable(n)),
                 "weights": {w.name: list(w.spec.shape) for w in n.weights},
                 "flops": n.flops, "bytes_read": n.bytes_read, "bytes_written": n.bytes_written}
                for n in graph],
        "opaque": [n.name for n in graph if n.kind == OPAQUE],
    }


def _graph(args) -> OpGraph:
    """The model the flags name, traced for training: it must return one scalar loss."""
    spec = load_model(args.model, variant=args.variant, batch_size=args.batch_size)
    graph = trace(spec.model, spec.example_inputs, name=spec.name, capture=getattr(args, "capture", "auto"))
    check_scalar_loss(graph)
    return graph


def _cmd_zoo(args) -> int:
    for name in zoo.names():
        print(f"{name:14s} {zoo.describe(name)}")
    return 0


def _cmd_show(args) -> int:
    graph = _graph(args)
    if args.json:
        print(json.dumps(graph_json(graph), indent=1))
        return 0
    print(f"{graph.name}: {len(graph)} ops captured by torch.{graph.capture}, batch {graph.batch_size}, "
          f"{graph.total_flops / 1e9:.2f} GFLOPs forward, {graph.weight_bytes / 2**20:.1f} MiB of "
          f"weights, fingerprint {graph.fingerprint()}")
    print(op_table(graph))
    warning = _opaque_warning(graph)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def _cmd_plan(args) -> int:
    from simulator.presets import get_topology

    check_writable(args.output)
    topo = get_topology(args.topology)
    devices = topo.num_devices if args.devices is None else args.devices
    if devices > topo.num_devices:
        raise ValueError(f"plan --devices = {devices}: more than the {topo.num_devices} devices of "
                         f"{topo.name!r}; give a --topology with as many")
    graph = _graph(args)
    replacing = check_plan_output(args.output, graph, args.force)
    megatron_only = [f for f, v in (("--tp", args.tp), ("--pp", args.pp != 1),
                                    ("--sequence-parallel", args.sequence_parallel),
                                    ("--virtual-stages", args.virtual_stages != 1)) if v]
    if megatron_only and args.baseline != "megatron":
        raise ValueError(f"{megatron_only[0]} is a flag of --baseline megatron, not of --baseline {args.baseline}")
    plan = baseline(args.baseline, graph, devices, args.microbatches, args.tp, args.pp, args.sequence_parallel,
                    args.recompute, args.virtual_stages)
    plan = plan.with_precision(DTYPE_FLAGS[args.dtype], args.reduce_dtype).with_bucket_cap(args.bucket_cap_mb)
    plan = plan.with_overlap_grad_reduce(args.overlap_grad_reduce)
    if args.fsdp_unit is not None:
        plan = plan.with_fsdp_unit(args.fsdp_unit)
    save_strategy(args.output, plan, graph, topology=topo.name)
    path = wrote(args.output)
    if args.json:
        print(json.dumps({"plan": path, "baseline": args.baseline, "num_devices": devices,
                          "microbatches": plan.microbatches, "precision": plan.precision, "ops": len(graph)}))
        return 0
    for n in graph:
        print(f"  {n.name:28s} {n.kind:14s} {plan[n.name].show(n.dims)}")
    print(f"wrote {args.baseline} plan for {graph.name} on {devices} devices of {topo.name} "
          f"({plan.microbatches} micro-batch(es), precision {plan.precision}) to {path}{replacing}")
    return 0


def _cmd_simulate(args) -> int:
    from soapsearch.api import simulate
    from simulator.presets import get_topology

    if args.trace:
        check_writable(args.trace, "--trace")
    graph = _graph(args)
    topo = get_topology(args.topology)
    if (args.plan is None) == (args.baseline is None):
        raise ValueError("give exactly one of --plan plan.json and --baseline NAME")
    from simulator.profiled import cost_model_for

    result = simulate(graph, args.plan or args.baseline, topology=topo,
                      cost_model=cost_model_for(args.cost_model, args.topology),
                      optimizer=args.optimizer, microbatches=args.microbatches, trace=args.trace,
                      precision=None if args.dtype is None else DTYPE_FLAGS[args.dtype],
                      bucket_cap_mb=args.bucket_cap_mb, reduce_dtype=args.reduce_dtype,
                      overlap_grad_reduce=args.overlap_grad_reduce)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    what = args.plan or f"baseline {args.baseline}"
    print(f"{graph.name} ({what}) on {topo.name}, {args.cost_model} costs: "
          f"{result.iteration_ms:.3f} ms per iteration, {result.num_tasks} tasks, "
          f"{'fits' if result.fits else 'DOES NOT FIT'} in memory")
    print(f"  {'device':>6s} {'busy ms':>9s} {'peak MiB':>9s} {'capacity MiB':>12s}")
    for d, (busy, peak, cap) in enumerate(zip(result.busy_time, result.peak_memory_bytes,
                                               result.memory_capacity)):
        print(f"  {d:6d} {busy * 1e3:9.3f} {peak / 2**20:9.1f} {cap / 2**20:12.0f}"
              f"{'  over' if peak > cap else ''}")
    top = result.peak_breakdown
    if top is not None:
        print(f"  memory of device {result.busiest_device}: {top.describe()}")
    moved = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(result.bytes_moved.items()))
    print(f"  bytes moved: {moved or 'none'}")
    if args.trace:
        print(f"  timeline written to {args.trace} (Chrome trace; open in Perfetto)")
    return 0


def _cmd_topology(args) -> int:
    from simulator.presets import get_topology

    topo = get_topology(args.name)
    if args.json:
        print(json.dumps(topo.to_json()))
    else:
        print(topo.describe())
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soapsearch", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("zoo", help="list the built-in models").set_defaults(fn=_cmd_zoo)

    def model_args(sp):
        sp.add_argument("model", help="zoo name, path/to/file.py:factory or package.module:factory")
        sp.add_argument("--variant", default="default", choices=zoo.VARIANTS,
                        help=f"zoo variant, default 'default': {zoo.VARIANTS_HELP}")
        sp.add_argument("--batch-size", type=int, default=None, help="override the batch size")
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        sp.add_argument("--capture", default="auto", choices=CAPTURES,
                        help="front end: fx (torch.fx), export (torch.export) or auto (fx, then "
                             "export where fx fails; default)")

    show = sub.add_parser("show", help="trace a model and print its op table")
    model_args(show)
    show.set_defaults(fn=_cmd_show)
    plan = sub.add_parser("plan", help="write a baseline plan as strategy JSON")
    model_args(plan)
    plan.add_argument("--baseline", required=True, choices=sorted(BASELINES))
    plan.add_argument("--devices", type=int, default=None,
                      help="number of devices: the topology's first N (default all of them)")
    plan.add_argument("--microbatches", type=int, default=None,
                      help="micro-batches of --baseline pipeline (default 4) or megatron (default 1)")
    plan.add_argument("--tp", type=int, default=None,
                      help="tensor-parallel degree of --baseline megatron (default: the largest divisor of "
                           "the heads and a stage's devices <= 8)")
    plan.add_argument("--pp", type=int, default=1,
                      help="pipeline stages of --baseline megatron: contiguous blocks balanced by forward "
                           "FLOPs, each on its own devices / pp devices (default 1)")
    plan.add_argument("--virtual-stages", type=int, default=1,
                      help="--baseline megatron: model chunks per pipeline rank; above 1 the model is cut "
                           "into pp x V stages, stage s on rank s mod pp, run by the interleaved 1F1B "
                           "schedule (Narayanan et al. 2021; micro-batches a multiple of pp; default 1)")
    plan.add_argument("--sequence-parallel", action="store_true",
                      help="--baseline megatron: cut the ops between the blocks (LayerNorm, residual, "
                           "dropout) on the sequence over each tensor-parallel group (Korthikanti et al. "
                           "2022) instead of on the samples")
    plan.add_argument("--recompute", nargs="?", const="blocks", default=None, choices=sorted(RECOMPUTE),
                      help="recompute in the backward, by policy: blocks (the default when given bare: every op "
                           "of every transformer block, Korthikanti et al. 2022's full recompute), layers (every "
                           "op of every layer but its closing residual add, Megatron-LM's full recompute), "
                           "or selective (the attention cores, Korthikanti et al. 2022 section 5)")
    plan.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_FLAGS),
                      help="the plan's precision: fp32 computes in the model's dtype, bf16/fp16 in mixed "
                           "precision (float32 master weights and optimizer state)")
    plan.add_argument("--reduce-dtype", default=Strategy.reduce_dtype, choices=REDUCE_DTYPES,
                      help=REDUCE_HELP.format("compute"))
    plan.add_argument("--bucket-cap-mb", type=float, default=Strategy.bucket_cap_mb,
                      help="cap of the gradient buckets in MiB (DDP's bucket_cap_mb; default 25): each device "
                           "set's gradients are synced in buckets of about this size, each as soon as it is final")
    plan.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                      help="sync every gradient bucket after the backward and its pipeline sends instead of each "
                           "as soon as it is final (Megatron-LM's overlap_grad_reduce=False), recorded in the plan")
    plan.add_argument("--fsdp-unit", default=None, choices=FSDP_UNITS,
                      help="the ZeRO-3 prefetch unit, recorded in the plan: op (each step reading level-3 weights) "
                           "or block (each repeated block, a transformer layer: FSDP2's fully_shard per layer); "
                           "default: the baseline's (fsdp: block where the model has repeated blocks)")
    plan.add_argument("--topology", default=DEFAULT_TOPOLOGY, help=f"{TOPOLOGY_HELP}; recorded in the plan")
    plan.add_argument("-o", "--output", default="plan.json",
                      help="where to write the plan (default plan.json); a file holding another model's "
                           "plan is refused unless --force")
    plan.add_argument("--force", action="store_true",
                      help="overwrite -o even where it holds another model's plan or is no plan")
    plan.set_defaults(fn=_cmd_plan)
    sim = sub.add_parser("simulate", help="simulate one training iteration of a plan")
    model_args(sim)
    sim.add_argument("--plan", default=None, help="strategy JSON to simulate")
    sim.add_argument("--baseline", default=None, choices=sorted(BASELINES),
                     help="or a baseline plan for every device of the topology")
    sim.add_argument("--topology", default=DEFAULT_TOPOLOGY, help=TOPOLOGY_HELP)
    sim.add_argument("--cost-model", default="analytical", choices=["analytical", "profiled"])
    sim.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    sim.add_argument("--dtype", default=None, choices=sorted(DTYPE_FLAGS),
                     help="simulate in this precision (fp32: the model's dtype; bf16/fp16: mixed "
                          "precision); default: the plan's")
    sim.add_argument("--reduce-dtype", default=None, choices=REDUCE_DTYPES,
                     help=REDUCE_HELP.format("the plan's"))
    sim.add_argument("--microbatches", type=int, default=None,
                     help="micro-batches of --baseline pipeline (default 4) or megatron (default 1)")
    sim.add_argument("--bucket-cap-mb", type=float, default=None,
                     help="cap of the gradient buckets in MiB (DDP's bucket_cap_mb); default: the plan's "
                          "(a baseline's: 25)")
    sim.add_argument("--overlap-grad-reduce", dest="overlap_grad_reduce", default=None,
                     action=argparse.BooleanOptionalAction,
                     help="sync each gradient bucket as soon as it is final (--overlap-grad-reduce) or all after "
                          "the backward and its pipeline sends (--no-overlap-grad-reduce); default: the plan's")
    sim.add_argument("--trace", default=None, help="write the timeline as a Chrome trace JSON")
    sim.set_defaults(fn=_cmd_simulate)
    add_search_parsers(sub, model_args, _graph)
    add_run_parser(sub)
    add_calibrate_parsers(sub)
    add_export_parser(sub)
    topo = sub.add_parser("topology", help="topology tools")
    tsub = topo.add_subparsers(dest="action", required=True)
    tshow = tsub.add_parser("show", help="print a topology: preset name or JSON file")
    tshow.add_argument("name")
    tshow.add_argument("--json", action="store_true", help="print its JSON")
    tshow.set_defaults(fn=_cmd_topology)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except (PlanError, TraceError, ModelLoadError, ValueError, SpawnError) as e:
        print(f"soapsearch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head: not an error
        sys.stderr.close()
        return 0
    except OSError as e:  # a file that cannot be read or written: its name and why, no traceback
        print(f"soapsearch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("soapsearch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
