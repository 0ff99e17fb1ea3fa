"""The op an fx node becomes when no adapter expresses it: opaque, run whole on one device by
calling what the model called (``strategies.rules.opaque.OpaqueCall``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from soapsearch._fx.base import FxOp, val
from strategies.rules import OPAQUE
from strategies.rules.opaque import InputRef, OpaqueCall

__all__ = ["opaque_op"]


def _template(a: Any, inputs: list[fx.Node]) -> Any:
    """``a`` with each tensor-valued node an ``InputRef`` (inputs deduplicated in order of first
    use) and every other node the value it had when traced (a size, a dtype, a device)."""
    if isinstance(a, fx.Node):
        if isinstance(val(a), torch.Tensor):
            if a not in inputs:
                inputs.append(a)
            return InputRef(inputs.index(a))
        return val(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_template(x, inputs) for x in a)
    if isinstance(a, dict):
        return {k: _template(v, inputs) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_template(a.start, inputs), _template(a.stop, inputs), _template(a.step, inputs))
    return a


_AUGMENTED = frozenset(f"i{op}" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod",
                                            "pow", "and", "or", "xor", "lshift", "rshift"))
"""Python's augmented assignments as fx records them (``operator.iadd`` for ``x += y``)."""


def _inplace(name: str) -> bool:
    """Whether a call named ``name`` writes into its first argument: torch's ``add_`` naming,
    or an augmented assignment."""
    return (name.endswith("_") and not name.startswith("__")) or name in _AUGMENTED


def opaque_op(n: fx.Node, gm: fx.GraphModule, target: str) -> FxOp:
    """The opaque op of call node ``n`` (``target`` names it for messages): its tensor arguments
    are its inputs; a module's parameters and buffers are its weights, named as the model's
    ``state_dict`` names them, with roles their names inside the module."""
    inputs: list[fx.Node] = []
    args, kwargs = _template(tuple(n.args), inputs), _template(dict(n.kwargs), inputs)
    weights: list[tuple[str, str]] = []
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    mutates = n.op != "call_module" and (_inplace(name) or kwargs.get("inplace") is True)
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        named = [*mod.named_parameters(), *mod.named_buffers()]
        weights = [(role, f"{n.target}.{role}") for role, _ in named]
        call = OpaqueCall(args, kwargs, module=mod)
    elif n.op == "call_method":
        call = OpaqueCall(args, kwargs, method=n.target, mutates=mutates)
    else:
        call = OpaqueCall(args, kwargs, fn=n.target, mutates=mutates)
    return FxOp(OPAQUE, inputs, {"target": target, "call": call}, weights=weights)
