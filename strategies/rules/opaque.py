"""The rule of an op no other rule knows (an *opaque* op): it is never cut, so it runs whole on
one device (every input gathered there, its output sent on), and it computes by calling what
the model called, recorded at trace time as an ``OpaqueCall``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from strategies.graph import OpNode
from strategies.region import Box
from strategies.rules.base import OPAQUE, OpRule, Reduce, no_reduce, register

__all__ = ["InputRef", "OpaqueCall", "Opaque"]


class InputRef(NamedTuple):
    """The place of the op's input ``index`` in an ``OpaqueCall``'s arguments."""

    index: int


def _fill(arg: Any, inputs: Sequence[torch.Tensor]) -> Any:
    if isinstance(arg, InputRef):
        return inputs[arg.index]
    if isinstance(arg, (list, tuple)) and not hasattr(arg, "_fields"):
        return type(arg)(_fill(a, inputs) for a in arg)
    if isinstance(arg, Mapping):
        return {k: _fill(v, inputs) for k, v in arg.items()}
    return arg


@dataclass(frozen=True, eq=False)
class OpaqueCall:
    """What the model called, with each tensor it passed replaced by an ``InputRef``: a function
    (``fn(*args, **kwargs)``), a tensor method (``method``: ``args[0].method(*args[1:], ...)``)
    or a module (``module``, run by ``torch.func.functional_call`` with the op's weights, so the
    partition's own copies of its parameters are the ones used and trained). Non-tensor
    arguments keep the values they had when the model was traced."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    fn: Callable[..., Any] | None = None
    method: str | None = None
    module: torch.nn.Module | None = None
    mutates: bool = False
    """The call writes into its first tensor argument (``x.relu_()``, ``x += y``): it gets a
    copy, since the input a partition reads is its producer's output or a leaf of autograd."""

    def __call__(self, inputs: Sequence[torch.Tensor], weights: Mapping[str, torch.Tensor]) -> Any:
        if self.mutates:
            inputs = [x.clone() if i == 0 and x is not None else x for i, x in enumerate(inputs)]
        args, kwargs = _fill(self.args, inputs), _fill(dict(self.kwargs), inputs)
        if self.module is not None:
            return torch.func.functional_call(self.module, dict(weights), tuple(args), kwargs)
        if self.method is not None:
            return getattr(args[0], self.method)(*args[1:], **kwargs)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:  # the profiled cost model's cache key reads it
        what = (type(self.module).__name__ if self.module is not None
                else f".{self.method}()" if self.method else getattr(self.fn, "__name__", str(self.fn)))
        return f"OpaqueCall({what})"


def _first(v: Any) -> Any:
    while isinstance(v, (tuple, list)) and v:
        v = v[0]
    return v


@register(OPAQUE)
class Opaque(OpRule):
    """No dim may be cut (``OpRule``'s defaults: every input and weight read whole); the one
    partition calls ``attrs["call"]`` and outputs its first tensor (a module returning a tuple,
    whose other items the tracer checks are unused)."""

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        call = node.attrs.get("call")
        if not isinstance(call, OpaqueCall):
            return super().forward(node, box, inputs, weights, reduce)
        return _first(call(inputs, weights))
