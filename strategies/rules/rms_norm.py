"""Rule of RMSNorm: ``F.rms_norm`` and ``nn.RMSNorm`` as one op kind, ``"rms_norm"``."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import Dim, OpNode
from strategies.region import Box, full_box
from strategies.rules.base import Reduce, SplitAll, no_reduce, register
from strategies.rules.conv import param_shape, param_tensors
from strategies.rules.norm import _named


@register("rms_norm")
class RMSNorm(SplitAll):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): y = x / sqrt(mean(x², normalized dims) + eps) · w,
    the mean over the trailing ``normalized_shape`` dims, which therefore stay whole; every
    leading dim may be cut and reads only its own rows (torch ``F.rms_norm``).

    attrs:
      * ``normalized_shape``: list of ints, the trailing dims normalized over;
      * ``eps``: float, or None for torch's default ``torch.finfo(x.dtype).eps``;
      * ``param_inputs``: ``["weight"]`` when the weight came as a tensor input to F.rms_norm
        (then it is input 1), absent or empty otherwise.
    Weight role ``"weight"`` (shape ``normalized_shape``) for a module's own weight. The
    torch.export adapter maps ``aten.rms_norm(x, normalized_shape, weight, eps)`` here."""

    def _normalized(self, node: OpNode) -> range:
        n = len(node.shape)
        return range(n - len(node.attrs["normalized_shape"]), n)

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        norm = self._normalized(node)
        return _named(node, sample, {
            i: ("features" if len(norm) == 1 else f"features{j}", "parameter")
            for j, i in enumerate(norm)})

    def unsplittable(self, node: OpNode) -> set[int]:
        return set(self._normalized(node))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,) + tuple(full_box(param_shape(node, r)) for r in node.attrs.get("param_inputs", ()))

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        return {w.role: full_box(w.spec.shape) for w in node.weights}

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        p = param_tensors(node, inputs, weights)
        return F.rms_norm(inputs[0], tuple(node.attrs["normalized_shape"]), p.get("weight"),
                          node.attrs["eps"])
