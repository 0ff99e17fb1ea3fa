"""fx adapters of the scans (``cumsum``, ``cumprod``), as torch functions, tensor methods and
the aten ops torch.export records."""

from __future__ import annotations

import torch
import torch.fx as fx

from soapsearch._fx.base import FxOp, arg, const, for_functions, for_methods, val

aten = torch.ops.aten


def _scan(node: fx.Node, fn: str) -> FxOp | None:
    x, dim, dtype = node.args[0], arg(node, 1, "dim"), arg(node, 2, "dtype")
    out = val(node)
    if not (isinstance(x, fx.Node) and isinstance(val(x), torch.Tensor) and isinstance(out, torch.Tensor)
            and const([dim, dtype]) and isinstance(val(dim), int) and out.dim() > 0):
        return None
    dtype = val(dtype)
    return FxOp("scan", [x], {"fn": fn, "dim": val(dim) % out.dim(),
                              "dtype": None if dtype is None else str(dtype).removeprefix("torch.")})


@for_functions(torch.cumsum, aten.cumsum.default)
@for_methods("cumsum")
def _cumsum(node: fx.Node) -> FxOp | None:
    return _scan(node, "cumsum")


@for_functions(torch.cumprod, aten.cumprod.default)
@for_methods("cumprod")
def _cumprod(node: fx.Node) -> FxOp | None:
    return _scan(node, "cumprod")
