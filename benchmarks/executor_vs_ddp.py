"""Executor overhead: the data-parallel plan run by soapsearch's executor vs torch's
DistributedDataParallel, same model, batch and optimizer (SGD), 2 gloo processes on this
machine. For a model with batchnorm a third column runs DDP + SyncBatchNorm, the DDP
configuration that equals one device as the executor does (plain DDP normalizes each process's
half-batch alone); torch's SyncBatchNorm runs on GPUs only (no CPU kernels, and DDP refuses an
nn.SyncBatchNorm on the CPU), so its algorithm and collectives are ported here. The runs alternate
step by step, so load from elsewhere falls on all alike; prints the median iteration ms of each
and the executor's ratio to each. Asserts nothing.

    OMP_NUM_THREADS=1 python benchmarks/executor_vs_ddp.py [--models mlp,alexnet,resnet101,gpt]
        [--variant tiny] [--batch-size 32] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
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


class _SyncBatchNormFn(torch.autograd.Function):
    """torch.nn.modules._functions.SyncBatchNorm's algorithm and collectives on the CPU, where
    torch has no kernels for it (batch_norm_stats, batch_norm_gather_stats_with_counts, ... are
    CUDA-only and nn.SyncBatchNorm refuses a CPU input). Forward: one all_gather of each
    process's [mean, invstd, count] (as torch does on gloo), combined over the whole batch
    (Chan et al. 1979); backward: one all_reduce of the per-channel [Σdy, Σdy·x̂], then
    dx = w·invstd·(dy − Σdy/N − x̂·Σ(dy·x̂)/N); the weight gradients stay local (DDP sums them)."""

    @staticmethod
    def forward(ctx, x, w, b, running_mean, running_var, eps, factor):  # type: ignore[override]
        c = x.shape[1]
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        rows = [torch.empty(2 * c + 1, dtype=x.dtype) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.cat([mean, torch.rsqrt(var + eps), x.new_full((1,), x.numel() // c)]))
        rows = torch.stack(rows)
        means, invstds, counts = rows[:, :c], rows[:, c:2 * c], rows[:, -1:]
        n = counts.sum()
        mean = (counts * means).sum(0) / n
        var = (counts * (invstds.pow(-2) - eps + (means - mean) ** 2)).sum(0) / n
        with torch.no_grad():
            running_mean.mul_(1 - factor).add_(factor * mean)
            running_var.mul_(1 - factor).add_(factor * var * n / (n - 1))
        ctx.save_for_backward(x, w, mean, var)
        ctx.n, ctx.eps = n, eps
        return F.batch_norm(x, mean, var, w, b, False, 0.0, eps)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w, mean, var = ctx.saved_tensors
        _, sum_dyx, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, w, mean, var, None, None, False, ctx.eps, [False, True, True])
        c = x.shape[1]
        total = torch.cat([sum_dy, sum_dyx])
        dist.all_reduce(total)
        invstd = torch.rsqrt(var + ctx.eps)
        ch = lambda t: t[None, :, None, None]  # noqa: E731
        xhat = (x - ch(mean)) * ch(invstd)
        dx = (dy - ch(total[:c] / ctx.n) - xhat * ch(total[c:] / ctx.n)) * ch(invstd * w)
        return dx, sum_dyx, sum_dy, None, None, None, None


class _CpuSyncBatchNorm(nn.BatchNorm2d):
    """A batchnorm (affine, tracking running statistics) that trains as nn.SyncBatchNorm does,
    on the CPU (a BatchNorm2d to DDP, which refuses an nn.SyncBatchNorm there)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                      self.eps, factor)


def sync_batchnorm(model: nn.Module) -> nn.Module | None:
    """``model`` with every BatchNorm2d synchronized (what ``convert_sync_batchnorm`` does on
    GPUs), in place; None when it has none."""
    norms = [m for m in model.modules() if type(m) is nn.BatchNorm2d]
    for m in norms:
        if not (m.affine and m.track_running_stats):
            raise ValueError(f"{m}: the CPU SyncBatchNorm here needs affine=True, track_running_stats=True")
        m.__class__ = _CpuSyncBatchNorm
    return model if norms else None


def _ddp_step(model: nn.Module, local: Sequence[torch.Tensor]) -> Callable[[int], None]:
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(ddp.parameters(), TrainConfig("sgd"))

    def step(_):
        opt.zero_grad()
        ddp(*local).backward()
        opt.step()
    return step


def _worker(rank: int, world: int, args: argparse.Namespace) -> list:
    rows = []
    for name in args.models.split(","):
        built = build_model(name, args.variant, args.batch_size)
        ex = Executor(built.graph, data_parallel(built.graph, world), built.state,
                      built.inputs, TrainConfig("sgd"))
        per = built.inputs[0].shape[0] // world
        local = [x[rank * per:(rank + 1) * per] for x in built.inputs]
        steps = [lambda s: ex.step(seed=s), _ddp_step(built.model, local)]
        synced = sync_batchnorm(build_model(name, args.variant, args.batch_size).model)
        if synced is not None:
            steps.append(_ddp_step(synced, local))
        times = alternate(steps, args.steps)
        rows.append((name, *times, *([None] * (3 - len(times)))))
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
    print(f"{'model':12s} {'executor ms':>12s} {'DDP ms':>9s} {'ratio':>7s} {'DDP+SyncBN ms':>14s} {'ratio':>7s}")
    for name, ours, ddp, synced in rows:
        tail = f"{synced:14.1f} {ours / synced:7.2f}" if synced is not None else f"{'-':>14s} {'-':>7s}"
        print(f"{name:12s} {ours:12.1f} {ddp:9.1f} {ours / ddp:7.2f} {tail}")


if __name__ == "__main__":
    main()
