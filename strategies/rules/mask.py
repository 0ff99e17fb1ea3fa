"""Rules of the ops that build masks and constants: ``torch.triu``/``tril`` (``"triangle"``) and
tensor factories such as ``torch.arange``/``full``/``ones`` (``"factory"``)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from strategies.graph import OpNode
from strategies.region import Box, slice_box
from strategies.rules.base import Reduce, SplitAll, no_reduce, register
from strategies.rules.pointwise import _fill

__all__ = ["FACTORIES", "local_diagonal"]


def local_diagonal(diagonal: int, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """The diagonal a partition holding rows [r0, r1) and columns [c0, c1) of the last two dims
    passes to triu/tril so that it keeps exactly the global elements.

    Global (i, j) = local (i' + r0, j' + c0), so j - i = j' - i' + c0 - r0. triu keeps
    j - i >= d, i.e. j' - i' >= d + r0 - c0 (tril: <=, the same shift): the local diagonal is
    d + r0 - c0."""
    return diagonal + rows[0] - cols[0]


@register("triangle")
class Triangle(SplitAll):
    """out = torch.triu(x, diagonal) (``upper``) or torch.tril(x, diagonal): the elements of the
    last two dims with j - i >= diagonal (triu) or j - i <= diagonal (tril) kept, the rest 0
    (``aten.triu``/``aten.tril``). Every dim may be cut; a partition reads its box and applies
    the same function with ``local_diagonal(diagonal, rows, cols)``.

    attrs: ``upper`` (bool: triu), ``diagonal`` (int)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        d = local_diagonal(node.attrs["diagonal"], box[-2], box[-1])
        return (torch.triu if node.attrs["upper"] else torch.tril)(inputs[0], d)


FACTORIES: dict[str, Callable[..., torch.Tensor]] = {
    f"torch.{n}": getattr(torch, n)
    for n in ("arange", "full", "ones", "zeros", "eye", "linspace", "logspace")
}
"""Functions a factory op may name in ``attrs["fn"]``."""


@register("factory")
class Factory(SplitAll):
    """A tensor built from constants alone (``torch.arange(T)``, ``torch.full((T, T), -inf)``,
    ``torch.ones_like(x)``): it reads nothing; a partition builds the whole tensor and keeps its
    box (the tensor is small, or its size is known only from the trace), on the default device.

    attrs: ``fn`` (a key of ``FACTORIES``), ``args``, ``kwargs`` (constants; ``{"dtype": ...}``
    for a torch dtype, as in the pointwise rules)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return ()

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        kwargs: dict[str, Any] = {k: _fill(v, ()) for k, v in a.get("kwargs", {}).items()}
        full = FACTORIES[a["fn"]](*_fill(a["args"], ()), **kwargs)
        return full[slice_box(box)]
