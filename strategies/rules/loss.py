"""Rules of the losses: cross_entropy and mse_loss. The op outputs the scalar loss; its dims are
those of the per-sample losses (the targets of a cross-entropy, the input of an MSE)."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import Dim, OpNode
from strategies.region import Box
from strategies.rules.base import Reduce, Reduction, SplitAll, dim_named, no_reduce, register


@register("loss")
class Loss(SplitAll):
    """mean L = Σ w_i·ℓ_i / Σ w_i (torch; w_i: weight of class y_i, 0 if ignored); sum L = Σ w_i·ℓ_i."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        return tuple(dim_named(i, sample, f"d{i}", "attribute", s) for i, s in enumerate(node.shape))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        if node.attrs["fn"] == "cross_entropy":
            classes = (0, node.input_specs[0].shape[1])
            return (box[:1] + (classes,) + box[1:], box)
        return (box, box)

    def reductions(self, node: OpNode, degrees: Sequence[int]) -> tuple[Reduction, ...]:
        over = tuple(i for i, d in enumerate(degrees) if d > 1)
        return (Reduction("loss_sum", over, deferred=True),) if over else ()

    def static_count(self, node: OpNode, microbatches: int = 1) -> float | None:
        """The divisor C_j of one micro-batch's L_j known without the data: 1 for a sum, the
        micro-batch's element count N/m for a mean MSE (the step's (1/m)·Σ_j S_j/(N/m) is then
        Σ S/N, one device's mean); None for a mean cross-entropy, whose Σ w_i depends on the
        targets."""
        if node.attrs["reduction"] == "sum":
            return 1.0
        return math.prod(node.shape) / microbatches if node.attrs["fn"] == "mse_loss" else None

    def partial(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_p, c_p) of the partition computing ``box``: s_p = Σ_{i∈p} w_i·ℓ_i (differentiable)
        and c_p = Σ_{i∈p} w_i (no gradient), as torch sums them (cross-entropy: class weights,
        ignore_index, label smoothing; MSE: w_i = 1 per element). L = Σ_p s_p / C, with
        C = ``static_count`` when known, else Σ_p c_p."""
        x, target = inputs
        a = node.attrs
        if a["fn"] == "mse_loss":
            s = F.mse_loss(x, target, reduction="sum")
            return s, s.new_tensor(float(x.numel()))
        w = weights.get("class_weight")
        s = F.cross_entropy(x, target, weight=w, ignore_index=a["ignore_index"], reduction="sum",
                            label_smoothing=a.get("label_smoothing", 0.0))
        with torch.no_grad():  # masks, not boolean indexing (which syncs on a data-dependent size)
            keep = target != a["ignore_index"]
            count = keep.sum() if w is None else (w[target.masked_fill(~keep, 0)] * keep).sum()
        return s, count.to(s.dtype)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        """L = Σ_p s_p / Σ_p c_p (``partial``) over the partitions ``reduce`` sums, which may be
        one micro-batch's: the count is summed with the losses (a sum: C = 1, s_p alone)."""
        s, c = self.partial(node, box, inputs, weights)
        if node.attrs["reduction"] == "sum":
            return reduce(s)
        total = reduce(torch.stack([s, c]))
        return total[0] / total[1]
