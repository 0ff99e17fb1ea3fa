"""``soapsearch calibrate`` and ``soapsearch compare`` (registered by ``add_calibrate_parsers``)."""

from __future__ import annotations

import argparse
import json

from soapsearch.zoo import VARIANTS, VARIANTS_HELP

__all__ = ["add_calibrate_parsers"]


def _calibrate(args: argparse.Namespace) -> int:
    from soapsearch import zoo
    from soapsearch.calibrate.measure import calibrate, report_path

    if args.model is not None and args.model in zoo.names():
        zoo.config(args.model, args.variant)  # a bad variant fails now, not after minutes of measuring
    topo = calibrate(args.nproc, args.backend, model=args.model, out=args.output, variant=args.variant,
                     overhead_rounds=args.overhead_rounds, cost_model=args.cost_model)
    report = json.loads(report_path(args.output).read_text())
    print(topo.describe())
    print(f"alpha {report['alpha'] * 1e6:.1f} µs, bandwidth {report['bandwidth'] / 1e9:.3g} GB/s "
          f"(r² {report['r2']:.3f}); "
          + (f"a send holds the sender {report['send_latency'] * 1e6:.0f} µs + bytes at "
             f"{report['send_bandwidth'] / 1e9:.3g} GB/s"
             + ("" if report.get("hold_sends") else " (reported, not on the links)") + "; "
             if report.get("send_bandwidth") else "")
          + f"all-reduce measured/ring {report['allreduce_ratio']:.2f}"
          + (f", ring bandwidth {report['collective_bandwidth'] / 1e9:.3g} GB/s (r² {report['collective_r2']:.3f}); "
             if report["collective_bandwidth"] else "; ")
          + f"FLOP/s per process alone {', '.join(f'{f / 1e9:.1f}G' for f in report['solo_flops'])}, "
          f"all at once {', '.join(f'{f / 1e9:.1f}G' for f in report['flops'])}; "
          f"copy GB/s alone {', '.join(f'{b / 1e9:.1f}' for b in report['solo_memory_bandwidth'])}, "
          f"all at once {', '.join(f'{b / 1e9:.1f}' for b in report['memory_bandwidth'])} "
          f"(contention {report['contention']:.2f}x); products at half the peak at "
          f"{report['gemm_half']:.3g} rows; "
          f"op overhead {report['op_overhead'] * 1e6:.1f} µs; kind {report['kind']}")
    print(f"executor overheads: {report['task_overhead'] * 1e6:.0f} µs per partition task, "
          f"{report['message_overhead'] * 1e6:.0f} µs per received piece (beyond the link), "
          f"{report['exchange_overhead'] * 1e6:.0f} µs per exchanged piece, "
          f"{report['collective_overhead'] * 1e6:.0f} µs per collective per member (beyond the ring), "
          f"beyond the {report['cost_model']} cost model's kernel times"
          + (f" (profile cache {report['profile_cache']})" if report["profile_cache"] else ""))
    print(f"wrote {args.output} and {report_path(args.output)}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from soapsearch.calibrate.compare import compare

    r = compare(args.plan, args.model, args.topology, variant=args.variant, steps=args.steps,
                warmup=args.warmup, cost_model=args.cost_model, trace_dir=args.trace_dir)
    print(json.dumps(r.to_json(), indent=1) if args.json else r.table())
    if args.trace_dir and not args.json:
        print(f"traces in {args.trace_dir}: side_by_side.json (open in https://ui.perfetto.dev)")
    return 0


def add_calibrate_parsers(subparsers) -> None:
    """Add ``calibrate`` and ``compare`` to an argparse subparsers object; each sets ``fn``
    (args -> exit status)."""
    p = subparsers.add_parser("calibrate", help="measure this machine's processes into a topology JSON")
    p.add_argument("--nproc", type=int, required=True, help="processes (devices) to calibrate")
    p.add_argument("--backend", choices=("gloo",), default="gloo",
                   help="gloo: CPU processes (the only backend calibrate measures)")
    p.add_argument("--model", default=None, help="also warm the profiled cost model's cache for this model")
    p.add_argument("--variant", default="tiny", choices=VARIANTS,
                   help=f"zoo variant of --model, default 'tiny': {VARIANTS_HELP}")
    p.add_argument("-o", "--output", required=True, help="topology JSON to write (report beside it)")
    p.add_argument("--overhead-rounds", type=int, default=5,
                   help="rounds of the executor-overhead probe (0: skip, overheads 0)")
    p.add_argument("--cost-model", choices=("analytical", "profiled"), default="analytical",
                   help="fit the executor's overheads beyond this cost model's kernel times (profiled: "
                        "timed into <output stem>.profile.json, which simulate, search and compare "
                        "--cost-model profiled read for this topology)")
    p.set_defaults(fn=_calibrate)
    c = subparsers.add_parser("compare", help="run a plan for real and compare with the simulator")
    c.add_argument("plan", help="strategy JSON")
    c.add_argument("--model", required=True)
    c.add_argument("--variant", default="tiny", choices=VARIANTS,
                   help=f"zoo variant, default 'tiny': {VARIANTS_HELP}")
    c.add_argument("--topology", required=True, help="preset name or topology JSON (soapsearch calibrate)")
    c.add_argument("--cost-model", choices=("analytical", "profiled"), default="analytical")
    c.add_argument("--steps", type=int, default=5, help="measured steps (median)")
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--trace-dir", default=None, help="write simulated and measured Chrome traces here")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_compare)
