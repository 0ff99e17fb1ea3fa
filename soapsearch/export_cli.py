"""``soapsearch export plan.json --format dtensor``: a plan as a ``parallelize_module`` plan
(``soapsearch/export_dtensor.py``) written as a Python file (``soapsearch/_dtensor_source.py``)."""

from __future__ import annotations

from soapsearch import zoo
from soapsearch.models import load_model
from soapsearch.trace import trace
from strategies.serialize import atomic_write_text, check_writable, parse_plan, read_plan

__all__ = ["add_export_parser"]

FORMATS = ("dtensor",)


def _model_of(recorded: str, flag: str | None, variant: str | None) -> tuple[str, str]:
    """(MODEL, variant): the flags, else the zoo name and variant the plan records (``gpt-tiny``)."""
    if flag is not None:
        return flag, variant or "default"
    name, _, var = recorded.rpartition("-")
    if recorded in zoo.names():
        return recorded, variant or "default"
    if name in zoo.names() and var in zoo.VARIANTS:
        return name, variant or var
    raise ValueError(f"the plan's model {recorded!r} is no zoo model: give --model (its "
                     "file.py:factory or package.module:factory)")


def _cmd_export(args) -> int:
    from soapsearch._dtensor_source import python_source
    from soapsearch.export_dtensor import dtensor_plan, module_names

    check_writable(args.output)
    obj, _, _ = parse_plan(args.plan)
    recorded = obj["model"]
    model, variant = _model_of(str(recorded.get("name", "?")), args.model, args.variant)
    batch = args.batch_size if args.batch_size is not None else recorded.get("batch_size")
    spec = load_model(model, variant=variant, batch_size=batch, device="meta" if ":" not in model else None)
    graph = trace(spec.model, spec.example_inputs, name=spec.name, capture=recorded.get("capture", "fx"))
    strategy = read_plan(args.plan, graph).strategy
    plan = dtensor_plan(graph, strategy, module_names(spec.model))
    atomic_write_text(args.output, python_source(plan, str(args.plan)))
    print(f"wrote {len(plan.styles)} ParallelStyles for {graph.name} (TP = {plan.tp}, DP = {plan.dp}) "
          f"to {args.output}")
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a plan in another framework's form (--format dtensor: "
                                      "torch's parallelize_module plan)")
    p.add_argument("plan", help="strategy JSON")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="dtensor: a Python file with TP_PLAN (module FQN -> ColwiseParallel / "
                        "RowwiseParallel / SequenceParallel), parallelize(model, mesh) and loss_context() "
                        "(loss_parallel() where the plan cuts the cross-entropy's classes); plans of "
                        "several micro-batches or pipeline stages are refused")
    p.add_argument("-o", "--output", default="tp_plan.py", help="where to write it (default tp_plan.py)")
    p.add_argument("--model", default=None,
                   help="the plan's model (default: the zoo model and variant the plan names)")
    p.add_argument("--variant", default=None, choices=zoo.VARIANTS, help=f"zoo variant, absent: the plan's; {zoo.VARIANTS_HELP}")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the plan's)")
    p.set_defaults(fn=_cmd_export)
