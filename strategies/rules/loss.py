"""Rules of the losses: cross_entropy and mse_loss. The op outputs the scalar loss; its dims are
those of the per-sample losses (the targets of a cross-entropy, the input of an MSE) and, for a
cross-entropy, the classes it sums over (log-sum-exp): an R dim whose cut is Megatron-LM's
vocab-parallel cross-entropy (``strategies.rules.cross_entropy``)."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import Dim, OpNode
from strategies.region import Box
from strategies.rules.base import Reduce, Reduction, SplitAll, dim_named, no_reduce, register
from strategies.rules.cross_entropy import CLASS_SUMS, LOCAL, ClassShards, parallel_cross_entropy


@register("loss")
class Loss(SplitAll):
    """mean L = Σ w_i·ℓ_i / Σ w_i (torch; w_i: weight of class y_i, 0 if ignored); sum L = Σ w_i·ℓ_i.

    A cross-entropy's last dim is ``classes`` (role reduction): a partition of a class cut reads
    its classes [lo, hi) of the logits (and of the class weights) and the whole target of its
    samples, computes every ℓ_i of them with its class shards' sums (``CLASS_SUMS``, before its
    output: ``strategies.rules.cross_entropy``) and backpropagates its own classes' gradient.
    Only the shard with lo = 0 counts the samples: the others output s_p = 0 in value (their
    gradient kept) and c_p = 0, so the ``loss_sum`` over every cut dim sums each sample once."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        per_sample = tuple(dim_named(i, sample, f"d{i}", "attribute", s) for i, s in enumerate(node.shape))
        if node.attrs["fn"] == "cross_entropy":
            return per_sample + (Dim("classes", node.input_specs[0].shape[1], "reduction"),)
        return per_sample

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        if node.attrs["fn"] == "cross_entropy":
            return (box[:1] + (box[-1],) + box[1:-1], box[:-1])
        return (box, box)

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        return {w.role: (box[-1],) for w in node.weights}  # a cross-entropy's class weights

    def reductions(self, node: OpNode, degrees: Sequence[int]) -> tuple[Reduction, ...]:
        over = tuple(i for i, d in enumerate(degrees) if d > 1)
        classes = len(degrees) - 1
        shards = tuple(Reduction(name, (classes,)) for name in CLASS_SUMS) \
            if node.attrs["fn"] == "cross_entropy" and degrees[classes] > 1 else ()
        return shards + ((Reduction("loss_sum", over, deferred=True),) if over else ())

    def static_count(self, node: OpNode, microbatches: int = 1) -> float | None:
        """The divisor C_j of one micro-batch's L_j known without the data: 1 for a sum, the
        micro-batch's element count N/m for a mean MSE (the step's (1/m)·Σ_j S_j/(N/m) is then
        Σ S/N, one device's mean); None for a mean cross-entropy, whose Σ w_i depends on the
        targets."""
        if node.attrs["reduction"] == "sum":
            return 1.0
        return math.prod(node.shape) / microbatches if node.attrs["fn"] == "mse_loss" else None

    def partial(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], shards: ClassShards = LOCAL
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_p, c_p) of the partition computing ``box``: s_p = Σ_{i∈p} w_i·ℓ_i (differentiable)
        and c_p = Σ_{i∈p} w_i (no gradient), as torch sums them (cross-entropy: class weights,
        ignore_index, label smoothing; MSE: w_i = 1 per element). L = Σ_p s_p / C, with
        C = ``static_count`` when known, else Σ_p c_p. A partition of a class cut shares its
        class shards' sums through ``shards`` (the class docstring)."""
        x, target = inputs
        a = node.attrs
        if a["fn"] == "mse_loss":
            s = F.mse_loss(x, target, reduction="sum")
            return s, s.new_tensor(float(x.numel()))
        w = weights.get("class_weight")
        lo, hi = box[-1]
        num_classes = node.input_specs[0].shape[1]
        if (lo, hi) != (0, num_classes):
            s, count = parallel_cross_entropy(x, target, (lo, hi), num_classes, w, a["ignore_index"],
                                              a.get("label_smoothing", 0.0), shards)
            if lo > 0:  # one shard counts the samples; the others keep only their gradient
                return s - s.detach(), torch.zeros_like(count)
            return s, count.to(s.dtype)
        s = F.cross_entropy(x, target, weight=w, ignore_index=a["ignore_index"], reduction="sum",
                            label_smoothing=a.get("label_smoothing", 0.0))
        with torch.no_grad():  # masks, not boolean indexing (which syncs on a data-dependent size)
            keep = target != a["ignore_index"]
            count = keep.sum() if w is None else (w[target.masked_fill(~keep, 0)] * keep).sum()
        return s, count.to(s.dtype)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce,
                shards: ClassShards = LOCAL) -> torch.Tensor:
        """L = Σ_p s_p / Σ_p c_p (``partial``) over the partitions ``reduce`` sums, which may be
        one micro-batch's: the count is summed with the losses (a sum: C = 1, s_p alone)."""
        s, c = self.partial(node, box, inputs, weights, shards)
        if node.attrs["reduction"] == "sum":
            return reduce(s)
        total = reduce(torch.stack([s, c]))
        return total[0] / total[1]
