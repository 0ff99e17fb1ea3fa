"""fx adapters of mask and constant builders: ``torch.triu``/``tril`` (``"triangle"``) and tensor
factories (``"factory"``) (strategies/rules/mask.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from soapsearch._fx.base import FxOp, arg, for_functions, for_methods, val
from soapsearch._fx.pointwise import _const, _Unsupported
from strategies.rules.mask import FACTORIES

_PLACEMENT = ("device", "layout", "pin_memory", "memory_format", "out")
"""Factory keywords that say where, not what: a partition builds its tensor on the default device."""


@for_functions(torch.triu, torch.tril)
@for_methods("triu", "tril")
def _triangle(node: fx.Node) -> FxOp | None:
    x, diagonal = val(node.args[0]), val(arg(node, 1, "diagonal", 0))
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(diagonal, int):
        return None
    name = node.target if isinstance(node.target, str) else node.target.__name__
    return FxOp("triangle", [node.args[0]], {"upper": name == "triu", "diagonal": diagonal})


def _factory(node: fx.Node, fn: str, args: Any, kwargs: dict[str, Any]) -> FxOp | None:
    out = val(node)
    if not isinstance(out, torch.Tensor) or kwargs.get("requires_grad"):
        return None
    try:
        a = _const(val(list(args)))
        k = {n: _const(val(v)) for n, v in kwargs.items() if n not in _PLACEMENT + ("requires_grad",)}
    except _Unsupported:
        return None
    k["dtype"] = _const(out.dtype)
    return FxOp("factory", [], {"fn": fn, "args": a, "kwargs": k})


@for_functions(*FACTORIES.values())
def _factory_function(node: fx.Node) -> FxOp | None:
    return _factory(node, f"torch.{node.target.__name__}", node.args, dict(node.kwargs))


@for_functions(torch.ones_like, torch.zeros_like, torch.full_like)
def _factory_like(node: fx.Node) -> FxOp | None:
    """``ones_like(x)`` reads only x's shape: ``full(shape, value)`` with no input."""
    out = val(node)
    if not isinstance(out, torch.Tensor):
        return None
    fill = {torch.ones_like: 1, torch.zeros_like: 0}.get(node.target)
    if fill is None:
        fill = val(arg(node, 1, "fill_value"))
    rest = {n: v for n, v in node.kwargs.items() if n not in ("fill_value", "dtype")}
    return _factory(node, "torch.full", [list(out.shape), fill], rest)


@for_methods("new_ones", "new_zeros", "new_full")
def _factory_new(node: fx.Node) -> FxOp | None:
    """``x.new_full(size, value)``: a factory with x's dtype (unless given); x's values unread."""
    out = val(node)
    if not isinstance(out, torch.Tensor):
        return None
    fill = {"new_ones": 1, "new_zeros": 0}.get(node.target)
    if fill is None:
        fill = val(arg(node, 2, "fill_value"))
    rest = {n: v for n, v in node.kwargs.items() if n not in ("fill_value", "size", "dtype")}
    return _factory(node, "torch.full", [list(out.shape), fill], rest)
