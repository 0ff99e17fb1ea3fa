"""The torch.export front end of ``soapsearch.trace``: capture a model that torch.fx cannot trace
(Python control flow over shapes, HF transformers' mask building) as an fx GraphModule of aten
ops, in the shape the aten adapters (``soapsearch/_fx/aten*.py``) read.

* **Capture**: ``torch.export.export(model, args, strict=False)`` (non-strict: the model's
  Python runs as is, tensors are fake), the training IR (``aten.linear``,
  ``aten.scaled_dot_product_attention`` ... stay whole). Dim 0 of every batched input is
  dynamic (``Dim.AUTO``), so the one graph propagates at the batch and at twice it and the
  sample dim is found as for fx; a batch of 1 is exported at 2 (export specializes sizes 0 and
  1). torch releases whose ``export`` decomposes to core aten have ``export_for_training``,
  which is used where it exists.
* **Canonical form**: the guard checks export inserts are dropped; a constant ``pad`` becomes
  a concat with ``full`` blocks (HF's causal-LM loss pads the labels with ``ignore_index``); chains of ``aten.slice`` /
  ``aten.select`` become one ``operator.getitem`` (the node fx records for ``x[:, -1]``), whole
  slices vanish; ``aten.addmm(b, x, w)`` becomes ``x @ w + b`` (GPT-2's Conv1D keeps its weight
  as [in, out], which a linear's [out, in] rule cannot name).
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx

__all__ = ["export_module", "canonicalize", "export_reason"]

aten = torch.ops.aten

_INT_MAX = 2**63 - 1

def _export_fn():
    """``torch.export.export_for_training`` where this torch has it (it is ``export``'s training
    IR on the releases whose ``export`` decomposes further), else ``torch.export.export``."""
    return getattr(torch.export, "export_for_training", None) or torch.export.export


def export_module(model: torch.nn.Module, args: Sequence[Any]) -> fx.GraphModule:
    """``model`` captured by torch.export (non-strict) with dim 0 of every batched tensor input
    dynamic, in canonical form (``canonicalize``). Raises what torch.export raises."""
    batched = [isinstance(a, torch.Tensor) and a.dim() > 0 for a in args]
    if any(b and a.shape[0] == 1 for a, b in zip(args, batched)):  # export specializes a 1
        args = [torch.empty((2, *a.shape[1:]), dtype=a.dtype, device=a.device) if b else a
                for a, b in zip(args, batched)]
    dims = tuple({0: torch.export.Dim.AUTO} if b else None for b in batched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations, attributes assigned during export
        ep = _export_fn()(model, tuple(args), dynamic_shapes=dims, strict=False)
        gm = ep.module()
    canonicalize(gm)
    return gm


def export_reason(e: BaseException) -> str:
    """One line saying why torch.export failed: the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


# --- canonical form -----------------------------------------------------------------------
def canonicalize(gm: fx.GraphModule) -> None:
    """Drop export's guard checks, turn slice/select chains into getitem and addmm into a
    matmul plus an add, in place."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn" or (
                n.op == "call_function" and n.target in (aten._assert_scalar.default,
                                                         aten.sym_constrain_range_for_size.default)):
            g.erase_node(n)
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target in (aten.slice.Tensor, aten.select.int):
            _to_getitem(g, n)
        elif n.target is aten.pad.default and _constant_pad(n):
            _pad_as_concat(g, n)
        elif n.target is aten.addmm.default and _plain_addmm(n):
            bias, x, w = n.args[:3]
            with g.inserting_before(n):
                mm = g.call_function(aten.mm.default, (x, w))
                mm.meta.update(stack_trace=n.meta.get("stack_trace"))
                add = g.call_function(aten.add.Tensor, (mm, bias))
                add.meta.update(stack_trace=n.meta.get("stack_trace"))
            n.replace_all_uses_with(add)
            g.erase_node(n)
    for n in reversed(list(g.nodes)):  # dead code the rewrites left
        if n.op == "call_function" and not n.users and not _impure(n):
            g.erase_node(n)
    gm.recompile()


def _impure(n: fx.Node) -> bool:
    """Nodes dead-code removal keeps: in-place ops (a buffer's ``add_``) and assertions."""
    name = getattr(getattr(n.target, "_schema", None), "name", "")
    return name.endswith("_") or "_assert" in name


def _plain_addmm(n: fx.Node) -> bool:
    return all(n.kwargs.get(k, 1) == 1 for k in ("beta", "alpha")) and len(n.args) == 3


def _constant_pad(n: fx.Node) -> bool:
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    pads = n.args[1]
    return mode == "constant" and all(isinstance(p, int) and p >= 0 for p in pads)


def _pad_as_concat(g: fx.Graph, n: fx.Node) -> None:
    """``pad(x, pads, value=v)`` (``F.pad``: pairs (before, after) from the last dim back) as
    ``cat([full(before-block, v), x, full(after-block, v)], dim)`` per padded dim."""
    x, pads = n.args[0], list(n.args[1])
    value = n.args[3] if len(n.args) > 3 else n.kwargs.get("value")
    out = n.meta["val"]  # the same rank, dtype and device as x
    ndim, dtype = out.dim(), out.dtype
    cur = x
    with g.inserting_before(n):
        for k in range(len(pads) // 2):
            dim, (lo, hi) = ndim - 1 - k, pads[2 * k:2 * k + 2]
            if not lo and not hi:
                continue
            sizes = [g.call_function(aten.sym_size.int, (cur, d)) for d in range(ndim)]
            parts = []
            for width, at_end in ((lo, False), (hi, True)):
                if width:
                    shape = [width if d == dim else sizes[d] for d in range(ndim)]
                    block = g.call_function(aten.full.default, (shape, 0.0 if value is None else value),
                                            {"dtype": dtype, "device": out.device})
                    parts.append((at_end, block))
            cur = g.call_function(aten.cat.default, (
                [b for e, b in parts if not e] + [cur] + [b for e, b in parts if e], dim))
            cur.meta.update(stack_trace=n.meta.get("stack_trace"))
    n.replace_all_uses_with(cur)
    g.erase_node(n)


def _full(s: Any) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop in (None, _INT_MAX) \
        and s.step in (None, 1)


def _to_getitem(g: fx.Graph, n: fx.Node) -> None:
    """``n`` (slice or select on one dim) as ``getitem(root, index)``, merged into its input's
    getitem when that one has no other reader and leaves the dim whole."""
    src, dim = n.args[0], n.args[1]
    ndim = n.meta["val"].dim() + (n.target is aten.select.int)  # the input's rank
    dim = dim % ndim
    if n.target is aten.select.int:
        item: Any = n.args[2]
    else:
        start, stop, step = (list(n.args[2:]) + [None, None, None])[:3]
        item = slice(start, stop, 1 if step is None else step)
    index: list[Any] = [slice(None)] * ndim
    index[dim] = item
    root = src
    if (src.op == "call_function" and src.target is operator.getitem and len(src.users) == 1
            and isinstance(src.args[1], tuple)):
        prev = list(src.args[1])
        kept = [i for i, it in enumerate(prev) if not isinstance(it, int)]  # output dim -> entry
        if len(kept) == ndim and _full(prev[kept[dim]]):
            prev[kept[dim]] = item
            index, root = prev, src.args[0]
    if all(_full(it) for it in index):
        n.replace_all_uses_with(root)
        g.erase_node(n)
    else:
        with g.inserting_before(n):
            new = g.call_function(operator.getitem, (root, tuple(index)))
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
    if root is not src and not src.users:
        g.erase_node(src)
