"""Tensor parallelism: a plan that cuts every linear of an MLP on its parameter dim
(out_features; the OWT baseline, whose ReLUs follow the cut) run by soapsearch's executor vs the
same layout through torch.distributed.tensor.parallel.parallelize_module (ColwiseParallel on
each linear, outputs gathered to Replicate so the next linear reads the whole input, as the
plan's next linear does). 2 gloo processes, SGD; the two alternate step by step (load from
elsewhere falls on both alike), median of the measured steps. Prints a table; asserts nothing.

    OMP_NUM_THREADS=1 python benchmarks/executor_vs_dtensor.py [--widths 256,1024] [--batch-size 64]
        [--steps 30]
"""

from __future__ import annotations

import argparse

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from _gloo import spawn_gloo  # benchmarks/_gloo.py: the process-group boilerplate
from executor_vs_ddp import alternate
from soapsearch import trace, zoo
from soapsearch.executor import Executor, TrainConfig, make_optimizer
from strategies import owt


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
        rows.append((width, ours, theirs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--widths", default="256,1024")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = spawn_gloo(_worker, args)
    print(f"every linear cut on out_features, 2 gloo processes, MLP 4 linears, batch "
          f"{args.batch_size}, median of {args.steps} alternating steps")
    print(f"{'width':>6s} {'executor ms':>12s} {'DTensor ms':>11s} {'ratio':>7s}")
    for width, ours, theirs in rows:
        print(f"{width:6d} {ours:12.1f} {theirs:11.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
