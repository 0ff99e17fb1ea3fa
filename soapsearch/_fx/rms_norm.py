"""fx adapters of RMSNorm: ``nn.RMSNorm`` and ``F.rms_norm`` / ``torch.rms_norm``, one op kind
``"rms_norm"`` (strategies/rules/rms_norm.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._fx.base import FxOp, arg, const, for_functions, for_modules, val


def _attrs(x: Any, normalized_shape: Any, eps: Any) -> dict[str, Any] | None:
    v, shape, eps = val(x), val(normalized_shape), val(eps)
    shape = [int(shape)] if isinstance(shape, int) else [int(s) for s in shape]
    if not isinstance(v, torch.Tensor) or not const(eps) or len(shape) > v.dim():
        return None
    if tuple(v.shape[v.dim() - len(shape):]) != tuple(shape):
        return None
    return {"normalized_shape": shape, "eps": None if eps is None else float(eps)}


@for_modules(nn.RMSNorm)
def _rms_norm_module(node: fx.Node, mod: nn.RMSNorm) -> FxOp | None:
    attrs = _attrs(node.args[0], mod.normalized_shape, mod.eps)
    if attrs is None:
        return None
    weights = [("weight", f"{node.target}.weight")] if mod.weight is not None else []
    return FxOp("rms_norm", [node.args[0]], attrs, weights=weights)


@for_functions(F.rms_norm, torch.rms_norm)
def _rms_norm_function(node: fx.Node) -> FxOp | None:
    weight = arg(node, 2, "weight")
    attrs = _attrs(node.args[0], arg(node, 1, "normalized_shape"), arg(node, 3, "eps"))
    if attrs is None or not (weight is None or isinstance(weight, fx.Node)):
        return None
    attrs["param_inputs"] = ["weight"] if weight is not None else []
    return FxOp("rms_norm", [node.args[0]] + ([weight] if weight is not None else []), attrs)
