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

    def static_count(self, node: OpNode) -> float | None:
        """The divisor of L known without the data: 1 for a sum, the element count N for a
        mean MSE; None for a mean cross-entropy, whose Σ w_i depends on the targets."""
        if node.attrs["reduction"] == "sum":
            return 1.0
        return float(math.prod(node.shape)) if node.attrs["fn"] == "mse_loss" else None

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        # each partition sums its own w_i·ℓ_i (and w_i); one all-reduce of both gives the global L
        x, target = inputs
        a = node.attrs
        if a["fn"] == "mse_loss":
            total = reduce(F.mse_loss(x, target, reduction="sum"))
            return total if a["reduction"] == "sum" else total / math.prod(node.shape)
        w = weights.get("class_weight")
        local = F.cross_entropy(x, target, weight=w, ignore_index=a["ignore_index"], reduction="sum",
                                label_smoothing=a.get("label_smoothing", 0.0))
        if a["reduction"] == "sum":
            return reduce(local)
        kept = target[target != a["ignore_index"]]
        count = w[kept].sum() if w is not None else torch.tensor(kept.numel(), device=x.device)
        total = reduce(torch.stack([local, count.to(local.dtype)]))
        return total[0] / total[1]
