"""Rules of the ops whose output elements are copies of input elements picked by an index map:
indexing dim 0 by an integer tensor (``"index"``), broadcasting (``"expand"``) and
``repeat_interleave``. None computes; a partition reads the input rows its box maps to."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from strategies.graph import OpNode
from strategies.region import Box, box_shape
from strategies.rules.base import Reduce, SplitAll, broadcast_region, no_reduce, register

__all__ = ["repeat_rows"]


@register("index")
class Index(SplitAll):
    """out = table[ids]: dim 0 of ``table`` indexed by the integer tensor ``ids`` (torch advanced
    indexing with one index tensor; ``aten.index.Tensor(table, [ids])``).

    inputs: (table, ids). Output dims = ids' dims followed by the table's dims after the first,
    so out[i..., j...] = table[ids[i...], j...]. Every dim may be cut: a partition reads its box
    of ``ids`` and every row of ``table`` (which rows it needs depends on the ids' values)
    restricted to its box of the trailing dims. attrs: none."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        table, ids = (s.shape for s in node.input_specs)
        k = len(ids)
        return (((0, table[0]),) + box[k:], box[:k])

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return inputs[0][inputs[1]]


@register("expand")
class Expand(SplitAll):
    """out = x.expand(shape) (torch's broadcasting semantics: leading dims added, size-1 dims
    repeated; ``aten.expand``). Every dim may be cut; a partition reads the box broadcast to
    the input (``broadcast_region``: a size-1 dim reads [0, 1)). attrs: none (the output
    shape is the op's)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (broadcast_region(box, node.input_specs[0].shape, len(box)),)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return inputs[0].expand(box_shape(box))


def repeat_rows(a: int, b: int, repeats: int) -> tuple[int, int]:
    """The input rows [a // r, (b - 1) // r + 1) that output rows [a, b) of a repeat_interleave
    by r copy: output row i is input row i // r."""
    return a // repeats, (b - 1) // repeats + 1


@register("repeat_interleave")
class RepeatInterleave(SplitAll):
    """out = x.repeat_interleave(repeats, dim): each row of ``dim`` repeated ``repeats`` times in
    place, so output row i of that dim is input row i // repeats (``aten.repeat_interleave``
    with an int repeats). Every dim may be cut; a partition reads input rows
    ``repeat_rows(a, b, repeats)`` of ``dim`` for its rows [a, b), repeats them and keeps the
    rows from a - repeats·(a // repeats) on.

    attrs: ``repeats`` (int > 0), ``dim`` (int, non-negative)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        dim, r = node.attrs["dim"], node.attrs["repeats"]
        return (box[:dim] + (repeat_rows(*box[dim], r),) + box[dim + 1:],)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        dim, r = node.attrs["dim"], node.attrs["repeats"]
        (a, b), first = box[dim], box[dim][0] // r
        return inputs[0].repeat_interleave(r, dim).narrow(dim, a - first * r, b - a)


@register("gather")
class Gather(SplitAll):
    """out = torch.gather(x, dim, index): out[..., j, ...] = x[..., index[..., j, ...], ...] along
    ``dim`` (attr), the output shaped as ``index`` (which may be smaller than x on every dim).
    Every dim may be cut: a partition reads its box of ``index``, and of ``x`` the same box on
    every other dim (torch.gather pairs positions, it does not broadcast) and every row of
    ``dim`` (which rows depends on the index values). inputs: (x, index)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        dim, x = node.attrs["dim"], node.input_specs[0].shape
        return (tuple((0, x[d]) if d == dim else r for d, r in enumerate(box)), box)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return torch.gather(inputs[0], node.attrs["dim"], inputs[1])
