"""Rule of RMSNorm: ``F.rms_norm`` and ``nn.RMSNorm`` as one op kind, ``"rms_norm"``."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import OpNode
from strategies.region import Box
from strategies.rules.base import Reduce, no_reduce, register
from strategies.rules.conv import param_tensors
from strategies.rules.norm import LayerNorm


@register("rms_norm")
class RMSNorm(LayerNorm):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): y = x / sqrt(mean(x², normalized dims) + eps) · w,
    the mean over the trailing ``normalized_shape`` dims, which therefore stay whole; every
    leading dim may be cut and reads only its own rows (torch ``F.rms_norm``): LayerNorm's dims
    and regions, its own arithmetic.

    attrs:
      * ``normalized_shape``: list of ints, the trailing dims normalized over;
      * ``eps``: float, or None for torch's default ``torch.finfo(x.dtype).eps``;
      * ``param_inputs``: ``["weight"]`` when the weight came as a tensor input to F.rms_norm
        (then it is input 1), absent or empty otherwise.
    Weight role ``"weight"`` (shape ``normalized_shape``) for a module's own weight. The
    torch.export adapter maps ``aten.rms_norm(x, normalized_shape, weight, eps)`` here."""

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        p = param_tensors(node, inputs, weights)
        return F.rms_norm(inputs[0], tuple(node.attrs["normalized_shape"]), p.get("weight"),
                          node.attrs["eps"])
