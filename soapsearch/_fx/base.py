"""How fx nodes become ops: a registry of adapters, one per module type, function or method.

An adapter looks at one fx node (after shape propagation, so every node's value is in
``node.meta["val"]``) and says which op kind it is, which tensors it reads in the order its rule
expects, which of the module's tensors are its weights, and the attrs its rule needs. It returns
None when it cannot express the node, which then becomes an opaque op.

Two kinds are markers, not op kinds: ``ALIAS`` (the node is its input) and ``MULTI`` (the node's
value is a tuple of tensors, each a block of its input; each item read is a slice op).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["FxOp", "ALIAS", "MULTI", "adapter_for", "for_modules", "for_functions", "for_methods",
           "val", "const"]

ALIAS = "alias"  # the node is its input (getitem 0 of an LSTM, contiguous(), nn.Identity, ...)
MULTI = "multi"
"""A node whose value is a tuple of tensors, item i being rows [bounds[i], bounds[i+1]) of its
input 0 on one dim (split, chunk, tensor_split, unbind): not an op itself; each
``getitem(node, i)`` the model reads is a ``slice`` op of input 0. Attrs ``{"dim": d,
"bounds": [0, ..., size], "drop": bool}`` (drop: every item is one row with the dim removed, as
unbind). Built by ``soapsearch._fx.multi.multi_output``."""


@dataclass
class FxOp:
    kind: str
    inputs: list[fx.Node]
    attrs: dict[str, Any] = field(default_factory=dict)
    weights: list[tuple[str, str]] = field(default_factory=list)  # (role, qualified name)
    dims_like: fx.Node | None = None  # whose shape the op's dims follow (a loss: its targets)


Adapter = Callable[..., "FxOp | None"]
_MODULES: dict[type, Adapter] = {}
_FUNCTIONS: dict[Any, Adapter] = {}
_METHODS: dict[str, Adapter] = {}


def _registrar(table: dict, keys: tuple) -> Callable[[Adapter], Adapter]:
    def deco(fn: Adapter) -> Adapter:
        for k in keys:
            if k in table and table[k] is not fn:
                raise ValueError(f"fx target {k!r} has two adapters: {table[k].__qualname__} "
                                 f"and {fn.__qualname__}")
            table[k] = fn
        return fn
    return deco


def for_modules(*types: type) -> Callable[[Adapter], Adapter]:
    """Adapter ``fn(node, module) -> FxOp | None`` for call_module nodes of these types."""
    return _registrar(_MODULES, types)


def for_functions(*fns: Any) -> Callable[[Adapter], Adapter]:
    """Adapter ``fn(node) -> FxOp | None`` for call_function nodes of these targets."""
    return _registrar(_FUNCTIONS, fns)


def for_methods(*names: str) -> Callable[[Adapter], Adapter]:
    """Adapter ``fn(node) -> FxOp | None`` for call_method nodes (``x.view(...)``)."""
    return _registrar(_METHODS, names)


def adapter_for(node: fx.Node, gm: fx.GraphModule) -> Callable[[], FxOp | None] | None:
    """A thunk that adapts ``node``, or None when no adapter knows its target."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        for t in type(mod).__mro__:
            if t in _MODULES:
                fn = _MODULES[t]
                return lambda: fn(node, mod)
        return None
    if node.op == "call_function":
        fn = _FUNCTIONS.get(node.target)
        return (lambda: fn(node)) if fn else None
    if node.op == "call_method":
        fn = _METHODS.get(node.target)
        return (lambda: fn(node)) if fn else None
    return None


def val(arg: Any) -> Any:
    """The value an fx argument had during shape propagation (recursively through lists)."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(val(a) for a in arg)
    if isinstance(arg, slice):
        return slice(val(arg.start), val(arg.stop), val(arg.step))
    return arg


def const(arg: Any) -> bool:
    """True when an argument holds no tensor (a Python number, None, a tuple of ints, ...)."""
    v = val(arg)
    if isinstance(v, torch.Tensor):
        return False
    if isinstance(v, (list, tuple)):
        return all(const(a) for a in v)
    return True


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument of a call node, raw (may be an fx.Node)."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)
