"""Rules of the pointwise ops (elementwise math, add, mul, dropout) and of reductions over dims.

An elementwise op names its function in ``attrs["fn"]`` (a key of ``FUNCTIONS``) and its call
as templates ``attrs["args"]`` / ``attrs["kwargs"]``: ``{"input": i}`` stands for the i-th
tensor input, ``{"dtype": "float16"}`` for a torch dtype, anything else is a Python constant.
forward rebuilds the call on the sliced inputs, so every dim splits and each input reads the
box broadcast to its shape (numpy broadcasting: a size-1 dim reads [0, 1)).
"""

from __future__ import annotations

import contextvars
import hashlib
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import OpNode
from strategies.region import Box, slice_box
from strategies.rules.base import Reduce, SplitAll, broadcast_region, no_reduce, register

__all__ = ["FUNCTIONS", "TORCH_POINTWISE", "F_POINTWISE", "OPERATOR_POINTWISE", "REDUCTIONS",
           "set_dropout_seed", "dropout_seed", "dropout_generator"]

# Pointwise functions that exist both as torch.<name> and Tensor.<name> (x first).
TORCH_POINTWISE = (
    "relu", "tanh", "sigmoid", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "neg",
    "abs", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh", "cosh", "asin", "acos", "atan", "erf",
    "erfc", "reciprocal", "square", "sign", "floor", "ceil", "round", "trunc", "frac", "pow",
    "clamp", "clip", "clamp_min", "clamp_max", "where", "masked_fill", "add", "sub", "mul",
    "div", "true_divide", "floor_divide", "remainder", "fmod", "maximum", "minimum", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "logical_xor",
    "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num", "lerp", "addcmul", "addcdiv",
    "atan2", "hypot", "logit", "float_power", "copysign", "detach", "xlogy",
)
# torch.nn.functional activations (x first).
F_POINTWISE = (
    "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu", "softplus",
    "softsign", "hardtanh", "hardswish", "hardsigmoid", "sigmoid", "tanh", "logsigmoid",
    "tanhshrink", "threshold", "hardshrink", "softshrink",
)
# Python operators (either operand may be a Python scalar).
OPERATOR_POINTWISE = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "invert",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor",
)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _table() -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {"cast": _cast}
    for n in TORCH_POINTWISE:
        if hasattr(torch, n):
            out[f"torch.{n}"] = getattr(torch, n)
        if hasattr(torch.Tensor, n):
            out[f"Tensor.{n}"] = getattr(torch.Tensor, n)
    out.update({f"F.{n}": getattr(F, n) for n in F_POINTWISE if hasattr(F, n)})
    out.update({f"operator.{n}": getattr(operator, n) for n in OPERATOR_POINTWISE})
    return out


FUNCTIONS: dict[str, Callable[..., Any]] = _table()
"""Every function an elementwise op may name in ``attrs["fn"]``."""


def _fill(t: Any, inputs: Sequence[torch.Tensor]) -> Any:
    """An argument template with its ``{"input": i}`` / ``{"dtype": ...}`` holes filled."""
    if isinstance(t, Mapping):
        return inputs[t["input"]] if "input" in t else getattr(torch, t["dtype"])
    if isinstance(t, (list, tuple)):
        return [_fill(v, inputs) for v in t]
    return t


@register("elementwise", "add", "mul")
class Elementwise(SplitAll):
    """out = fn(*args) pointwise with broadcasting: every dim splits, inputs read the box broadcast."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return tuple(broadcast_region(box, s.shape, len(box)) for s in node.input_specs)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        kwargs = {k: _fill(v, inputs) for k, v in a.get("kwargs", {}).items()}
        return FUNCTIONS[a["fn"]](*_fill(a["args"], inputs), **kwargs)


# --- dropout ------------------------------------------------------------------------------
_DROPOUT_SEED: contextvars.ContextVar[int] = contextvars.ContextVar("soapsearch_dropout_seed",
                                                                   default=0)


def set_dropout_seed(step_seed: int) -> contextvars.Token:
    """Set the seed every dropout mask of this step derives from (in this context; threads
    started later begin with the default 0); returns the token that resets it."""
    return _DROPOUT_SEED.set(int(step_seed))


def dropout_seed() -> int:
    return _DROPOUT_SEED.get()


def dropout_generator(op_name: str, step_seed: int | None = None) -> torch.Generator:
    """A CPU generator seeded from (step seed, sha256 of the op name): the same on every rank."""
    seed = dropout_seed() if step_seed is None else step_seed
    digest = hashlib.sha256(f"{seed}:{op_name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@register("dropout")
class Dropout(SplitAll):
    """Dropout(p): identity when p == 0 or not training, else x * mask / (1 - p) with the bool mask
    drawn for the full output from ``dropout_generator(op name)`` and sliced to the box, so a
    split run drops exactly what one device would. Cost: each partition draws the whole mask
    (full numel random numbers on the CPU), not just its slice."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        x, p = inputs[0], float(node.attrs["p"])
        if p == 0.0 or not node.attrs["training"]:
            return x
        if p >= 1.0:
            return torch.zeros_like(x)
        keep = torch.rand(node.shape, generator=dropout_generator(node.name)) >= p
        mask = keep[slice_box(box)].to(device=x.device)  # bool: autograd saves 1 byte an element
        return x * mask / (1.0 - p)


# --- reductions over dims -----------------------------------------------------------------
REDUCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin,
    "nansum": torch.nansum, "nanmean": torch.nanmean, "logsumexp": torch.logsumexp,
    "prod": torch.prod, "var": torch.var, "std": torch.std, "all": torch.all, "any": torch.any,
}
"""Functions a reduce op may name in ``attrs["fn"]``, called as fn(x, dim=..., keepdim=...)."""


def _kept(node: OpNode) -> list[int | None]:
    """For each input dim, the output dim it becomes (None: reduced away)."""
    dims, keep = set(node.attrs["dims"]), node.attrs["keepdim"]
    out, j = [], 0
    for i in range(len(node.input_specs[0].shape)):
        if i in dims and not keep:
            out.append(None)
        else:
            out.append(j)
            j += 1
    return out


@register("reduce")
class ReduceDims(SplitAll):
    """fn(x, dim=dims, keepdim): output dims are the kept input dims; reduced dims are read whole."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        shape, dims = node.input_specs[0].shape, set(node.attrs["dims"])
        return (tuple((0, s) if i in dims else box[j]
                      for i, (s, j) in enumerate(zip(shape, _kept(node)))),)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        dims = list(a["dims"])
        dim: Any = dims[0] if a["fn"] in ("prod", "all", "any") and len(dims) == 1 else dims
        kwargs = {k: _fill(v, inputs) for k, v in a.get("kwargs", {}).items()}
        return REDUCTIONS[a["fn"]](inputs[0], dim=dim, keepdim=a["keepdim"], **kwargs)

