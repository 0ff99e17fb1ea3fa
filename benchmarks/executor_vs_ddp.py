"""Executor overhead: the data-parallel plan run by soapsearch's executor vs torch's
DistributedDataParallel, same model, batch and optimizer (SGD), 2 gloo processes on this
machine. The two alternate step by step, so load from elsewhere falls on both alike; prints the
median iteration ms of each and their ratio. Asserts nothing.

    OMP_NUM_THREADS=1 python benchmarks/executor_vs_ddp.py [--models mlp,alexnet,resnet101,gpt]
        [--variant tiny] [--batch-size 32] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

from torch.nn.parallel import DistributedDataParallel

from _gloo import spawn_gloo  # benchmarks/_gloo.py: the process-group boilerplate
from soapsearch.executor import Executor, TrainConfig, build_model, make_optimizer
from strategies import data_parallel


def alternate(steps: Sequence[Callable[[int], object]], n: int, warmup: int = 2) -> list[float]:
    """Median ms of each of ``steps`` over ``n`` rounds that run each once in turn (after
    ``warmup`` rounds)."""
    times: list[list[float]] = [[] for _ in steps]
    for s in range(warmup + n):
        for step, out in zip(steps, times):
            t0 = time.perf_counter()
            step(s)
            out.append(time.perf_counter() - t0)
    return [statistics.median(t[warmup:]) * 1e3 for t in times]


def _worker(rank: int, world: int, args: argparse.Namespace) -> list:
    rows = []
    for name in args.models.split(","):
        built = build_model(name, args.variant, args.batch_size)
        ex = Executor(built.graph, data_parallel(built.graph, world), built.model.state_dict(),
                      built.inputs, TrainConfig("sgd"))
        per = built.inputs[0].shape[0] // world
        local = [x[rank * per:(rank + 1) * per] for x in built.inputs]
        ddp = DistributedDataParallel(built.model)
        opt = make_optimizer(ddp.parameters(), TrainConfig("sgd"))

        def ddp_step(_):
            opt.zero_grad()
            ddp(*local).backward()
            opt.step()

        rows.append((name, *alternate([lambda s: ex.step(seed=s), ddp_step], args.steps)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="mlp,alexnet,resnet101,gpt")
    ap.add_argument("--variant", default="tiny")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = spawn_gloo(_worker, args)
    print(f"data parallel on 2 gloo processes, {args.variant} variant, batch {args.batch_size}, "
          f"median of {args.steps} alternating steps")
    print(f"{'model':12s} {'executor ms':>12s} {'DDP ms':>9s} {'ratio':>7s}")
    for name, ours, theirs in rows:
        print(f"{name:12s} {ours:12.1f} {theirs:9.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
