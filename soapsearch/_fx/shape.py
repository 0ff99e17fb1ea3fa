"""fx adapters of the data-movement ops: reshape/flatten, permute, slice (getitem) and concat."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from soapsearch._fx.base import ALIAS, FxOp, arg, for_functions, for_methods, for_modules, val
from soapsearch._fx.multi import item_op, multi_of
from soapsearch._fx.gather import index_op

_CALLS = ("call_module", "call_function", "call_method")


def _tensors(node: fx.Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input value, output value) of a one-tensor-in, one-tensor-out node, else None."""
    src = node.args[0] if node.args else None
    x, out = val(src), val(node)
    if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
        return x, out
    return None


def _reshape(node: fx.Node, kind: str) -> FxOp | None:
    """A view of the same elements in a new shape (an ALIAS when the shape does not change)."""
    xo = _tensors(node)
    if xo is None or xo[0].dtype != xo[1].dtype or xo[0].numel() != xo[1].numel():
        return None
    if xo[0].shape == xo[1].shape:
        return FxOp(ALIAS, [node.args[0]])
    return FxOp(kind, [node.args[0]])


@for_modules(nn.Flatten)
def _flatten_module(node: fx.Node, mod: nn.Module) -> FxOp | None:
    return _reshape(node, "flatten")


@for_modules(nn.Unflatten)
def _unflatten_module(node: fx.Node, mod: nn.Module) -> FxOp | None:
    return _reshape(node, "reshape")


@for_functions(torch.flatten)
@for_methods("flatten")
def _flatten(node: fx.Node) -> FxOp | None:
    return _reshape(node, "flatten")


@for_functions(torch.reshape, torch.unsqueeze, torch.squeeze, torch.unflatten)
@for_methods("view", "reshape", "view_as", "reshape_as", "unsqueeze", "squeeze", "unflatten")
def _view(node: fx.Node) -> FxOp | None:
    return _reshape(node, "reshape")


@for_functions(torch.permute, torch.transpose, torch.swapaxes, torch.swapdims, torch.t,
               torch.movedim, torch.moveaxis)
@for_methods("permute", "transpose", "swapaxes", "swapdims", "t", "movedim", "moveaxis")
def _permute(node: fx.Node) -> FxOp | None:
    """Any dim permutation: found by applying the same call to a meta tensor whose dims have
    distinct sizes 2, 3, ... (output dim i has size 2 + perm[i])."""
    xo = _tensors(node)
    if xo is None:
        return None
    n = xo[0].dim()
    probe = torch.empty(tuple(range(2, n + 2)), device="meta")
    args, kwargs = val(list(node.args[1:])), val(dict(node.kwargs))
    try:
        out = (getattr(probe, node.target)(*args, **kwargs) if node.op == "call_method"
               else node.target(probe, *args, **kwargs))
    except (RuntimeError, TypeError, IndexError):
        return None
    perm = [s - 2 for s in out.shape]
    if sorted(perm) != list(range(n)):
        return None
    if perm == list(range(n)):
        return FxOp(ALIAS, [node.args[0]])
    return FxOp("permute", [node.args[0]], {"perm": perm})


@for_functions(getattr)
def _attribute(node: fx.Node) -> FxOp | None:
    """``x.T`` / ``x.mT`` are permutes; any other attribute (``x.shape``, ``x.data``) is not an op here."""
    return _permute(node) if node.args[1:] in (("T",), ("mT",)) else None


def _normalize(index: Any, shape: tuple[int, ...]) -> list[Any] | None:
    """``index`` as one entry per input dim (an int >= 0, or [start, stop, step] from
    slice.indices) plus None for each new size-1 dim; None when it is not basic indexing."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, (bool, torch.Tensor, list)) for i in items) or items.count(Ellipsis) > 1:
        return None
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items):
        return None
    used = sum(isinstance(i, (int, slice)) for i in items)
    if used > len(shape):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - used)
    else:
        items += [slice(None)] * (len(shape) - used)
    out, d = [], 0
    for i in items:
        if i is None:
            out.append(None)
            continue
        size = shape[d]
        if isinstance(i, int):
            if not -size <= i < size:
                return None
            out.append(i % size)
        else:
            start, stop, step = i.indices(size)
            if step <= 0:
                return None
            out.append([start, max(stop, start), step])
        d += 1
    return out


@for_functions(operator.getitem)
def _getitem(node: fx.Node) -> FxOp | None:
    """Basic indexing of a tensor is a slice; an item of a split (``multi_of``) is a slice of
    the split's input; item 0 of a module's or function's tuple output
    (``out, _ = self.lstm(x)``) is that op's output itself."""
    src, index = node.args
    v = val(src)
    multi = multi_of(src)
    if multi is not None:
        return item_op(multi, val(index))
    if isinstance(v, (tuple, list)):
        if (val(index) == 0 and isinstance(src, fx.Node) and src.op in _CALLS and v
                and src.target is not operator.getitem and isinstance(v[0], torch.Tensor)):
            return FxOp(ALIAS, [src])
        return None
    out = val(node)
    if not isinstance(v, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if isinstance(val(index), torch.Tensor):  # table[ids], one integer tensor: soapsearch/_fx/gather.py
        return index_op(node, src, index)
    norm = _normalize(val(index), tuple(v.shape))
    if norm is None:
        return None
    sizes = [1 if i is None else len(range(*i)) for i in norm if not isinstance(i, int)]
    if tuple(sizes) != tuple(out.shape):
        return None
    return FxOp("slice", [src], {"index": norm})


@for_functions(torch.cat, torch.concat, torch.concatenate)
def _concat(node: fx.Node) -> FxOp | None:
    tensors = arg(node, 0, "tensors")
    dim = val(arg(node, 1, "axis" if "axis" in node.kwargs else "dim", 0))
    out = val(node)
    if (not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(dim, int)
            or not isinstance(out, torch.Tensor)
            or not all(isinstance(t, fx.Node) and isinstance(val(t), torch.Tensor)
                       and val(t).dim() == out.dim() for t in tensors)):
        return None
    if len(tensors) == 1:
        return FxOp(ALIAS, [tensors[0]])
    return FxOp("concat", list(tensors), {"dim": dim % out.dim()})
