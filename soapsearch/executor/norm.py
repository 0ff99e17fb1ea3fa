"""Batchnorm's running statistics, which the op rule leaves alone (strategies/rules/norm.py):
after each micro-batch's forward, every partition updates its channels' replica as torch's
``F.batch_norm`` does in training (Ioffe & Szegedy 2015, eq. in Alg. 2; torch keeps the
unbiased variance): r_mean = (1-f)·r_mean + f·mean, r_var = (1-f)·r_var + f·var·n/(n-1),
with f = momentum, or 1/num_batches_tracked when momentum is None (a cumulative average).
The statistics are read from the rule's two reductions (after the all-reduce): the first
sums x per channel plus the element count n, the second sums (x - mean)² per channel."""

from __future__ import annotations

from typing import Sequence

import torch

from soapsearch.executor.shards import LocalWeights
from strategies.graph import OpNode
from strategies.region import Box
from strategies.rules.norm import uses_batch_stats

__all__ = ["update_running_stats"]


def update_running_stats(node: OpNode, box: Box, record: Sequence[torch.Tensor],
                         weights: LocalWeights, batches_tracked: int) -> None:
    """Update this partition's slice (channels ``box[1]``) of ``node``'s running statistics."""
    rm, rv = node.weight("running_mean"), node.weight("running_var")
    if rm is None or rv is None or not node.attrs["training"] or not uses_batch_stats(node):
        return
    if len(record) != 2:
        raise RuntimeError(f"op {node.name!r}: expected the batchnorm rule's 2 reductions, saw {len(record)}")
    total, squares = record
    n = total[-1]
    mean, var = total[:-1] / n, squares / n
    momentum = node.attrs["momentum"]
    f = 1.0 / batches_tracked if momentum is None else float(momentum)
    with torch.no_grad():
        r_mean, r_var = weights.view(rm.name, (box[1],)), weights.view(rv.name, (box[1],))
        r_mean.mul_(1 - f).add_(f * mean.to(r_mean.dtype))
        r_var.mul_(1 - f).add_(f * (var * n / (n - 1)).to(r_var.dtype))
