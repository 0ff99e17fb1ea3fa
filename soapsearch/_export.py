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
* **Functionalization**: the training IR keeps in-place ops. A write into a tensor the model
  reads later (HF's ``shift_tokens_right``: ``shifted[:, 1:] = ids[:, :-1]``, a ``copy_`` into
  a slice view with no users) would vanish with the dead code, so such a graph is
  functionalized (``writes_to_functionalize``, ``ExportedProgram.run_decompositions({})``):
  writes become ``aten.copy``, ``aten.slice_scatter``/``select_scatter``, ``aten.fill``,
  ``aten.masked_fill``. Only such a graph: functionalization also rewrites ops that need no
  rewrite into forms the adapters do not map (``batch_norm`` becomes the three outputs of
  ``_native_batch_norm_legit_functional``, ``dropout`` ``native_dropout``, ``flatten`` a
  ``view``: resnet101, alexnet and gpt of the zoo would no longer give fx's OpGraph), and a
  buffer update nothing reads (BatchNorm's running statistics) does not change the loss. A
  functionalized ``module()`` writes mutated buffers back with ``copy_`` (kept, unread).
* **Canonical form**: the guard checks export inserts are dropped; a constant ``pad`` becomes
  a concat with ``full`` blocks (HF's causal-LM loss pads the labels with ``ignore_index``);
  chains of ``aten.slice`` / ``aten.select`` become one ``operator.getitem`` (the node fx
  records for ``x[:, -1]``), whole slices vanish; ``aten.view`` becomes ``aten.reshape`` (a
  retrace may drop a ``contiguous`` its fake strides call a no-op, leaving a view of a
  transposed tensor); ``aten.addmm(b, x, w)`` becomes ``x @ w + b`` (GPT-2's Conv1D keeps its
  weight as [in, out], which a linear's [out, in] rule cannot name); functionalization's
  ``copy`` and ``fill`` of a view become the source broadcast (``expand``, after a cast when
  the dtypes differ) or a ``full``, so the overwritten view is dead, and a ``slice_scatter``
  of a whole dim is its source.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx

__all__ = ["export_module", "canonicalize", "export_reason", "writes_input",
           "writes_to_functionalize"]

aten = torch.ops.aten

_INT_MAX = 2**63 - 1

def _export_fn():
    """``torch.export.export_for_training`` where this torch has it (it is ``export``'s training
    IR on the releases whose ``export`` decomposes further), else ``torch.export.export``."""
    return getattr(torch.export, "export_for_training", None) or torch.export.export


def export_module(model: torch.nn.Module, args: Sequence[Any]) -> fx.GraphModule:
    """``model`` captured by torch.export (non-strict) with dim 0 of every batched tensor input
    dynamic, functionalized when it writes in place into a tensor read later or not a buffer
    (``writes_to_functionalize``), in canonical form (``canonicalize``). Raises what
    torch.export raises."""
    batched = [isinstance(a, torch.Tensor) and a.dim() > 0 for a in args]
    if any(b and a.shape[0] == 1 for a, b in zip(args, batched)):  # export specializes a 1
        args = [torch.empty((2, *a.shape[1:]), dtype=a.dtype, device=a.device) if b else a
                for a, b in zip(args, batched)]
    dims = tuple({0: torch.export.Dim.AUTO} if b else None for b in batched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations, attributes assigned during export
        ep = _export_fn()(model, tuple(args), dynamic_shapes=dims, strict=False)
        if writes_to_functionalize(ep):
            ep = ep.run_decompositions({})  # an empty table: functionalization only
        gm = ep.module()
    canonicalize(gm)
    return gm


def export_reason(e: BaseException) -> str:
    """One line saying why torch.export failed: the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def writes_input(n: fx.Node) -> bool:
    """Whether ``n`` writes into a tensor it reads: an aten op with a mutable schema
    (``aten.copy_``, ``aten.add_``), a tensor method or function named with a trailing ``_``
    (``x.add_(y)``, ``torch.relu_``), or ``operator.setitem`` (``x[:, 0] = 1``)."""
    if n.op == "call_method":
        return isinstance(n.target, str) and n.target.endswith("_") and not n.target.endswith("__")
    if n.op != "call_function":
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(n.target, "__name__", "")
    return n.target is operator.setitem or (name.endswith("_") and not name.endswith("__"))


def _is_view(n: fx.Node) -> bool:
    """Whether ``n`` is an aten view of its first input (slice, select, view: its result aliases
    it, read-only)."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def _written_root(n: fx.Node) -> fx.Node:
    """The tensor an in-place write ``n`` lands in, through the views of it (slice, select)."""
    x = n.args[0]
    while isinstance(x, fx.Node) and _is_view(x):
        x = x.args[0]
    return x


def writes_to_functionalize(ep: torch.export.ExportedProgram) -> list[fx.Node]:
    """The in-place writes of ``ep`` the graph must make out of place: each into a tensor that
    is not one of the model's buffers, or that a later node reads. A buffer update nothing in
    the graph reads again (BatchNorm's ``num_batches_tracked.add_(1)``) is state the OpGraph
    does not model."""
    buffers = set(ep.graph_signature.inputs_to_buffers)
    order = {n: i for i, n in enumerate(ep.graph.nodes)}
    out = []
    for n in ep.graph.nodes:
        if not writes_input(n) or not isinstance(n.args[0], fx.Node):
            continue
        root = _written_root(n)
        aliases, readers = [root], []
        while aliases:  # every view of the root, and who reads one
            for u in aliases.pop().users:
                readers.append(u)
                if _is_view(u):
                    aliases.append(u)
        if root.name not in buffers or any(order[u] > order[n] for u in readers):
            out.append(n)
    return out


# --- canonical form -----------------------------------------------------------------------
def canonicalize(gm: fx.GraphModule) -> None:
    """Drop export's guard checks, turn slice/select chains into getitem, addmm into a
    matmul plus an add and functionalization's writes of a view into what they compute, in
    place."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn" or (
                n.op == "call_function" and n.target in _CHECKS) or _buffer_write_back(n):
            g.erase_node(n)
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target in (aten.slice.Tensor, aten.select.int):
            _to_getitem(g, n)
        elif n.target is aten.view.default:
            n.target = aten.reshape.default  # the same values, whatever the input's strides
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
        elif n.target in (aten.copy.default, aten.fill.Tensor, aten.fill.Scalar):
            _write_as_value(g, n)
        elif n.target is aten.slice_scatter.default and _whole_dim_scatter(n):
            n.replace_all_uses_with(n.args[1])
            g.erase_node(n)
    for n in reversed(list(g.nodes)):  # dead code the rewrites left
        if n.op == "call_function" and not n.users and not _impure(n):
            g.erase_node(n)
    gm.recompile()


_CHECKS = (aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
           aten._assert_tensor_metadata.default)
"""Export's checks of sizes and dtypes: no value, dropped."""


def _buffer_write_back(n: fx.Node) -> bool:
    """A functionalized module's ``copy_`` of a buffer's new value (BatchNorm's running
    statistics) into the buffer, which nothing reads after: state the OpGraph does not model.
    Dropping it leaves the new value and the extra outputs of the op that computed it dead."""
    dst = n.args[0] if n.op == "call_function" and n.target is aten.copy_.default else None
    return (isinstance(dst, fx.Node) and dst.op == "get_attr" and not n.users
            and all(u is n or u < n for u in dst.users))


def _whole_dim_scatter(n: fx.Node) -> bool:
    """``slice_scatter(x, src, dim, 0, end)`` over the whole dim: ``src`` (the same shape)."""
    dim, start, end, step = (list(n.args) + [0, None, None, 1][len(n.args) - 2:])[2:6]
    return start in (None, 0) and end in (None, _INT_MAX) and step == 1 and not n.kwargs


def _write_as_value(g: fx.Graph, n: fx.Node) -> None:
    """``copy(x, src)`` / ``fill(x, value)`` (what ``x.copy_(src)``, ``x[:, 0] = v`` become)
    compute a tensor of x's shape and dtype that reads none of x's values: ``src`` cast to x's
    dtype and expanded to its shape, or ``full(shape, value)``. Sizes come from x's own input
    where x keeps that dim whole, so a view x read only for its shape becomes dead."""
    x, src = n.args[0], n.args[1]
    out = n.meta["val"]
    shape = [_size(g, n, x, d) for d in range(out.dim())]
    with g.inserting_before(n):
        if n.target is aten.fill.Scalar:
            new = g.call_function(aten.full.default, (shape, src),
                                  {"dtype": out.dtype, "device": out.device})
        else:
            if src.meta["val"].dtype != out.dtype:
                src = g.call_function(aten._to_copy.default, (src,), {"dtype": out.dtype})
                src.meta.update(stack_trace=n.meta.get("stack_trace"))
            new = g.call_function(aten.expand.default, (src, shape))
    new.meta.update(stack_trace=n.meta.get("stack_trace"))
    n.replace_all_uses_with(new)
    g.erase_node(n)


def _size(g: fx.Graph, n: fx.Node, x: fx.Node, d: int) -> Any:
    """Size ``d`` of ``x``: an int when static, else ``sym_size`` (inserted before ``n``) of the
    tensor x is a slice of, through getitems that keep that dim whole."""
    s = x.meta["val"].shape[d]
    if isinstance(s, int):
        return s
    while x.op == "call_function" and x.target is operator.getitem and isinstance(x.args[1], tuple):
        kept = [i for i, it in enumerate(x.args[1]) if not isinstance(it, int)]
        if not _full(x.args[1][kept[d]]):
            break
        x, d = x.args[0], kept[d]
    with g.inserting_before(n):
        return g.call_function(aten.sym_size.int, (x, d))


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
