"""How an aten op of a torch.export graph (``soapsearch/_export.py``) names its arguments and
weights: the shared helpers of the aten adapters (``aten_dense``, ``aten_shape``,
``aten_pointwise``), which map each aten op onto the op kind, attrs and weights the fx adapter
of the same torch call gives, so both front ends produce the same OpGraph.

A parameter or buffer is a ``get_attr`` node in an exported graph; an op that reads it as a
weight names it by its qualified name (``node.target``, e.g. ``blocks.0.ln_1.weight``), as the
fx adapters name a module's weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from soapsearch._fx.base import val

__all__ = ["aten", "args_of", "weight_name", "REDUCTION"]

aten = torch.ops.aten

REDUCTION = {0: "none", 1: "mean", 2: "sum"}
"""aten's loss ``reduction`` ints (``torch.nn._reduction.get_enum``) by their names."""


def args_of(node: fx.Node) -> dict[str, Any]:
    """Every argument of an aten call by its schema name, defaults filled in (raw: fx Nodes
    stay Nodes; ``val`` gives their values)."""
    out: dict[str, Any] = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def weight_name(a: Any) -> str | None:
    """The qualified name of the parameter or buffer ``a`` reads whole (a ``get_attr`` of a
    tensor), else None."""
    if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(val(a), torch.Tensor):
        return a.target
    return None
