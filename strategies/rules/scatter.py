"""The rule of an op that writes a slab of one tensor into another out of place
(``torch.slice_scatter``, ``torch.select_scatter``: what torch.export's functionalization makes
of ``x[:, 1:] = y`` and ``x[:, 0] = v``)."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from strategies.graph import OpNode
from strategies.region import Box
from strategies.rules.base import Reduce, SplitAll, no_reduce, register

__all__ = ["SliceScatter"]


@register("slice_scatter")
class SliceScatter(SplitAll):
    """out = x with rows [start, stop) of ``dim`` replaced by ``src`` (``slice_scatter(x, src,
    dim, start, stop)``, step 1); ``select``: src lacks ``dim`` and fills the one row ``start``
    (``select_scatter(x, src, dim, start)``, stop = start + 1).

    inputs: (x, src); output dims are x's. Every dim may be cut: a partition reads its box of x
    and the part of src that falls in its box (None when none does), and writes that part over
    its copy of x. attrs: ``dim``, ``start``, ``stop`` (ints, 0 <= start <= stop <= size),
    ``select`` (bool)."""

    def _rows(self, node: OpNode, box: Box) -> tuple[int, int] | None:
        """The rows [lo, hi) of ``dim`` the partition computing ``box`` takes from src."""
        a, b = box[node.attrs["dim"]]
        lo, hi = max(a, node.attrs["start"]), min(b, node.attrs["stop"])
        return (lo, hi) if lo < hi else None

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box | None, ...]:
        dim, start, rows = node.attrs["dim"], node.attrs["start"], self._rows(node, box)
        if rows is None:
            return box, None
        inner = () if node.attrs["select"] else ((rows[0] - start, rows[1] - start),)
        return box, box[:dim] + inner + box[dim + 1:]

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        x, src = inputs
        if src is None:
            return x
        dim, (lo, hi) = node.attrs["dim"], self._rows(node, box)
        if node.attrs["select"]:
            src = src.unsqueeze(dim)
        a = box[dim][0]
        return torch.slice_scatter(x, src.to(x.dtype), dim, lo - a, hi - a)
