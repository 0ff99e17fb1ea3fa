"""Sharded state, soapsearch's executor vs torch's own: the ``fsdp`` baseline plan (data
parallel, every weighted op at ZeRO level 3) vs FSDP2's ``fully_shard`` on every transformer
block and then the root module (reshard_after_forward, the default), and the ``zero1`` plan
(ZeRO level 1) vs DistributedDataParallel with ``ZeroRedundancyOptimizer`` (torch's ZeRO-1)
and vs plain DDP. Same model (zoo gpt, dropout 0), batch and optimizer (Adam), 2 gloo
processes; the runs alternate step by step (load from elsewhere falls on all alike), median of
the measured steps. Prints a table; asserts nothing.

    OMP_NUM_THREADS=1 python benchmarks/executor_vs_fsdp.py [--gpt small] [--steps 30]
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from _gloo import spawn_gloo  # benchmarks/_gloo.py: the process-group boilerplate
from executor_vs_ddp import alternate
from soapsearch import trace, zoo
from soapsearch.executor import Executor, TrainConfig, make_optimizer
from strategies import baseline

ADAM = TrainConfig("adam")


def _gpt(args):
    model, inputs = zoo.build("gpt", args.gpt, dropout=0.0)
    return model, tuple(inputs)


def _trainer(model, inputs, opt):
    def step(_):
        opt.zero_grad()
        model(*inputs).backward()
        opt.step()
    return step


def _worker(rank: int, world: int, args: argparse.Namespace) -> list:
    mesh = init_device_mesh("cpu", (world,))
    model, inputs = _gpt(args)
    graph = trace(model, inputs, name=f"gpt-{args.gpt}")
    ours = {name: Executor(graph, baseline(name, graph, world), model.state_dict(), inputs, ADAM)
            for name in ("fsdp", "zero1")}

    fsdp, _ = _gpt(args)
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    ddp_zero = DistributedDataParallel(_gpt(args)[0])
    zero_opt = ZeroRedundancyOptimizer(ddp_zero.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=ADAM.lr)
    ddp = DistributedDataParallel(_gpt(args)[0])
    t = alternate([lambda s: ours["fsdp"].step(seed=s),
                   _trainer(fsdp, inputs, make_optimizer(fsdp.parameters(), ADAM)),
                   lambda s: ours["zero1"].step(seed=s),
                   _trainer(ddp_zero, inputs, zero_opt),
                   _trainer(ddp, inputs, make_optimizer(ddp.parameters(), ADAM))], args.steps)
    return [(f"gpt {args.gpt} fsdp plan vs fully_shard", t[0], t[1]),
            (f"gpt {args.gpt} zero1 plan vs DDP + ZeroRedundancyOptimizer", t[2], t[3]),
            (f"gpt {args.gpt} zero1 plan vs DDP", t[2], t[4])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpt", default="small", help="zoo gpt variant")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = spawn_gloo(_worker, args)
    print(f"2 gloo processes, Adam, median of {args.steps} alternating steps")
    print(f"{'case':>52s} {'executor ms':>12s} {'torch ms':>9s} {'ratio':>7s}")
    for case, ours, theirs in rows:
        print(f"{case:>52s} {ours:12.1f} {theirs:9.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
