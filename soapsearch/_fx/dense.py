"""fx adapters of the dense ops: linear, matmul, embedding, attention."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._fx.base import FxOp, arg, const, for_functions, for_methods, for_modules, val


@for_modules(nn.Linear)
def _linear(node, mod) -> FxOp:
    weights = [("weight", f"{node.target}.weight")]
    if mod.bias is not None:
        weights.append(("bias", f"{node.target}.bias"))
    return FxOp("linear", [node.args[0]], weights=weights)


def _tensor_node(a, min_dim: int = 0) -> bool:
    v = val(a)
    return isinstance(a, fx.Node) and isinstance(v, torch.Tensor) and v.dim() >= min_dim


def _matmul_of(a, b) -> FxOp | None:
    if not (_tensor_node(a, 2) and _tensor_node(b, 2)):
        return None  # a 1-D operand (a vector product) stays opaque
    return FxOp("matmul", [a, b])


@for_functions(torch.matmul, operator.matmul)
def _matmul(node) -> FxOp | None:
    return _matmul_of(arg(node, 0, "input"), arg(node, 1, "other"))


@for_functions(torch.bmm)
def _bmm(node) -> FxOp | None:
    return _matmul_of(arg(node, 0, "input"), arg(node, 1, "mat2"))


@for_methods("matmul", "bmm")
def _matmul_method(node) -> FxOp | None:
    other = arg(node, 1, "other" if node.target == "matmul" else "mat2")
    return _matmul_of(node.args[0], other)


def _embedding_attrs(padding_idx, scale_grad_by_freq, sparse) -> dict:
    return {"padding_idx": padding_idx, "max_norm": None,
            "scale_grad_by_freq": bool(scale_grad_by_freq), "sparse": bool(sparse)}


@for_modules(nn.Embedding)
def _embedding_module(node, mod) -> FxOp | None:
    ids = arg(node, 0, "input")
    if mod.max_norm is not None or not _tensor_node(ids):
        return None  # max_norm renormalizes the weight rows in place
    return FxOp("embedding", [ids],
                _embedding_attrs(mod.padding_idx, mod.scale_grad_by_freq, mod.sparse),
                weights=[("weight", f"{node.target}.weight")])


@for_functions(F.embedding)
def _embedding_function(node) -> FxOp | None:
    ids, weight = arg(node, 0, "input"), arg(node, 1, "weight")
    rest = [arg(node, i, n, d) for i, n, d in
            ((2, "padding_idx", None), (3, "max_norm", None), (5, "scale_grad_by_freq", False),
             (6, "sparse", False))]
    if not (_tensor_node(ids) and isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None  # only a module's own weight can be named as the op's weight
    if not const(rest) or val(rest[1]) is not None:
        return None
    padding_idx, _, scale_grad_by_freq, sparse = val(rest)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += val(weight).shape[0]
    return FxOp("embedding", [ids], _embedding_attrs(padding_idx, scale_grad_by_freq, sparse),
                weights=[("weight", weight.target)])


@for_functions(F.scaled_dot_product_attention)
def _attention(node) -> FxOp | None:
    q, k, v = (arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
    mask = arg(node, 3, "attn_mask")
    opts = [arg(node, 4, "dropout_p", 0.0), arg(node, 5, "is_causal", False), arg(node, 6, "scale"),
            arg(node, 7, "enable_gqa", False)]
    if not (_tensor_node(q, 3) and _tensor_node(k, 2) and _tensor_node(v, 2)) or not const(opts):
        return None
    dropout_p, is_causal, scale, gqa = val(opts)
    if dropout_p or val(k).dim() > val(q).dim() or val(v).dim() > val(q).dim():
        return None  # dropout (random) stays opaque
    if gqa and not (val(q).dim() == val(k).dim() == val(v).dim() == 4):
        return None  # grouped heads: dim -3 of 4-D q, k, v
    if mask is not None and (not _tensor_node(mask) or is_causal
                             or val(mask).dim() > val(q).dim()):
        return None  # a mask with is_causal: torch refuses it
    return FxOp("attention", [q, k, v] + ([mask] if mask is not None else []),
                {"is_causal": bool(is_causal), "scale": None if scale is None else float(scale),
                 "enable_gqa": bool(gqa), "has_mask": mask is not None})
