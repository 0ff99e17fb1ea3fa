"""fx adapters of the losses: F.cross_entropy / nn.CrossEntropyLoss, F.mse_loss / nn.MSELoss."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._fx.base import FxOp, arg, const, for_functions, for_modules, val


def _cross_entropy(x, target, weight: str | None, ignore_index, reduction, label_smoothing) -> FxOp | None:
    vx, vt = val(x), val(target)
    if not (isinstance(x, fx.Node) and isinstance(target, fx.Node) and isinstance(vx, torch.Tensor)
            and isinstance(vt, torch.Tensor)):
        return None
    if vx.dim() < 2 or vt.is_floating_point() or reduction not in ("mean", "sum"):
        return None  # unbatched, class-probability targets, or reduction='none'
    attrs = {"fn": "cross_entropy", "reduction": reduction, "ignore_index": int(ignore_index),
             "label_smoothing": float(label_smoothing)}
    weights = [("class_weight", weight)] if weight is not None else []
    return FxOp("loss", [x, target], attrs, weights=weights, dims_like=target)


def _mse(x, target, reduction) -> FxOp | None:
    vx, vt = val(x), val(target)
    if not (isinstance(x, fx.Node) and isinstance(target, fx.Node) and isinstance(vx, torch.Tensor)
            and isinstance(vt, torch.Tensor)):
        return None
    if vx.shape != vt.shape or vx.dim() == 0 or reduction not in ("mean", "sum"):
        return None  # broadcast targets, a scalar, or reduction='none'
    return FxOp("loss", [x, target], {"fn": "mse_loss", "reduction": reduction}, dims_like=x)


@for_functions(F.cross_entropy)
def _cross_entropy_function(node) -> FxOp | None:
    opts = [arg(node, i, n, d) for i, n, d in
            ((3, "size_average", None), (4, "ignore_index", -100), (5, "reduce", None),
             (6, "reduction", "mean"), (7, "label_smoothing", 0.0))]
    weight = arg(node, 2, "weight")
    if not const(opts) or val(opts[0]) is not None or val(opts[2]) is not None:
        return None  # legacy size_average / reduce
    if weight is not None and not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None  # class weights computed in forward
    _, ignore_index, _, reduction, smoothing = val(opts)
    return _cross_entropy(arg(node, 0, "input"), arg(node, 1, "target"),
                          None if weight is None else weight.target, ignore_index, reduction, smoothing)


@for_modules(nn.CrossEntropyLoss)
def _cross_entropy_module(node, mod) -> FxOp | None:
    weight = f"{node.target}.weight" if mod.weight is not None else None
    return _cross_entropy(arg(node, 0, "input"), arg(node, 1, "target"), weight, mod.ignore_index,
                          mod.reduction, mod.label_smoothing)


@for_functions(F.mse_loss)
def _mse_function(node) -> FxOp | None:
    opts = [arg(node, 2, "size_average"), arg(node, 3, "reduce"), arg(node, 4, "reduction", "mean"),
            arg(node, 5, "weight")]
    if not const(opts) or val(opts[0]) is not None or val(opts[1]) is not None or val(opts[3]) is not None:
        return None
    return _mse(arg(node, 0, "input"), arg(node, 1, "target"), val(opts[2]))


@for_modules(nn.MSELoss)
def _mse_module(node, mod) -> FxOp | None:
    return _mse(arg(node, 0, "input"), arg(node, 1, "target"), mod.reduction)
