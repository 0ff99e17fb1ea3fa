"""aten adapters of the ops that move data without computing (view/reshape, permute, concat,
expand, split, index, repeat_interleave, triu/tril), the identity-like ops (ALIAS) and the tensor
factories; each gives the op the fx adapter of the same torch call gives (``shape.py``,
``gather.py``, ``mask.py``, ``multi.py``). Slices and selects arrive as ``operator.getitem``
(``soapsearch._export.canonicalize``) and take the fx getitem adapter; a write into a slice,
made out of place by functionalization, is a ``slice_scatter``."""

from __future__ import annotations

import torch
import torch.fx as fx

from soapsearch._fx import aten_dense, gather, shape
from soapsearch._fx.aten import args_of, aten
from soapsearch._fx.base import ALIAS, FxOp, for_functions, val
from soapsearch._fx.mask import _factory
from soapsearch._fx.multi import multi_output, bounds_of


@for_functions(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
               aten.unflatten.int)
def _view(node: fx.Node) -> FxOp | None:
    return shape._reshape(node, "reshape")


@for_functions(aten.flatten.using_ints)
def _flatten(node: fx.Node) -> FxOp | None:
    return shape._reshape(node, "flatten")


@for_functions(aten.permute.default, aten.transpose.int, aten.t.default, aten.swapaxes.default,
               aten.swapdims.default, aten.movedim.int)
def _permute(node: fx.Node) -> FxOp | None:
    """Any dim permutation, found as the fx adapter finds it (the call on a probe)."""
    return shape._permute(node)


@for_functions(aten.contiguous.default, aten.clone.default, aten.alias.default,
               aten.detach.default, aten.detach_.default, aten.lift_fresh_copy.default)
def _alias(node: fx.Node) -> FxOp | None:
    """The same values as the input (a copy, or the same storage)."""
    x, out = val(node.args[0]), val(node)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.shape != out.shape:
        return None
    return FxOp(ALIAS, [node.args[0]])


@for_functions(aten.cat.default)
def _concat(node: fx.Node) -> FxOp | None:
    """torch.cat; a 1-D empty input (``torch.cat`` skips it: an empty key cache) is left out."""
    a = args_of(node)
    out = val(node)
    tensors = [t for t in a["tensors"] if not (isinstance(t, fx.Node) and isinstance(val(t), torch.Tensor)
                                               and tuple(val(t).shape) == (0,))]
    dim = val(a["dim"])
    if (not isinstance(out, torch.Tensor) or not tensors or not isinstance(dim, int)
            or not all(isinstance(t, fx.Node) and isinstance(val(t), torch.Tensor)
                       and val(t).dim() == out.dim() for t in tensors)):
        return None
    if len(tensors) == 1:
        return FxOp(ALIAS, [tensors[0]])
    return FxOp("concat", tensors, {"dim": dim % out.dim()})


@for_functions(aten.expand.default)
def _expand(node: fx.Node) -> FxOp | None:
    return gather._expand(node)


@for_functions(aten.repeat_interleave.self_int)
def _repeat_interleave(node: fx.Node) -> FxOp | None:
    return gather._repeat_interleave(node)


@for_functions(aten.triu.default, aten.tril.default)
def _triangle(node: fx.Node) -> FxOp | None:
    x, diagonal = val(node.args[0]), val(args_of(node)["diagonal"])
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(diagonal, int):
        return None
    return FxOp("triangle", [node.args[0]], {"upper": node.target is aten.triu.default,
                                              "diagonal": diagonal})


@for_functions(aten.index.Tensor)
def _index(node: fx.Node) -> FxOp | None:
    """``table[ids]``: one integer tensor indexing dim 0."""
    indices = node.args[1]
    if len(indices) != 1 or indices[0] is None:
        return None
    return gather.index_op(node, node.args[0], indices[0])


@for_functions(aten.index_select.default)
def _index_select(node: fx.Node) -> FxOp | None:
    return gather.index_op(node, node.args[0], node.args[2]) if val(node.args[1]) == 0 else None


# --- several outputs ----------------------------------------------------------------------
@for_functions(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def _split(node: fx.Node) -> FxOp | None:
    x, dim = val(node.args[0]), val(args_of(node)["dim"])
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int):
        return None
    bounds = bounds_of(node, dim % x.dim())
    return None if bounds is None else multi_output(node.args[0], dim, bounds, False)


@for_functions(aten.unbind.int)
def _unbind(node: fx.Node) -> FxOp | None:
    x, dim = val(node.args[0]), val(args_of(node)["dim"])
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int):
        return None
    return multi_output(node.args[0], dim, list(range(x.shape[dim] + 1)), True)


# --- factories ----------------------------------------------------------------------------
_NAMED = {aten.arange.default: "torch.arange", aten.arange.start: "torch.arange",
          aten.arange.start_step: "torch.arange", aten.full.default: "torch.full",
          aten.ones.default: "torch.ones", aten.zeros.default: "torch.zeros"}


@for_functions(*_NAMED)
def _factory_function(node: fx.Node) -> FxOp | None:
    return _factory(node, _NAMED[node.target], node.args, dict(node.kwargs))


@for_functions(aten.full_like.default, aten.ones_like.default, aten.zeros_like.default,
               aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
               aten.scalar_tensor.default)
def _factory_like(node: fx.Node) -> FxOp | None:
    """A tensor that reads only its input's shape, dtype and device: ``full(shape, value)``."""
    out, a = val(node), args_of(node)
    if not isinstance(out, torch.Tensor):
        return None
    fill = {aten.ones_like.default: 1, aten.zeros_like.default: 0, aten.new_ones.default: 1,
            aten.new_zeros.default: 0}.get(node.target)
    if fill is None:
        fill = val(a.get("fill_value", a.get("s")))
    rest = {k: v for k, v in node.kwargs.items() if k in ("requires_grad",)}
    return _factory(node, "torch.full", [list(out.shape), fill], rest)


# --- writes into a slice, out of place ------------------------------------------------------
@for_functions(aten.slice_scatter.default, aten.select_scatter.default, torch.slice_scatter,
               torch.select_scatter)
def _scatter(node: fx.Node) -> FxOp | None:
    """``slice_scatter(x, src, dim, start, end)`` (step 1) or ``select_scatter(x, src, dim,
    index)``: x with that slab replaced by src (the torch functions take the aten arguments).
    A slab that is all of x is src; a step other than 1 is left to the opaque op."""
    select = node.target in (aten.select_scatter.default, torch.select_scatter)
    names = ("input", "src", "dim") + (("index",) if select else ("start", "end", "step"))
    defaults = {"dim": 0, "start": None, "end": None, "step": 1}
    a = {k: val(node.args[i] if i < len(node.args) else node.kwargs.get(k, defaults.get(k)))
         for i, k in enumerate(names)}
    x, src, out = a["input"], a["src"], val(node)
    if (not all(isinstance(t, torch.Tensor) for t in (x, src, out)) or not isinstance(a["dim"], int)
            or x.dim() == 0 or src.dtype != x.dtype):
        return None
    dim = a["dim"] % x.dim()
    size = x.shape[dim]
    if select:
        if not isinstance(a["index"], int):
            return None
        start = a["index"] % size
        stop = start + 1
    else:
        if a["step"] != 1 or not all(isinstance(v, (int, type(None)))
                                     for v in (a["start"], a["end"])):
            return None
        start, stop, _ = slice(a["start"], a["end"]).indices(size)
        stop = max(start, stop)
        if (start, stop) == (0, size):
            return FxOp(ALIAS, [node.args[1]])
    slab = () if select else (stop - start,)
    if tuple(src.shape) != tuple(x.shape[:dim]) + slab + tuple(x.shape[dim + 1:]):
        return None
    return FxOp("slice_scatter", [node.args[0], node.args[1]],
                {"dim": dim, "start": start, "stop": stop, "select": select})


# A functionalized graph's batch norm (``soapsearch._export``): the outputs after the first are
# the running statistics written back into the buffers, which canonical form leaves unread.
for_functions(aten._native_batch_norm_legit_functional.default)(aten_dense._batch_norm)
