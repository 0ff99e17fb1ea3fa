"""fx adapters of the pointwise ops (activations, arithmetic, casts, dropout), reductions over
dims and identity-like nodes (ALIAS)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._fx.base import ALIAS, FxOp, arg, for_functions, for_methods, for_modules, val
from strategies.rules.pointwise import (F_POINTWISE, FUNCTIONS, OPERATOR_POINTWISE, REDUCTIONS,
                                        TORCH_POINTWISE)


class _Unsupported(Exception):
    """An argument an attrs template cannot hold (a device, a memory format, ...)."""


def _const(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (list, tuple)):
        return [_const(x) for x in v]
    raise _Unsupported(type(v).__name__)


def _template(a: Any, inputs: list[fx.Node]) -> Any:
    """``a`` as a call template: tensors become ``{"input": i}`` (inputs deduplicated)."""
    if isinstance(a, fx.Node) and isinstance(val(a), torch.Tensor):
        if a not in inputs:
            inputs.append(a)
        return {"input": inputs.index(a)}
    if isinstance(a, (list, tuple)):
        return [_template(x, inputs) for x in a]
    return _const(val(a))


def _broadcasts(node: fx.Node, inputs: list[fx.Node]) -> bool:
    """Whether the node's output is its tensor inputs broadcast together (numpy rules)."""
    out = val(node)
    if not isinstance(out, torch.Tensor) or not inputs:
        return False
    for i in inputs:
        s = tuple(val(i).shape)
        if len(s) > out.dim() or any(a not in (1, b) for a, b in zip(s, out.shape[out.dim() - len(s):])):
            return False
    return True


def pointwise(node: fx.Node, fn: str, args: Any, kwargs: dict[str, Any]) -> FxOp | None:
    """The elementwise op ``fn(*args, **kwargs)`` (``add``/``mul`` between two tensors)."""
    inputs: list[fx.Node] = []
    try:
        a = _template(list(args), inputs)
        k = {name: _template(v, inputs) for name, v in kwargs.items() if name != "inplace"}
    except _Unsupported:
        return None
    if fn not in FUNCTIONS or not _broadcasts(node, inputs):
        return None
    kind = "elementwise"
    if len(inputs) == 2 and len(a) == 2 and all(isinstance(x, dict) and "input" in x for x in a):
        kind = {"add": "add", "mul": "mul"}.get(fn.rpartition(".")[2], "elementwise")
    return FxOp(kind, inputs, {"fn": fn, "args": a, "kwargs": k})


# --- modules ------------------------------------------------------------------------------
_MODULES: dict[type, tuple[str, tuple[str, ...]]] = {  # type -> (fn, attributes passed as kwargs)
    nn.ReLU: ("F.relu", ()), nn.ReLU6: ("F.relu6", ()), nn.GELU: ("F.gelu", ("approximate",)),
    nn.SiLU: ("F.silu", ()), nn.Mish: ("F.mish", ()), nn.Tanh: ("torch.tanh", ()),
    nn.Sigmoid: ("torch.sigmoid", ()), nn.ELU: ("F.elu", ("alpha",)), nn.SELU: ("F.selu", ()),
    nn.CELU: ("F.celu", ("alpha",)), nn.LeakyReLU: ("F.leaky_relu", ("negative_slope",)),
    nn.Softplus: ("F.softplus", ("beta", "threshold")), nn.Softsign: ("F.softsign", ()),
    nn.Hardtanh: ("F.hardtanh", ("min_val", "max_val")), nn.Hardswish: ("F.hardswish", ()),
    nn.Hardsigmoid: ("F.hardsigmoid", ()), nn.LogSigmoid: ("F.logsigmoid", ()),
    nn.Tanhshrink: ("F.tanhshrink", ()), nn.Threshold: ("F.threshold", ("threshold", "value")),
    nn.Hardshrink: ("F.hardshrink", ("lambd",)), nn.Softshrink: ("F.softshrink", ("lambd",)),
}


@for_modules(*_MODULES)
def _activation_module(node: fx.Node, mod: nn.Module) -> FxOp | None:
    for t in type(mod).__mro__:  # a subclass (nn.ReLU6 is a Hardtanh) takes its closest entry
        if t in _MODULES:
            fn, names = _MODULES[t]
            return pointwise(node, fn, [node.args[0]], {n: getattr(mod, n) for n in names})
    return None


@for_modules(nn.Identity)
def _identity(node: fx.Node, mod: nn.Module) -> FxOp:
    return FxOp(ALIAS, [node.args[0]])


@for_modules(nn.Dropout)
def _dropout_module(node: fx.Node, mod: nn.Dropout) -> FxOp:
    return FxOp("dropout", [node.args[0]], {"p": float(mod.p), "training": bool(mod.training)})


# --- functions and methods ----------------------------------------------------------------
def _function(prefix: str) -> Any:
    def adapt(node: fx.Node) -> FxOp | None:
        return pointwise(node, f"{prefix}.{node.target.__name__}", node.args, dict(node.kwargs))
    return adapt


for_functions(*(getattr(torch, n) for n in TORCH_POINTWISE if f"torch.{n}" in FUNCTIONS))(_function("torch"))
for_functions(*(getattr(F, n) for n in F_POINTWISE if f"F.{n}" in FUNCTIONS))(_function("F"))
for_functions(*(getattr(operator, n) for n in OPERATOR_POINTWISE))(_function("operator"))


@for_methods(*(n for n in TORCH_POINTWISE if f"Tensor.{n}" in FUNCTIONS))
def _method(node: fx.Node) -> FxOp | None:
    return pointwise(node, f"Tensor.{node.target}", node.args, dict(node.kwargs))


@for_functions(F.dropout, torch.dropout)
def _dropout_function(node: fx.Node) -> FxOp | None:
    p = val(arg(node, 1, "p", 0.5))
    training = val(arg(node, 2, "training" if node.target is F.dropout else "train", True))
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return None
    return FxOp("dropout", [node.args[0]], {"p": float(p), "training": training})


@for_methods("contiguous", "clone")
def _alias_method(node: fx.Node) -> FxOp:
    return FxOp(ALIAS, [node.args[0]])


@for_methods("to", "type", "float", "double", "half", "bfloat16", "long", "int", "short", "bool")
def _cast(node: fx.Node) -> FxOp | None:
    """A dtype cast is elementwise; a ``.to()`` / ``.type()`` that changes nothing is its input."""
    src, out = val(node.args[0]), val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if out.dtype == src.dtype:
        return FxOp(ALIAS, [node.args[0]])
    return pointwise(node, "cast", [node.args[0], out.dtype], {})


# --- reductions over dims -----------------------------------------------------------------
def _reduce(node: fx.Node, fn: str) -> FxOp | None:
    x, out = val(node.args[0]), val(node)
    dim = val(arg(node, 1, "dim"))
    rest = {k: v for k, v in node.kwargs.items() if k not in ("dim", "keepdim")}
    if (not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() == 0
            or dim is None or len(node.args) > 3 or (fn in ("var", "std") and len(node.args) > 2)):
        return None
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return None
    dims = sorted({d % x.dim() for d in dims})
    keepdim = val(arg(node, 2, "keepdim", False)) if fn not in ("var", "std") else \
        val(node.kwargs.get("keepdim", False))
    if not dims or not isinstance(keepdim, bool) or (fn in ("prod", "all", "any") and len(dims) > 1):
        return None
    try:
        kwargs = {k: _const(val(v)) for k, v in rest.items()}
    except _Unsupported:
        return None
    return FxOp("reduce", [node.args[0]], {"fn": fn, "dims": dims, "keepdim": keepdim,
                                           "kwargs": kwargs})


@for_methods(*REDUCTIONS)
def _reduce_method(node: fx.Node) -> FxOp | None:
    return _reduce(node, node.target)


@for_functions(*REDUCTIONS.values())
def _reduce_function(node: fx.Node) -> FxOp | None:
    return _reduce(node, node.target.__name__)
