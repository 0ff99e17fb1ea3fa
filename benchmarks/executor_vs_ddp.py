"""Executor overhead: the data-parallel plan run by soapsearch's executor vs torch's
DistributedDataParallel, same model, batch and optimizer (SGD), 2 gloo processes on this
machine. Prints the median iteration ms of each and their ratio. Asserts nothing.

    python benchmarks/executor_vs_ddp.py [--models mlp,alexnet,resnet101] [--variant tiny]
        [--batch-size 32] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch.nn.parallel import DistributedDataParallel

from _gloo import spawn_gloo  # benchmarks/_gloo.py: the process-group boilerplate
from soapsearch.executor import Executor, TrainConfig, build_model, make_optimizer
from strategies import data_parallel


def _worker(rank: int, world: int, args: argparse.Namespace) -> list:
    rows = []
    for name in args.models.split(","):
        built = build_model(name, args.variant, args.batch_size)
        ex = Executor(built.graph, data_parallel(built.graph, world), built.model.state_dict(),
                      built.inputs, TrainConfig("sgd"))
        ours = []
        for s in range(args.steps + 2):
            t0 = time.perf_counter()
            ex.step(seed=s)
            ours.append(time.perf_counter() - t0)
        per = built.inputs[0].shape[0] // world
        local = [x[rank * per:(rank + 1) * per] for x in built.inputs]
        ddp = DistributedDataParallel(built.model)
        opt = make_optimizer(ddp.parameters(), TrainConfig("sgd"))
        theirs = []
        for _ in range(args.steps + 2):
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(*local).backward()
            opt.step()
            theirs.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(ours[2:]) * 1e3, statistics.median(theirs[2:]) * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="mlp,alexnet,resnet101,gpt")
    ap.add_argument("--variant", default="tiny")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rows = spawn_gloo(_worker, args)
    print(f"data parallel on 2 gloo processes, {args.variant} variant, batch {args.batch_size}, "
          f"median of {args.steps} steps")
    print(f"{'model':12s} {'executor ms':>12s} {'DDP ms':>9s} {'ratio':>7s}")
    for name, ours, theirs in rows:
        print(f"{name:12s} {ours:12.1f} {theirs:9.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
