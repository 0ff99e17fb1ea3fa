"""aten adapters of the ops that compute with weights or windows: linear, matmul, embedding,
attention, conv2d, pooling, the normalizations and the losses; each gives the op the fx
adapter of the same torch call gives (``soapsearch/_fx/dense.py``, ``conv.py``, ``norm.py``,
``loss.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from soapsearch._fx import conv, loss, norm
from soapsearch._fx.aten import REDUCTION, args_of, aten, weight_name
from soapsearch._fx.base import FxOp, for_functions, val
from soapsearch._fx.dense import _embedding_attrs, _matmul_of, _tensor_node


def _params(a: dict[str, Any], roles: tuple[str, ...]) -> tuple[list[tuple[str, str]], list[str], list[fx.Node]] | None:
    """The op's parameters: (weights named by get_attr, roles that come as tensor inputs,
    those inputs); None when a weight is something else than a tensor or None."""
    weights, roles_in, inputs = [], [], []
    for r in roles:
        p = a[r]
        if p is None:
            continue
        name = weight_name(p)
        if name is not None:
            weights.append((r, name))
        elif isinstance(p, fx.Node) and isinstance(val(p), torch.Tensor):
            roles_in.append(r)
            inputs.append(p)
        else:
            return None
    return weights, roles_in, inputs


@for_functions(aten.linear.default)
def _linear(node: fx.Node) -> FxOp | None:
    """linear(x, W, b) with W (and b) parameters: the fx nn.Linear op; a computed W is a matmul
    with its transpose (no such model is known), so it stays opaque."""
    a = args_of(node)
    p = _params(a, ("weight", "bias"))
    if p is None or p[1] or not _tensor_node(a["input"]):
        return None
    return FxOp("linear", [a["input"]], weights=p[0])


@for_functions(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(node: fx.Node) -> FxOp | None:
    return _matmul_of(node.args[0], node.args[1])


@for_functions(aten.embedding.default)
def _embedding(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    name = weight_name(a["weight"])
    if name is None or not _tensor_node(a["indices"]):
        return None  # only a module's own weight can be named as the op's weight
    pad = val(a["padding_idx"])
    pad = None if pad == -1 else (pad % val(a["weight"]).shape[0] if pad is not None else None)
    return FxOp("embedding", [a["indices"]],
                _embedding_attrs(pad, val(a["scale_grad_by_freq"]), val(a["sparse"])),
                weights=[("weight", name)])


@for_functions(aten.scaled_dot_product_attention.default)
def _attention(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if not (_tensor_node(q, 3) and _tensor_node(k, 2) and _tensor_node(v, 2)):
        return None
    if val(a["dropout_p"]) or val(k).dim() > val(q).dim() or val(v).dim() > val(q).dim():
        return None  # dropout (random) stays opaque
    scale, gqa, causal = val(a["scale"]), bool(val(a["enable_gqa"])), bool(val(a["is_causal"]))
    if gqa and not (val(q).dim() == val(k).dim() == val(v).dim() == 4):
        return None  # grouped heads: dim -3 of 4-D q, k, v
    if mask is not None and (not _tensor_node(mask) or causal or val(mask).dim() > val(q).dim()):
        return None  # a mask with is_causal: torch refuses it
    return FxOp("attention", [q, k, v] + ([mask] if mask is not None else []),
                {"is_causal": causal, "scale": None if scale is None else float(scale),
                 "enable_gqa": gqa, "has_mask": mask is not None})


# --- windows ------------------------------------------------------------------------------
@for_functions(aten.conv2d.default, aten.conv2d.padding)
def _conv2d(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    x, w = a["input"], a["weight"]
    p = _params(a, ("weight", "bias"))
    if not conv._nchw(x) or p is None or not isinstance(w, fx.Node):
        return None
    weights, roles_in, inputs = p
    attrs = conv._conv(tuple(val(w).shape[2:]), a["stride"], a["padding"], a["dilation"],
                       a["groups"], "zeros")
    if roles_in:
        if roles_in[0] != "weight":
            return None  # a parameter weight with a computed bias: no fx call gives it
        attrs["param_inputs"] = roles_in
    return FxOp("conv2d", [x] + inputs, attrs, weights=weights)


@for_functions(aten.max_pool2d.default)
def _max_pool(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    return conv._pool(node, a["self"], "max", a["kernel_size"], a["stride"], a["padding"],
                      a["dilation"], a["ceil_mode"])


@for_functions(aten.avg_pool2d.default)
def _avg_pool(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    return conv._pool(node, a["self"], "avg", a["kernel_size"], a["stride"], a["padding"], 1,
                      a["ceil_mode"], a["count_include_pad"], a["divisor_override"])


@for_functions(aten.adaptive_avg_pool2d.default)
def _adaptive_avg(node: fx.Node) -> FxOp | None:
    return conv._adaptive(node, "avg")


# --- normalizations -----------------------------------------------------------------------
@for_functions(aten.batch_norm.default)
def _batch_norm(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    roles = ("weight", "bias", "running_mean", "running_var")
    names = {r: weight_name(a[r]) for r in roles}
    if norm._ndim(a["input"]) != 4 or any(a[r] is not None and names[r] is None for r in roles):
        return None
    if (a["weight"] is None) != (a["bias"] is None) or (a["running_mean"] is None) != (a["running_var"] is None):
        return None
    momentum = val(a["momentum"])
    return FxOp("batchnorm2d", [a["input"]], {
        "eps": float(val(a["eps"])), "momentum": None if momentum is None else float(momentum),
        "training": bool(val(a["training"])), "track_running_stats": a["running_mean"] is not None,
    }, weights=[(r, names[r]) for r in roles if names[r] is not None])


@for_functions(aten.layer_norm.default)
def _layer_norm(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    attrs = norm._layernorm(a["input"], a["normalized_shape"], a["eps"])
    p = _params(a, ("weight", "bias"))
    if attrs is None or p is None or (p[0] and p[1]):
        return None  # a parameter weight beside a computed bias: no fx call gives it
    weights, roles_in, inputs = p
    if roles_in:
        attrs["param_inputs"] = roles_in
    return FxOp("layernorm", [a["input"]] + inputs, attrs, weights=weights)


@for_functions(aten.rms_norm.default)
def _rms_norm(node: fx.Node) -> FxOp | None:
    """rms_norm (Zhang & Sennrich 2019): the ``rms_norm`` op, its weight role ``weight``; eps
    None is torch's default, the dtype's machine epsilon (``torch.finfo(dtype).eps``)."""
    a = args_of(node)
    x, eps = val(a["input"]), val(a["eps"])
    shape = val(a["normalized_shape"])
    name = weight_name(a["weight"])
    if not isinstance(x, torch.Tensor) or (a["weight"] is not None and name is None):
        return None
    shape = [int(s) for s in shape]
    return FxOp("rms_norm", [a["input"]], {
        "normalized_shape": shape, "eps": float(torch.finfo(x.dtype).eps if eps is None else eps)},
        weights=[("weight", name)] if name is not None else [])


@for_functions(aten.softmax.int, aten.log_softmax.int)
def _softmax(node: fx.Node) -> FxOp | None:
    kind = "log_softmax" if node.target is aten.log_softmax.int else "softmax"
    a = args_of(node)
    return norm._softmax(kind, a["self"], a["dim"], a["dtype"])


@for_functions(aten._softmax.default, aten._log_softmax.default)
def _softmax_internal(node: fx.Node) -> FxOp | None:
    kind = "log_softmax" if node.target is aten._log_softmax.default else "softmax"
    x, dim, half_to_float = node.args
    return None if val(half_to_float) else norm._softmax(kind, x, dim)


# --- losses -------------------------------------------------------------------------------
@for_functions(aten.cross_entropy_loss.default)
def _cross_entropy(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    weight = a["weight"]
    if weight is not None and weight_name(weight) is None:
        return None  # class weights computed in forward
    return loss._cross_entropy(a["self"], a["target"], weight_name(weight) if weight is not None else None,
                               val(a["ignore_index"]), REDUCTION.get(val(a["reduction"])),
                               val(a["label_smoothing"]))


@for_functions(aten.mse_loss.default)
def _mse(node: fx.Node) -> FxOp | None:
    a = args_of(node)
    return loss._mse(a["self"], a["target"], REDUCTION.get(val(a["reduction"])))
