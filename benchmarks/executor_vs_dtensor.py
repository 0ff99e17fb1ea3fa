"""Tensor parallelism, soapsearch's executor vs torch.distributed.tensor.parallel.parallelize_module
on the same layout. 2 gloo processes, SGD; the runs alternate step by step (load from elsewhere
falls on all alike), median of the measured steps. Prints a table; asserts nothing.

- MLP: every linear cut on out_features (the OWT baseline, whose ReLUs follow the cut) vs
  ColwiseParallel on each linear, outputs gathered to Replicate so the next linear reads the
  whole input, as the plan's next linear does.
- zoo gpt, the megatron plan with tp 2 each way, as ``soapsearch export --format dtensor``
  writes it for DTensor: without sequence parallelism (the executor's ops between the blocks cut
  on the samples) vs ColwiseParallel/RowwiseParallel with Replicate layouts (those ops run
  replicated on both ranks, the row linears all-reduce); with sequence parallelism vs
  + SequenceParallel (norms and dropouts on Shard(1), reduce-scatter / all-gather at the blocks'
  edges). The lm_head column-parallel on the vocabulary in both; the loss under the exported
  file's ``loss_context()``. Dropout 0 everywhere.

    OMP_NUM_THREADS=1 python benchmarks/executor_vs_dtensor.py [--widths 256,1024] [--batch-size 64]
        [--gpt small] [--steps 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from _gloo import spawn_gloo  # benchmarks/_gloo.py: the process-group boilerplate
from executor_vs_ddp import alternate
from soapsearch import trace, zoo
from soapsearch.executor import Executor, TrainConfig, make_optimizer
from soapsearch._dtensor_source import python_source
from soapsearch.export_dtensor import dtensor_plan, module_names
from strategies import baseline, owt


def _mlp(width: int, batch: int):
    return zoo.build("mlp", "tiny", batch_size=batch, in_features=width, hidden=(width,) * 3,
                     num_classes=width)


def _worker(rank: int, world: int, args: argparse.Namespace) -> list:
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        model, inputs = _mlp(width, args.batch_size)
        graph = trace(model, inputs, name=f"mlp{width}")
        ex = Executor(graph, owt(graph, world), model.state_dict(), tuple(inputs), TrainConfig("sgd"))
        model, inputs = _mlp(width, args.batch_size)
        plan = {name: ColwiseParallel(output_layouts=Replicate())
                for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        tp = parallelize_module(model, mesh, plan)
        opt = make_optimizer(tp.parameters(), TrainConfig("sgd"))

        def step(_):
            opt.zero_grad()
            tp(*inputs).backward()
            opt.step()

        ours, theirs = alternate([lambda s: ex.step(seed=s), step], args.steps)
        rows.append((f"mlp {width}", ours, theirs))
    if args.gpt:
        rows += _gpt_rows(mesh, world, args)
    return rows


def _gpt(args):
    model, inputs = zoo.build("gpt", args.gpt, dropout=0.0)
    return model, tuple(inputs)


def _exported(graph, model, strategy):
    """The module ``soapsearch export --format dtensor`` writes for ``strategy``, imported."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tp_plan.py"
        path.write_text(python_source(dtensor_plan(graph, strategy, module_names(model)), "megatron"))
        spec = importlib.util.spec_from_file_location("tp_plan", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def _trainer(model, inputs, loss_context):
    opt = make_optimizer(model.parameters(), TrainConfig("sgd"))

    def step(_):
        opt.zero_grad()
        with loss_context():  # the exported file's: loss_parallel() where the loss is class-cut
            model(*inputs).backward()
        opt.step()
    return step


def _gpt_rows(mesh, world: int, args) -> list:
    model, inputs = _gpt(args)
    graph = trace(model, inputs, name=f"gpt-{args.gpt}")
    steps = []
    for sp in (False, True):
        plan = baseline("megatron", graph, world, tp=world, sequence_parallel=sp)
        ex = Executor(graph, plan, model.state_dict(), inputs, TrainConfig("sgd"))
        exported = _exported(graph, model, plan)
        tp, _ = _gpt(args)
        exported.parallelize(tp, mesh)
        steps += [lambda s, ex=ex: ex.step(seed=s), _trainer(tp, inputs, exported.loss_context)]
    t = alternate(steps, args.steps)
    return [(f"gpt {args.gpt} megatron vs Colwise/Rowwise", t[0], t[1]),
            (f"gpt {args.gpt} megatron sp vs + SequenceParallel", t[2], t[3])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--widths", default="256,1024")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--gpt", default="small", help="zoo gpt variant ('' to skip)")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = spawn_gloo(_worker, args)
    print(f"2 gloo processes, median of {args.steps} alternating steps; MLP: 4 linears cut on "
          f"out_features, batch {args.batch_size}; gpt: the megatron plan, tp 2, without and with "
          "sequence parallelism")
    print(f"{'case':>44s} {'executor ms':>12s} {'DTensor ms':>11s} {'ratio':>7s}")
    for case, ours, theirs in rows:
        print(f"{case:>44s} {ours:12.1f} {theirs:11.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
