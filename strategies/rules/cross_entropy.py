"""Vocab-parallel cross-entropy: Megatron-LM's parallel cross-entropy (Shoeybi et al. 2019,
``megatron/core/tensor_parallel/cross_entropy.py``) for a loss partition that holds classes
[lo, hi) of the logits and every sample of its box. It never gathers the logits; the class
shards (the partitions that hold the same samples and split the classes) share two small sums:

1. m_i = max over the shards of each shard's max_c x_ic (one all-gather of the maxima);
2. Σ over the shards of [Σ_c exp(x_ic - m_i), x_i,t - m_i (0 where the target t is outside
   the shard's range), w_t (the target's class weight, 0 outside), Σ_c w_c·(x_ic - m_i) (label
   smoothing)] and Σ_c w_c (one sum; the last two only with label smoothing, w_t only with class
   weights).

Then ℓ_i = (1 - ε)·w_t·(log S_i - z_it) + (ε / C)·(W·log S_i - Σ_c w_c·z_ic) with z = x - m,
S_i = Σ_c exp(z_ic) and W = Σ_c w_c (w = 1 without class weights; ε the label smoothing), which
is torch's ``F.cross_entropy`` per sample; ignored samples count 0.

The gradient is local: each summed term is its total in value and this shard's own term in
gradient (``total + (own - own.detach())``), and m is a detached shift, so autograd gives
dℓ_i/dx_ic = (1 - ε)·w_t·(softmax_ic - [c = t]) + (ε / C)·(W·softmax_ic - w_c) for the
shard's own classes only: Megatron's softmax − one-hot, with no collective in backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from strategies.rules.base import Reduce, no_reduce

__all__ = ["ClassShards", "LOCAL", "CLASS_SUMS", "class_sum_terms", "parallel_cross_entropy"]

CLASS_SUMS = ("class_max", "class_sum")
"""The names of a class-cut loss's reductions over its class shards (``Loss.reductions``)."""


class ClassShards(NamedTuple):
    """The collectives over a loss partition's class shards, elementwise over the shards'
    tensors of one shape, the same result on every shard."""

    max: Reduce
    sum: Reduce


LOCAL = ClassShards(no_reduce, no_reduce)
"""A partition that holds every class: nothing to share."""


def class_sum_terms(weighted: bool, smoothing: bool) -> int:
    """Per-sample terms of the shards' sum (step 2 of the module docstring): S, z_t, then w_t
    with class weights and Σ w·z with label smoothing."""
    return 2 + int(weighted) + int(smoothing)


def _own(total: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``total`` in value, ``own``'s gradient (exact: own - own.detach() is 0)."""
    return total + (own - own.detach())


def parallel_cross_entropy(x: torch.Tensor, target: torch.Tensor, classes: tuple[int, int],
                           num_classes: int, weight: torch.Tensor | None, ignore_index: int,
                           label_smoothing: float, shards: ClassShards) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_i ℓ_i, Σ_i w_t) over the samples of ``target`` (kept ones only) for the partition
    holding logits ``x`` [N, hi - lo, ...] of classes ``classes`` = (lo, hi) of ``num_classes``,
    and ``weight`` rows [lo, hi) when the loss has class weights (module docstring)."""
    lo, hi = classes
    keep = target != ignore_index
    mine = keep & (target >= lo) & (target < hi)
    local = (target - lo).masked_fill(~mine, 0).unsqueeze(1)
    m = shards.max(x.detach().amax(1))
    z = x - m.unsqueeze(1)
    own = [z.exp().sum(1), z.gather(1, local).squeeze(1) * mine]
    if weight is not None:
        own.append(weight[local.squeeze(1)] * mine)
    smoothing = label_smoothing > 0
    if smoothing:
        w = weight.view(1, -1, *([1] * (x.dim() - 2))) if weight is not None else None
        own.append((z * w).sum(1) if w is not None else z.sum(1))
    stacked = torch.stack(own)
    flat = stacked.detach().flatten()
    if smoothing and weight is not None:
        flat = torch.cat([flat, weight.detach().sum().reshape(1)])
    total = shards.sum(flat)
    terms = [_own(t, o) for t, o in zip(total[:stacked.numel()].view_as(stacked), own)]
    lse, zt = terms[0].log(), terms[1]
    keep_f = keep.to(x.dtype)
    wt = terms[2] if weight is not None else keep_f
    loss = (1 - label_smoothing) * wt * (lse - zt)
    if smoothing:
        big_w = _own(total[-1], weight.sum()) if weight is not None else float(num_classes)
        loss = loss + (label_smoothing / num_classes) * (big_w * lse - terms[-1]) * keep_f
    count = wt.detach().sum() if weight is not None else keep_f.sum()
    return loss.sum(), count
