"""fx adapters of the sliding-window ops: conv2d, pool2d, adaptive_pool2d (NCHW inputs only;
an unbatched CHW call becomes an opaque op)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._fx.base import FxOp, arg, const, for_functions, for_modules, val


def _pair(v: Any) -> tuple[int, int]:
    v = val(v)
    if isinstance(v, (tuple, list)):
        return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))
    return int(v), int(v)


def _nchw(x: Any) -> bool:
    v = val(x)
    return isinstance(v, torch.Tensor) and v.dim() == 4


def _conv(kernel: tuple[int, ...], stride: Any, padding: Any, dilation: Any, groups: Any,
          padding_mode: str) -> dict[str, Any]:
    """Conv attrs, with string padding resolved as torch does: 'same' puts d*(k-1)//2 before
    and the rest after (ATen ``_convolution_mode``), 'valid' is 0."""
    dilation = _pair(dilation)
    padding = val(padding)
    if isinstance(padding, str):
        total = [0, 0] if padding == "valid" else [d * (k - 1) for d, k in zip(dilation, kernel)]
        lo, hi = [t // 2 for t in total], [t - t // 2 for t in total]
    else:
        lo = hi = list(_pair(padding))
    return {"stride": list(_pair(stride)), "padding": lo, "padding_hi": hi,
            "dilation": list(dilation), "groups": int(val(groups)), "padding_mode": padding_mode}


@for_modules(nn.Conv2d)
def _conv2d_module(node: fx.Node, mod: nn.Conv2d) -> FxOp | None:
    x = node.args[0]
    if not _nchw(x):
        return None
    weights = [("weight", f"{node.target}.weight")]
    if mod.bias is not None:
        weights.append(("bias", f"{node.target}.bias"))
    attrs = _conv(tuple(mod.kernel_size), mod.stride, mod.padding, mod.dilation, mod.groups,
                  mod.padding_mode)
    return FxOp("conv2d", [x], attrs, weights=weights)


@for_functions(F.conv2d, torch.conv2d)
def _conv2d_function(node: fx.Node) -> FxOp | None:
    x, w, b = node.args[0], arg(node, 1, "weight"), arg(node, 2, "bias")
    if not _nchw(x) or not isinstance(w, fx.Node) or not (b is None or isinstance(b, fx.Node)):
        return None
    attrs = _conv(tuple(val(w).shape[2:]), arg(node, 3, "stride", 1),
                  arg(node, 4, "padding", 0), arg(node, 5, "dilation", 1), arg(node, 6, "groups", 1),
                  "zeros")
    attrs["param_inputs"] = ["weight"] + (["bias"] if b is not None else [])
    return FxOp("conv2d", [x, w] + ([b] if b is not None else []), attrs)


def _pool(node: fx.Node, x: Any, mode: str, kernel: Any, stride: Any, padding: Any, dilation: Any,
          ceil_mode: Any, count_include_pad: Any = True, divisor_override: Any = None,
          return_indices: Any = False) -> FxOp | None:
    args = (kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override,
            return_indices)
    if not _nchw(x) or not all(const(a) for a in args):
        return None
    stride = val(stride)
    return FxOp("pool2d", [x], {
        "mode": mode, "kernel": list(_pair(kernel)),
        "stride": list(_pair(kernel if stride is None or stride == [] or stride == () else stride)),
        "padding": list(_pair(padding)), "dilation": list(_pair(dilation)),
        "ceil_mode": bool(val(ceil_mode)), "count_include_pad": bool(val(count_include_pad)),
        "divisor_override": val(divisor_override), "return_indices": bool(val(return_indices))})


@for_modules(nn.MaxPool2d)
def _max_pool_module(node: fx.Node, mod: nn.MaxPool2d) -> FxOp | None:
    return _pool(node, node.args[0], "max", mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                 mod.ceil_mode, return_indices=mod.return_indices)


@for_modules(nn.AvgPool2d)
def _avg_pool_module(node: fx.Node, mod: nn.AvgPool2d) -> FxOp | None:
    return _pool(node, node.args[0], "avg", mod.kernel_size, mod.stride, mod.padding, 1,
                 mod.ceil_mode, mod.count_include_pad, mod.divisor_override)


@for_functions(F.max_pool2d, torch.max_pool2d)
def _max_pool_function(node: fx.Node) -> FxOp | None:
    return _pool(node, node.args[0], "max", arg(node, 1, "kernel_size"), arg(node, 2, "stride"),
                 arg(node, 3, "padding", 0), arg(node, 4, "dilation", 1),
                 arg(node, 5, "ceil_mode", False), return_indices=arg(node, 6, "return_indices", False))


@for_functions(F.avg_pool2d)
def _avg_pool_function(node: fx.Node) -> FxOp | None:
    return _pool(node, node.args[0], "avg", arg(node, 1, "kernel_size"), arg(node, 2, "stride"),
                 arg(node, 3, "padding", 0), 1, arg(node, 4, "ceil_mode", False),
                 arg(node, 5, "count_include_pad", True), arg(node, 6, "divisor_override"))


def _adaptive(node: fx.Node, mode: str, return_indices: Any = False) -> FxOp | None:
    x = node.args[0]
    if not _nchw(x) or not const(return_indices):
        return None
    return FxOp("adaptive_pool2d", [x], {"mode": mode, "return_indices": bool(val(return_indices))})


@for_modules(nn.AdaptiveAvgPool2d)
def _adaptive_avg_module(node: fx.Node, mod: nn.AdaptiveAvgPool2d) -> FxOp | None:
    return _adaptive(node, "avg")


@for_modules(nn.AdaptiveMaxPool2d)
def _adaptive_max_module(node: fx.Node, mod: nn.AdaptiveMaxPool2d) -> FxOp | None:
    return _adaptive(node, "max", mod.return_indices)


@for_functions(F.adaptive_avg_pool2d)
def _adaptive_avg_function(node: fx.Node) -> FxOp | None:
    return _adaptive(node, "avg")


@for_functions(F.adaptive_max_pool2d)
def _adaptive_max_function(node: fx.Node) -> FxOp | None:
    return _adaptive(node, "max", arg(node, 2, "return_indices", False))
