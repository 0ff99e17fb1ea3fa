"""fx adapters of indexing by an integer tensor (``"index"``), broadcasting (``"expand"``) and
``repeat_interleave`` (strategies/rules/gather.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from soapsearch._fx.base import ALIAS, FxOp, arg, for_functions, for_methods, val

__all__ = ["index_op"]


def _tensor(a: Any) -> torch.Tensor | None:
    v = val(a)
    return v if isinstance(a, fx.Node) and isinstance(v, torch.Tensor) else None


def index_op(node: fx.Node, table: Any, ids: Any) -> FxOp | None:
    """``table[ids]`` with ``ids`` one integer tensor indexing dim 0 (``operator.getitem``,
    ``torch.index_select(table, 0, ids)`` with 1-D ids), else None."""
    t, i, out = _tensor(table), _tensor(ids), val(node)
    if t is None or i is None or not isinstance(out, torch.Tensor) or t.dim() == 0:
        return None
    if i.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return None  # a boolean mask selects a data-dependent number of rows
    if tuple(out.shape) != tuple(i.shape) + tuple(t.shape[1:]):
        return None
    return FxOp("index", [table, ids])


@for_functions(torch.index_select)
@for_methods("index_select")
def _index_select(node: fx.Node) -> FxOp | None:
    dim = val(arg(node, 1, "dim"))
    if not isinstance(dim, int) or dim != 0:
        return None
    return index_op(node, node.args[0], arg(node, 2, "index"))


@for_functions(torch.broadcast_to)
@for_methods("expand", "expand_as")
def _expand(node: fx.Node) -> FxOp | None:
    """The input broadcast to the output's shape (numpy rules; -1 keeps a size)."""
    x, out = _tensor(node.args[0]), val(node)
    if x is None or not isinstance(out, torch.Tensor) or x.dim() > out.dim():
        return None
    lead = out.dim() - x.dim()
    if any(s not in (1, o) for s, o in zip(x.shape, out.shape[lead:])):
        return None
    if tuple(x.shape) == tuple(out.shape):
        return FxOp(ALIAS, [node.args[0]])
    return FxOp("expand", [node.args[0]])


@for_functions(torch.repeat_interleave)
@for_methods("repeat_interleave")
def _repeat_interleave(node: fx.Node) -> FxOp | None:
    x, out = _tensor(node.args[0]), val(node)
    repeats, dim = val(arg(node, 1, "repeats")), val(arg(node, 2, "dim"))
    if (x is None or not isinstance(out, torch.Tensor) or isinstance(repeats, bool)
            or not isinstance(repeats, int) or repeats < 1 or not isinstance(dim, int)
            or x.dim() == 0):
        return None  # tensor repeats, or dim=None (flattens)
    if repeats == 1:
        return FxOp(ALIAS, [node.args[0]])
    return FxOp("repeat_interleave", [node.args[0]], {"repeats": repeats, "dim": dim % x.dim()})


@for_functions(torch.gather, torch.ops.aten.gather.default)
@for_methods("gather")
def _gather(node: fx.Node) -> FxOp | None:
    """``torch.gather(x, dim, index)`` (no ``sparse_grad``)."""
    x, dim, index = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    xv, iv, out = _tensor(x), _tensor(index), val(node)
    if (xv is None or iv is None or not isinstance(val(dim), int) or arg(node, 3, "sparse_grad", False)
            or not isinstance(out, torch.Tensor) or xv.dim() != iv.dim() or xv.dim() == 0):
        return None
    return FxOp("gather", [x, index], {"dim": val(dim) % xv.dim()})
