"""Scans: ``cumsum`` and ``cumprod`` along one dim (OPT numbers its positions with a cumsum of
the attention mask)."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from strategies.graph import OpNode
from strategies.region import Box
from strategies.rules.base import Reduce, SplitAll, no_reduce, register

__all__ = ["SCANS"]

SCANS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod}
"""Functions a scan op may name in ``attrs["fn"]``, called as fn(x, dim, dtype=...)."""


@register("scan")
class Scan(SplitAll):
    """out = fn(x, dim) (attrs ``fn``, ``dim`` >= 0, ``dtype`` or None): element i along ``dim``
    depends on elements 0..i, so that dim is never cut (a cut would need the running total of
    the pieces before it); every other dim splits and reads the same box of x."""

    def unsplittable(self, node: OpNode) -> set[int]:
        return {node.attrs["dim"]}

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        dtype = None if a["dtype"] is None else getattr(torch, a["dtype"])
        return SCANS[a["fn"]](inputs[0], a["dim"], dtype=dtype)
