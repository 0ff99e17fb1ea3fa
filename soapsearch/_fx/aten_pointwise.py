"""aten adapters of the pointwise ops (arithmetic, activations, comparisons, casts, dropout)
and of the reductions over dims; each gives the op the fx adapter of the same torch call gives
(``soapsearch/_fx/pointwise.py``).

An aten pointwise op names the function of the pointwise ``FUNCTIONS`` table its torch call
has: ``torch.<name>`` (generated from the same native schema as ``aten::<name>``, so the aten
arguments call it as they are), else ``F.<name>`` where its parameters are the aten schema's
in order, else a Python operator (``aten.__and__`` is ``operator.and_``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from soapsearch._fx.aten import args_of, aten
from soapsearch._fx.base import ALIAS, FxOp, for_functions, val
from soapsearch._fx.pointwise import _cast, _reduce, pointwise
from strategies.rules.pointwise import F_POINTWISE, FUNCTIONS, TORCH_POINTWISE

_OPERATORS = {"__and__": "operator.and_", "__or__": "operator.or_", "__xor__": "operator.xor",
              "bitwise_and": "operator.and_", "bitwise_or": "operator.or_",
              "bitwise_xor": "operator.xor"}
"""aten ops of two operands that are a Python operator of the pointwise table."""


def _overloads(name: str) -> list[Any]:
    """The functional overloads of ``aten.<name>`` (no ``out=`` variant) returning one tensor."""
    packet = getattr(aten, name, None)
    out = []
    for o in packet.overloads() if packet is not None else ():
        op = getattr(packet, o)
        s = op._schema
        if (len(s.returns) == 1 and str(s.returns[0].type) == "Tensor"
                and not any(a.is_out for a in s.arguments) and not s.is_mutable):
            out.append(op)
    return out


def _f_matches(fn: Any, op: Any) -> bool:
    """Whether ``F.<name>``'s parameters are the aten schema's, in order (``self`` is ``input``);
    a builtin without a signature (``F.gelu``) matches when the aten op has one positional
    argument and keywords only."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return all(a.kwarg_only for a in op._schema.arguments[1:])
    names = ["input" if a.name == "self" else a.name for a in op._schema.arguments]
    return params[:len(names)] == names


def _table() -> dict[Any, str]:
    """aten overload -> the pointwise function it is."""
    out: dict[Any, str] = {}
    for name in dict.fromkeys(TORCH_POINTWISE + F_POINTWISE):
        for op in _overloads(name):
            if f"torch.{name}" in FUNCTIONS and hasattr(torch, name):
                out[op] = f"torch.{name}"
            elif f"F.{name}" in FUNCTIONS and _f_matches(getattr(F, name), op):
                out[op] = f"F.{name}"
    for name, fn in _OPERATORS.items():
        for op in _overloads(name):
            out[op] = fn
    out[aten.min.other] = "torch.minimum"
    out[aten.max.other] = "torch.maximum"
    out.pop(aten.detach.default, None)  # an alias (aten_shape)
    return out


_POINTWISE = _table()


def _inplace_ok(node: fx.Node) -> bool:
    """An in-place op may be read as its out-of-place form when nothing reads the tensor it
    overwrites after it (``x.add_(y)`` whose ``x`` is read no more)."""
    src = node.args[0]
    return isinstance(src, fx.Node) and all(u is node or u < node for u in src.users)


def _inplace_table() -> dict[Any, str]:
    """``aten.<name>_`` overload -> the function of its out-of-place ``aten.<name>``."""
    out: dict[Any, str] = {}
    by_name = {(op._schema.name, op._schema.overload_name): fn for op, fn in _POINTWISE.items()}
    for op, fn in list(_POINTWISE.items()):
        packet = getattr(aten, op._schema.name.removeprefix("aten::") + "_", None)
        inplace = getattr(packet, op._schema.overload_name or "default", None) if packet else None
        if inplace is not None and (op._schema.name, op._schema.overload_name) in by_name:
            out[inplace] = fn
    return out


_INPLACE = _inplace_table()


@for_functions(*_POINTWISE)
def _pointwise(node: fx.Node) -> FxOp | None:
    return pointwise(node, _POINTWISE[node.target], node.args, dict(node.kwargs))


@for_functions(*_INPLACE)
def _pointwise_inplace(node: fx.Node) -> FxOp | None:
    if not _inplace_ok(node):
        return None
    return pointwise(node, _INPLACE[node.target], node.args, dict(node.kwargs))


@for_functions(aten.rsub.Scalar)
def _rsub(node: fx.Node) -> FxOp | None:
    """rsub(x, c, alpha=1) = c - x."""
    a = args_of(node)
    if val(a["alpha"]) != 1:
        return None
    return pointwise(node, "operator.sub", [a["other"], a["self"]], {})


# --- casts and dropout --------------------------------------------------------------------
# a dtype cast is elementwise; one that keeps the dtype (a device move) is its input
for_functions(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
              aten._to_copy.default, aten.type_as.default)(_cast)


@for_functions(aten.dropout.default)
def _dropout(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    p, train = val(a["p"]), val(a["train"])
    if not isinstance(p, (int, float)) or not isinstance(train, bool):
        return None
    return FxOp("dropout", [a["input"]], {"p": float(p), "training": train})


# --- reductions over dims -----------------------------------------------------------------
_REDUCTIONS = {aten.mean.dim: "mean", aten.sum.dim_IntList: "sum", aten.amax.default: "amax",
               aten.amin.default: "amin", aten.logsumexp.default: "logsumexp",
               aten.nansum.default: "nansum", aten.nanmean.default: "nanmean",
               aten.prod.dim_int: "prod", aten.any.dim: "any", aten.all.dim: "all",
               aten.any.dims: "any", aten.all.dims: "all"}


@for_functions(*_REDUCTIONS)
def _reduce_dims(node: fx.Node) -> FxOp | None:
    return _reduce(node, _REDUCTIONS[node.target])
