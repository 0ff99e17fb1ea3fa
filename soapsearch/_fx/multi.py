"""fx adapters of the ops that return several tensors, each a block of their input on one dim:
``split`` (a size or a list of sizes), ``split_with_sizes``, ``chunk``, ``tensor_split`` and
``unbind``.

Such a node is no op (``MULTI``); each item the model reads (``getitem(node, i)``, tuple
unpacking included) becomes a ``slice`` op of the node's input, so a fused qkv projection cut
into q, k and v feeds three slices of one linear's output. An item nobody reads makes no op.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from soapsearch._fx.base import MULTI, FxOp, adapter_for, arg, for_functions, for_methods, val

__all__ = ["multi_output", "bounds_of", "multi_of", "item_op"]


def multi_output(src: fx.Node, dim: int, boundaries: Sequence[int], drop_dim: bool) -> FxOp:
    """The ``MULTI`` marker of a node whose items are consecutive blocks of ``src`` on ``dim``:
    item i is ``src`` rows [boundaries[i], boundaries[i+1]) on ``dim`` (``drop_dim``: each item is
    one row and ``dim`` is removed, as ``unbind`` does).

    For an adapter of any target that splits one tensor along one dim; for torch.export graphs
    (``src`` is the aten node's ``args[0]``, its value in ``src.meta["val"]``):

    - ``aten.split.Tensor(x, size, dim)``: boundaries 0, size, 2·size, ..., capped at the dim's
      size (the last block may be shorter), ``drop_dim=False``;
    - ``aten.split_with_sizes.default(x, sizes, dim)``: 0 and the running sums of ``sizes``;
    - ``aten.chunk.default(x, chunks, dim)``: blocks of ceil(size / chunks) rows, as split;
    - ``aten.unbind.int(x, dim)``: 0, 1, ..., size with ``drop_dim=True``.

    The simplest way to get the boundaries right is ``bounds_of(node, dim)`` on the splitting
    node itself (0 and the running sums of its items' sizes). ``dim`` may be negative.
    ``operator.getitem`` of the node is then adapted to a ``slice`` op by ``item_op`` (the
    getitem adapter in ``soapsearch._fx.shape`` does this for any node whose adapter returns
    this marker). Raises ValueError when ``src`` is not a tensor node or the boundaries do not
    rise from 0 to the dim's size."""
    x = val(src)
    if not isinstance(src, fx.Node) or not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"multi-output op: input {src!r} must be a tensor node of at least one "
                         f"dim, got value {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"multi-output op of {src.name!r}: dim {dim} is outside its "
                         f"{x.dim()} dims")
    d, size, bounds = dim % x.dim(), x.shape[dim % x.dim()], [int(b) for b in boundaries]
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != size
            or any(b < a for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"multi-output op of {src.name!r}: boundaries {bounds} on dim {d} must "
                         f"rise from 0 to its size {size}")
    if drop_dim and any(b - a != 1 for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"multi-output op of {src.name!r}: drop_dim needs items of one row, "
                         f"boundaries {bounds} are not 0, 1, ..., {size}")
    return FxOp(MULTI, [src], {"dim": d, "bounds": bounds, "drop": bool(drop_dim)})


def bounds_of(node: fx.Node, dim: int) -> list[int] | None:
    """0 and the running sums of the sizes on ``dim`` of the items of ``node``'s tuple value, or
    None when its value is not a tuple of tensors of one rank."""
    items = val(node)
    if not isinstance(items, (tuple, list)) or not items:
        return None
    if not all(isinstance(t, torch.Tensor) and t.dim() == items[0].dim() > 0 for t in items):
        return None
    out = [0]
    for t in items:
        out.append(out[-1] + t.shape[dim])
    return out


def multi_of(node: Any) -> FxOp | None:
    """The ``MULTI`` marker of ``node`` when its adapter returns one, else None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    thunk = adapter_for(node, None)  # no module adapter: a call_module is never a MULTI here
    fxop = thunk() if thunk else None
    return fxop if fxop is not None and fxop.kind == MULTI else None


def item_op(multi: FxOp, index: Any) -> FxOp | None:
    """Item ``index`` of a ``MULTI`` node as a ``slice`` op of its input (an int drops the dim
    when the marker says so), or None when ``index`` is not an int naming an item."""
    bounds, d = multi.attrs["bounds"], multi.attrs["dim"]
    n = len(bounds) - 1
    if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
        return None
    i, src = index % n, multi.inputs[0]
    shape = tuple(val(src).shape)
    entry: Any = bounds[i] if multi.attrs["drop"] else [bounds[i], bounds[i + 1], 1]
    return FxOp("slice", [src], {"index": [entry if k == d else [0, s, 1]
                                           for k, s in enumerate(shape)]})


def _split_like(node: fx.Node, dim_at: int, drop: bool = False) -> FxOp | None:
    """Any op whose items are consecutive blocks on ``dim`` (the argument at ``dim_at``)."""
    if any(u.target is not operator.getitem or not isinstance(u.args[1], int) for u in node.users):
        return None  # the tuple itself is read (torch.cat(x.split(2))): no slice stands for it
    src, dim = node.args[0] if node.args else None, val(arg(node, dim_at, "dim", 0))
    x = val(src)
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        return None
    bounds = bounds_of(node, dim % x.dim()) if not drop else list(range(x.shape[dim] + 1))
    if bounds is None or bounds[-1] != x.shape[dim]:
        return None
    if drop and len(val(node)) != x.shape[dim]:
        return None
    return multi_output(src, dim, bounds, drop)


@for_functions(torch.split, torch.Tensor.split, torch.split_with_sizes, torch.chunk)
@for_methods("split", "split_with_sizes", "chunk")
def _split(node: fx.Node) -> FxOp | None:
    """split(x, size or sizes, dim), split_with_sizes(x, sizes, dim), chunk(x, chunks, dim)."""
    return _split_like(node, 2)


@for_functions(torch.tensor_split)
@for_methods("tensor_split")
def _tensor_split(node: fx.Node) -> FxOp | None:
    """tensor_split(x, sections, dim), or with rising indices inside the dim; indices that fall
    back (``[3, 1]``: items overlap) or a tensor of them are not blocks and stay opaque."""
    how = val(arg(node, 1, "indices_or_sections" if "indices_or_sections" in node.kwargs
                  else "sections" if "sections" in node.kwargs else "indices"))
    x = val(node.args[0]) if node.args else None
    if isinstance(how, (list, tuple)) and isinstance(x, torch.Tensor):
        dim = val(arg(node, 2, "dim", 0))
        if not isinstance(dim, int) or not all(isinstance(i, int) and i >= 0 for i in how):
            return None
        if list(how) != sorted(how) or (how and how[-1] > x.shape[dim]):
            return None
    elif not isinstance(how, int):
        return None
    return _split_like(node, 2)


@for_functions(torch.unbind)
@for_methods("unbind")
def _unbind(node: fx.Node) -> FxOp | None:
    """unbind(x, dim): item i is row i of ``dim``, the dim removed."""
    return _split_like(node, 1, drop=True)
