"""Executor overhead: the data-parallel plan run by soapsearch's executor vs torch's
DistributedDataParallel, same model, batch and optimizer (SGD), 2 gloo processes on this
machine. Prints the median iteration ms of each and their ratio. Asserts nothing.

    python benchmarks/executor_vs_ddp.py [--models mlp,alexnet,resnet101] [--variant tiny]
        [--batch-size 32] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from soapsearch.executor import Executor, TrainConfig, build_model, make_optimizer
from strategies import data_parallel


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
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
    if rank == 0:
        torch.save(rows, Path(out) / "rows.pt")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="mlp,alexnet,resnet101,gpt")
    ap.add_argument("--variant", default="tiny")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, port, args, d), nprocs=2, join=True)
        rows = torch.load(Path(d) / "rows.pt")
    print(f"data parallel on 2 gloo processes, {args.variant} variant, batch {args.batch_size}, "
          f"median of {args.steps} steps")
    print(f"{'model':12s} {'executor ms':>12s} {'DDP ms':>9s} {'ratio':>7s}")
    for name, ours, theirs in rows:
        print(f"{name:12s} {ours:12.1f} {theirs:9.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
