"""Batchnorm partitions in training, run as torch runs them. The op rule
(strategies/rules/norm.py) writes the same math as explicit sums and stays the ground truth;
this is its fast form, which also keeps the running statistics.

- A partition alone in its reduction group holds the whole batch of its channels: torch's
  ``F.batch_norm`` in training mode gives its output and updates its running statistics, the
  very call ``nn.BatchNorm2d`` makes.
- A partition whose batch is split over a group runs torch.nn.SyncBatchNorm's algorithm (Ioffe
  & Szegedy 2015 over the whole batch). Forward: each member's count n_i, mean μ_i and biased
  variance σ_i² per channel, gathered in one all-gather (comm.Group) and combined by
  the parallel variance formula (Chan, Golub & LeVeque 1979): N = Σn_i, μ = Σn_i·μ_i / N,
  σ² = Σn_i·(σ_i² + (μ_i − μ)²) / N; then y = (x − μ)·invstd·w + b, invstd = 1/√(σ² + eps).
  Backward: one sum over the group of the per-channel Σdy and Σdy·x̂ (x̂ = (x − μ)·invstd), then
  dx = w·invstd·(dy − Σdy/N − x̂·Σ(dy·x̂)/N); dw = Σdy·x̂ and db = Σdy stay this member's own,
  as the gradient sync sums the weight's replicas.

Running statistics follow torch: r_mean = (1−f)·r_mean + f·μ, r_var = (1−f)·r_var +
f·σ²·N/(N−1) (the unbiased variance), f = momentum, or 1/num_batches_tracked when momentum is
None (a cumulative average).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from soapsearch.executor.comm import Group
from strategies.graph import OpNode

__all__ = ["batch_norm"]

_DIMS = (0, 2, 3)  # N, H, W of NCHW: what the batch statistics cover


def _channel(t: torch.Tensor) -> torch.Tensor:
    return t[None, :, None, None]


def _stats_dtype(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()  # as torch: fp32 stats


def batch_norm(node: OpNode, x: torch.Tensor, weights: Mapping[str, torch.Tensor], group: Group | None,
               batches_tracked: int) -> torch.Tensor:
    """The output of a training-mode batchnorm partition (input ``x``, weight views by role),
    updating its running statistics when it has them. ``group``: its reduction group (None
    when alone); ``batches_tracked``: the op's num_batches_tracked including this batch."""
    eps, momentum = node.attrs["eps"], node.attrs["momentum"]
    w, b = weights.get("weight"), weights.get("bias")
    r_mean, r_var = weights.get("running_mean"), weights.get("running_var")
    f = 0.0 if r_mean is None else 1.0 / batches_tracked if momentum is None else float(momentum)
    if group is None:
        return F.batch_norm(x, r_mean, r_var, w, b, True, f, eps)
    with torch.no_grad():
        mean, var, n = _group_stats(x, group)
        if r_mean is not None and r_var is not None:
            r_mean.mul_(1 - f).add_(f * mean.to(r_mean.dtype))
            r_var.mul_(1 - f).add_(f * (var * n / (n - 1)).to(r_var.dtype))
    return _SyncNorm.apply(x, w, b, mean, var, n, eps, group)


def _group_stats(x: torch.Tensor, group: Group):
    """(μ, σ², N) per channel over the whole group's batch: every member's row (μ_i, σ_i², n_i)
    gathered, combined by the parallel variance formula."""
    acc = _stats_dtype(x)
    c = x.shape[1]
    var, mean = torch.var_mean(acc, dim=_DIMS, correction=0)
    rows = group.gather(torch.cat([mean, var, acc.new_full((1,), x.numel() // c)]))
    counts, means, variances = rows[:, -1:], rows[:, :c], rows[:, c:2 * c]
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / n
    return mean, var, n


class _SyncNorm(torch.autograd.Function):
    """y = (x − μ)·invstd·w + b with the group's (μ, σ²); its backward is SyncBatchNorm's (see
    the module docstring): one sum over the group, the weight gradients local."""

    @staticmethod
    def forward(ctx, x, w, b, mean, var, n, eps, group):  # type: ignore[override]
        ctx.save_for_backward(x, w, mean, var)
        ctx.n, ctx.eps, ctx.group = n, eps, group
        ctx.bias_dtype = b.dtype if b is not None else None
        y = F.batch_norm(_stats_dtype(x), mean, var, w, b, False, 0.0, eps)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w, mean, var = ctx.saved_tensors
        acc, dy_acc = _stats_dtype(x), _stats_dtype(dy)
        _, sum_dyx, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy_acc, acc, w, mean, var, None, None, False, ctx.eps, [False, True, True])
        c = x.shape[1]
        total = ctx.group.sum(torch.cat([sum_dy, sum_dyx]))
        invstd = torch.rsqrt(var + ctx.eps)
        scale = invstd if w is None else invstd * w
        k = invstd * total[c:] / ctx.n  # x̂·Σ(dy·x̂)/N = (x − μ)·k
        dx = torch.addcmul(dy_acc - _channel(total[:c] / ctx.n), acc - _channel(mean), _channel(-k))
        dx = (dx * _channel(scale)).to(x.dtype)
        return (dx, sum_dyx.to(w.dtype) if w is not None else None,
                sum_dy.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None,
                None, None, None, None, None)
