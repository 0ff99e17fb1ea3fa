"""fx adapters of the normalizations: batchnorm2d, layernorm, softmax, log_softmax."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._fx.base import FxOp, arg, const, for_functions, for_methods, for_modules, val


def _ndim(x: Any) -> int | None:
    v = val(x)
    return v.dim() if isinstance(v, torch.Tensor) else None


@for_modules(nn.BatchNorm2d)
def _batchnorm2d(node: fx.Node, mod: nn.BatchNorm2d) -> FxOp | None:
    x = node.args[0]
    if _ndim(x) != 4:
        return None
    roles = ["weight", "bias"] if mod.affine else []
    tracked = mod.running_mean is not None and mod.running_var is not None
    roles += ["running_mean", "running_var"] if tracked else []
    return FxOp("batchnorm2d", [x], {
        "eps": float(mod.eps), "momentum": None if mod.momentum is None else float(mod.momentum),
        "training": bool(mod.training), "track_running_stats": tracked,
    }, weights=[(r, f"{node.target}.{r}") for r in roles])


def _layernorm(x: Any, normalized_shape: Any, eps: Any) -> dict[str, Any] | None:
    shape = val(normalized_shape)
    shape = [int(shape)] if isinstance(shape, int) else [int(s) for s in shape]
    if _ndim(x) is None or not const(eps) or len(shape) > _ndim(x):
        return None
    return {"normalized_shape": shape, "eps": float(val(eps))}


@for_modules(nn.LayerNorm)
def _layernorm_module(node: fx.Node, mod: nn.LayerNorm) -> FxOp | None:
    attrs = _layernorm(node.args[0], mod.normalized_shape, mod.eps)
    if attrs is None:
        return None
    roles = [r for r in ("weight", "bias") if getattr(mod, r, None) is not None]
    return FxOp("layernorm", [node.args[0]], attrs, weights=[(r, f"{node.target}.{r}") for r in roles])


@for_functions(F.layer_norm, torch.layer_norm)
def _layernorm_function(node: fx.Node) -> FxOp | None:
    params = {"weight": arg(node, 2, "weight"), "bias": arg(node, 3, "bias")}
    attrs = _layernorm(node.args[0], arg(node, 1, "normalized_shape"), arg(node, 4, "eps", 1e-5))
    if attrs is None or not all(p is None or isinstance(p, fx.Node) for p in params.values()):
        return None
    attrs["param_inputs"] = [r for r, p in params.items() if p is not None]
    return FxOp("layernorm", [node.args[0]] + [p for p in params.values() if p is not None], attrs)


def _softmax(kind: str, x: Any, dim: Any, dtype: Any = None) -> FxOp | None:
    ndim, dim, dtype = _ndim(x), val(dim), val(dtype)
    if not ndim or not (dim is None or isinstance(dim, int)):
        return None
    if not (dtype is None or isinstance(dtype, torch.dtype)):
        return None
    if dim is None:  # torch's legacy implicit dim (F._get_softmax_dim)
        dim = 0 if ndim in (0, 1, 3) else 1
    return FxOp(kind, [x], {"dim": dim % ndim,
                            "dtype": None if dtype is None else str(dtype).removeprefix("torch.")})


def _dtype_arg(node: fx.Node) -> Any:
    """dtype is F.softmax's 4th positional argument (after _stacklevel), torch.softmax's 3rd."""
    return arg(node, 3 if node.target in (F.softmax, F.log_softmax) else 2, "dtype")


@for_modules(nn.Softmax, nn.LogSoftmax)
def _softmax_module(node: fx.Node, mod: nn.Module) -> FxOp | None:
    kind = "log_softmax" if isinstance(mod, nn.LogSoftmax) else "softmax"
    return _softmax(kind, node.args[0], mod.dim)


@for_functions(F.softmax, torch.softmax, torch.Tensor.softmax)
def _softmax_function(node: fx.Node) -> FxOp | None:
    return _softmax("softmax", node.args[0], arg(node, 1, "dim"), _dtype_arg(node))


@for_functions(F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)
def _log_softmax_function(node: fx.Node) -> FxOp | None:
    return _softmax("log_softmax", node.args[0], arg(node, 1, "dim"), _dtype_arg(node))


@for_methods("softmax")
def _softmax_method(node: fx.Node) -> FxOp | None:
    return _softmax("softmax", node.args[0], arg(node, 1, "dim"), arg(node, 2, "dtype"))


@for_methods("log_softmax")
def _log_softmax_method(node: fx.Node) -> FxOp | None:
    return _softmax("log_softmax", node.args[0], arg(node, 1, "dim"), arg(node, 2, "dtype"))
