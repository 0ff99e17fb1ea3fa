"""Trace a PyTorch model into an OpGraph: torch.fx or torch.export for the graph, ShapeProp on
fake tensors for shapes (no weight is allocated), torch.utils.flop_counter for FLOPs.

Two front ends capture the model (``capture``): ``"fx"``, torch.fx symbolic tracing (module
calls stay whole: ``nn.Linear`` is one node); ``"export"``, torch.export non-strict
(``soapsearch/_export.py``: aten ops of the training IR, for models fx cannot trace, such as HF
transformers' mask building); ``"auto"`` (the default) tries fx and, when it fails, export.
Both map onto the same op kinds, attrs and weights (the fx adapters in ``soapsearch/_fx/*.py``,
the aten adapters in ``soapsearch/_fx/aten*.py``), so a model both capture gives the same ops.

The batch (sample) dim of every op is found by propagating twice, at the example batch and at
twice it: the dim whose size doubles is the sample dim (an exported graph has a dynamic batch,
so it propagates at both).
"""

from __future__ import annotations

import contextlib
import io
import operator
import os
import traceback
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import soapsearch._fx  # noqa: F401  (registers every adapter)
from soapsearch._fx.base import ALIAS, MULTI, FxOp, adapter_for
from soapsearch._fx.mha import Inliner
from soapsearch._fx.opaque import opaque_op
from soapsearch._export import export_module, export_reason, writes_input
from strategies.graph import Dim, OpGraph, OpNode, TensorSpec, Weight
from strategies.rules import OPAQUE, get_rule
from strategies.rules.base import spec_of

__all__ = ["trace", "trace_with_module", "TraceError", "check_scalar_loss", "CAPTURES"]

CAPTURES = ("fx", "export", "auto")
"""The front ends ``trace`` may capture a model with (``capture=``; the CLI's ``--capture``)."""

_TORCH_DIR = os.path.dirname(torch.__file__)


class TraceError(ValueError):
    """A model that cannot be turned into an OpGraph, with the source line to blame."""


def check_scalar_loss(graph: OpGraph, error: type[Exception] = TraceError) -> None:
    """Raise ``error`` unless ``graph`` outputs exactly one scalar (shape ``()``): training
    back-propagates from the loss, so a model returning logits cannot be trained or planned for
    training. The executor refuses a plan with the same words (``ExecutorError``)."""
    if len(graph.outputs) != 1 or graph[graph.outputs[0]].output.shape != ():
        raise error(
            f"the model must return one scalar loss; its outputs are {list(graph.outputs)} "
            f"with shapes {[list(graph[o].output.shape) for o in graph.outputs]}")


class _Tracer(fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True  # a buffer sliced by a traced size (a causal mask)
        self.attention = Inliner(self)  # nn.MultiheadAttention traced op by op

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        inline = self.attention.forward_for(m, args, kwargs)
        return inline() if inline is not None else super().call_module(m, forward, args, kwargs)

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        graph = super().trace(root, concrete_args)
        self.attention.settle(graph)
        return graph


def _symbolic_trace(model: torch.nn.Module) -> fx.GraphModule:
    try:
        graph = _Tracer().trace(model)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError... for the same cause
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__]
        where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "?"
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}\n"
            f"  at {where}\n"
            "  fx records tensor ops without running them, so Python control flow that depends "
            "on a tensor's value (if/while on a tensor, len(tensor), .item()) cannot be traced. "
            "Compute it with tensor ops instead (torch.where, masking), move it out of forward, "
            "or wrap that helper with torch.fx.wrap so it becomes one opaque op."
        ) from None
    return fx.GraphModule(model, graph, type(model).__name__)


def _sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of scaled dot-product attention: the two batched matmuls Q·Kᵀ and softmax·V,
    4·B·H·L·S·E (``sdpa_flop_count``, the formula torch counts for its flash, efficient and
    cuDNN kernels and, on the meta device, for the two ``bmm`` of the math decomposition)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flop}
"""Formulas torch.utils.flop_counter lacks: on fake CPU tensors SDPA dispatches to the CPU
flash kernel, which it does not count, so attention's FLOPs would depend on where the weights
live."""


class _Propagate(ShapeProp):
    """ShapeProp that also keeps each node's (fake) value and forward FLOPs."""

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode, count_flops: bool):
        super().__init__(gm, fake_mode)
        self.count_flops = count_flops
        self.values: dict[str, Any] = {}

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # BatchNorm(momentum=None) divides by float(num_batches_tracked), which a fake tensor
        # has no value for; any momentum gives the same shapes and FLOPs
        mod = self.fetch_attr(target)
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and mod.momentum is None:
            mod.momentum = 0.0
            try:
                return super().call_module(target, args, kwargs)
            finally:
                mod.momentum = None
        return super().call_module(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        counter = (FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS) if self.count_flops
                   else contextlib.nullcontext())
        with counter:
            result = super().run_node(n)
        self.values[n.name] = result
        if self.count_flops:
            n.meta["val"] = result
            n.meta["flops"] = counter.get_total_flops()
        return result


def _propagate(gm: fx.GraphModule, args: Sequence[Any], count_flops: bool) -> dict[str, Any]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():  # ShapeProp deep-copies an exported module's pytree specs,
        warnings.filterwarnings("ignore", "`isinstance.treespec, LeafSpec.", FutureWarning)
        prop = _Propagate(gm, mode, count_flops)  # which torch's own pytree warns of
    with contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints a traceback first
        try:
            prop.propagate(*args)
        except RuntimeError as e:
            cause = e.__cause__ or e
            raise TraceError(f"shape propagation failed: {e}\n  cause: {cause}") from None
    return prop.values


def _doubled(args: Sequence[Any]) -> list[Any]:
    return [torch.empty((2 * a.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
            if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in args]


def _sample_dim(shape1: Sequence[int], shape2: Sequence[int] | None) -> int | None:
    if shape2 is None or len(shape1) != len(shape2):
        return None
    for i, (a, b) in enumerate(zip(shape1, shape2)):
        if b == 2 * a and a > 0:
            return i
    return None


def _first(v: Any) -> Any:
    """An op's output: a module returning a tuple (an LSTM) outputs its first element."""
    while isinstance(v, (tuple, list)) and v:
        v = v[0]
    return v


def _shape(v: Any) -> tuple[int, ...] | None:
    v = _first(v)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _source(n: fx.Node) -> str:
    lines = [l.strip() for l in (n.stack_trace or "").strip().splitlines() if l.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and _TORCH_DIR not in lines[i]:
            where = lines[i][5:].replace('"', "").replace(", line ", ":").split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{where}: {code}"
    return ""


def trace(model: torch.nn.Module, example_inputs: Sequence[Any] | Any, *,
          name: str | None = None, capture: str = "auto") -> OpGraph:
    """``model`` (an nn.Module or an fx GraphModule) as an OpGraph for ``example_inputs``
    (a tuple of positional arguments whose dim 0 is the batch), captured by ``capture``
    (``CAPTURES``: fx, export, or auto: fx, then export when fx fails); ``graph.capture`` says
    which front end did."""
    return trace_with_module(model, example_inputs, name=name, capture=capture)[0]


def trace_with_module(model: torch.nn.Module, example_inputs: Sequence[Any] | Any, *,
                      name: str | None = None, capture: str = "auto"
                      ) -> tuple[OpGraph, fx.GraphModule]:
    """``trace``, with the captured GraphModule: every weight an op names (``Weight.name``) is
    an attribute of it (``get_submodule``/``getattr`` by the qualified name), including the
    tensors an exported model builds in forward (``lifted_tensor_*``)."""
    if capture not in CAPTURES:
        raise ValueError(f"capture {capture!r} is not one of {', '.join(CAPTURES)}")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    name = name or type(model).__name__.lower()
    on_meta = any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())
    args = [a.to("meta") if on_meta and isinstance(a, torch.Tensor) else a for a in example_inputs]
    fx_error: TraceError | None = None
    if capture in ("fx", "auto") or isinstance(model, fx.GraphModule):
        try:  # capture and propagation may fall back to export; building the ops does not
            gm = model if isinstance(model, fx.GraphModule) else _symbolic_trace(model)
            values = _propagate_twice(gm, args)
        except TraceError as e:
            if capture == "fx" or isinstance(model, fx.GraphModule):
                raise
            fx_error = e
        else:
            return _build(gm, *values, name, model, "fx"), gm
    try:
        gm = export_module(model, args)
    except Exception as e:  # noqa: BLE001  (export raises many types for one cause)
        raise TraceError(_export_failed(model, e, fx_error)) from None
    return _build(gm, *_propagate_twice(gm, args), name, gm, "export"), gm


def _export_failed(model: torch.nn.Module, e: BaseException, fx_error: TraceError | None) -> str:
    """The message of a model no front end asked for could capture: each one's first failure
    (fx: its error and source line; export: its reason) and what to try."""
    what = type(model).__name__
    export_line = f"torch.export: {export_reason(e)}"
    if fx_error is None:
        return (f"torch.export cannot capture {what}: {export_reason(e)}\n"
                "  run torch.export.export(model, args, strict=False) for its full message and "
                "suggested fixes (torch.export.draft_export lists every failure), or try "
                "--capture fx")
    fx_lines = str(fx_error).splitlines()
    fx_line = fx_lines[0].removeprefix(f"torch.fx cannot trace {what}: ")
    at = next((l.strip() for l in fx_lines[1:] if l.strip().startswith("at ")), "at ?")
    return (f"neither torch.fx nor torch.export can capture {what}:\n"
            f"  torch.fx: {fx_line}\n    {at}\n"
            f"  {export_line}\n"
            "  fx fails on Python control flow over tensor values (use torch.where or masking, "
            "or torch.fx.wrap the helper); export fails where a value, not a shape, decides "
            "(run torch.export.export(model, args, strict=False) for its suggested fixes, "
            "torch.export.draft_export for every failure)")


def _propagate_twice(gm: fx.GraphModule, args: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every node's value at the example batch (with FLOPs) and at twice it."""
    first = _propagate(gm, args, count_flops=True)
    try:
        second = _propagate(gm, _doubled(args), count_flops=False)
    except TraceError:
        second = {}  # a model with a hard-coded batch size: no op gets a sample dim
    return first, second


def _build(gm: fx.GraphModule, first: dict[str, Any], second: dict[str, Any], name: str,
           root: torch.nn.Module | None = None, capture: str = "fx") -> OpGraph:
    """The ops of ``gm``'s nodes in order. In an exported graph every parameter is a
    ``get_attr`` node, most of them read as an op's weight (a linear's): a ``get_attr`` becomes
    a leaf op only when an op reads it as an input, placed just before the first such op (where
    fx records it)."""
    tied = _first_names(root if root is not None else gm)
    lazy = capture == "export"
    nodes: list[OpNode] = []
    op_of: dict[str, str] = {}  # fx node name -> op name (aliases resolve to their input's op)
    specs: dict[str, TensorSpec] = {}
    outputs: list[str] = []

    def emit(n: fx.Node, fxop: FxOp) -> None:
        """Add ``n`` as the op ``fxop`` says."""
        v = first.get(n.name)
        inputs = [op_of[i.name] for i in fxop.inputs]
        like = fxop.dims_like or n
        dim_sizes = _shape(first.get(like.name))
        out = spec_of(_first(v))
        weights = tuple(
            Weight(role, tied.get(id(t), qual), spec_of(t), trainable=isinstance(t, torch.nn.Parameter) and t.requires_grad)
            for role, qual in fxop.weights
            for t in [_tensor_at(gm, qual)]
        )
        in_specs = tuple(specs[i] for i in inputs)
        flops = int(n.meta.get("flops", 0))
        rd = sum(s.nbytes for s in in_specs) + sum(w.spec.nbytes for w in weights)
        provisional = OpNode(n.name, fxop.kind, tuple(inputs), out,
                             tuple(Dim(f"d{i}", s, "attribute") for i, s in enumerate(dim_sizes)),
                             weights, fxop.attrs, in_specs)
        sample = _sample_dim(dim_sizes, _shape(second.get(like.name)))
        dims = get_rule(fxop.kind).dims(provisional, sample)
        node = OpNode(n.name, fxop.kind, tuple(inputs), out, dims, weights, fxop.attrs, in_specs,
                      flops=flops, bytes_read=rd, bytes_written=out.nbytes, source=_source(n))
        nodes.append(node)
        op_of[n.name] = node.name
        specs[node.name] = out

    pending: dict[str, fx.Node] = {}  # an alias of a get_attr no op has read yet -> that get_attr

    def leaf(i: fx.Node) -> fx.Node | None:
        """The get_attr node ``i`` stands for when no op has read it yet (export graphs)."""
        if i.name in pending:
            return pending[i.name]
        return i if lazy and i.op == "get_attr" and i.name not in op_of else None

    for n in gm.graph.nodes:
        v = first.get(n.name)
        if n.op == "output":
            outs: list[fx.Node] = []
            fx.node.map_arg(n.args[0], outs.append)
            outputs = [op_of[a.name] for a in outs if a.name in op_of]
            continue
        if lazy and n.op == "get_attr":
            continue  # a leaf op only where an op reads it (below)
        fxop = _adapt(n, gm, v)
        if fxop is None:
            continue  # a node with no tensor value (x.size(0), getattr): not an op
        if fxop.kind == MULTI:
            continue  # split/chunk/unbind: each item read is a slice op (its getitem)
        if lazy:
            if fxop.kind == ALIAS and leaf(fxop.inputs[0]) is not None:
                pending[n.name] = leaf(fxop.inputs[0])  # a copy of a constant: still unread
                continue
            for i in fxop.inputs:
                src = leaf(i)
                if src is not None:
                    if src.name not in op_of:
                        emit(src, _adapt(src, gm, first.get(src.name)))
                    op_of[i.name] = op_of[src.name]
        if fxop.kind == ALIAS:
            op_of[n.name] = op_of[fxop.inputs[0].name]
            continue
        emit(n, fxop)
    return OpGraph(nodes, outputs, name=name, capture=capture)


def _first_names(model: torch.nn.Module) -> dict[int, str]:
    """id of each parameter and buffer -> its first name in ``named_parameters()`` /
    ``named_buffers()``: a tensor tied under several names (GPT-2's ``lm_head.weight is
    wte.weight``) is one weight, named as ``state_dict`` and the optimizer meet it first."""
    out: dict[int, str] = {}
    for qual, t in [*model.named_parameters(), *model.named_buffers()]:
        out.setdefault(id(t), qual)
    return out


def _tensor_at(gm: fx.GraphModule, qual: str) -> torch.Tensor:
    mod_path, _, attr = qual.rpartition(".")
    return getattr(gm.get_submodule(mod_path) if mod_path else gm, attr)


def _adapt(n: fx.Node, gm: fx.GraphModule, v: Any) -> FxOp | None:
    if n.op == "placeholder":
        return FxOp("input", [], {"index": len([p for p in gm.graph.nodes if p.op == "placeholder" and p < n])}) \
            if isinstance(v, torch.Tensor) else None
    if n.op == "get_attr":
        if not isinstance(v, torch.Tensor):
            return None
        kind = "parameter" if isinstance(_tensor_at(gm, n.target), torch.nn.Parameter) else "constant"
        return FxOp(kind, [], {"target": n.target}, weights=[("value", n.target)])
    if not n.users:
        if writes_input(n) and not _unread_state(n):
            raise TraceError(
                f"op {n.name!r} ({_describe(n)}) at {_source(n) or '?'} writes into a tensor in "
                "place and nothing reads its result, so the graph would compute without the "
                "write: write it out of place (x = x + y, not x.add_(y); x = torch.slice_scatter"
                "(x, v, dim, start, end), not x[...] = v) or capture with torch.export "
                "(capture=\"export\"), which makes in-place writes out of place")
        return None  # dead code: nothing reads it (the ``_`` of ``out, _ = self.gru(x)``)
    thunk = adapter_for(n, gm)
    fxop = thunk() if thunk else None
    if fxop is not None:
        return fxop
    tuple_args = [_tuple_root(a).name for a in n.all_input_nodes
                  if isinstance(a.meta.get("val"), (tuple, list))]
    if isinstance(v, torch.Tensor) and tuple_args:
        raise TraceError(
            f"op {n.name!r} ({_describe(n)}) reads an item other than the first of "
            f"{tuple_args[0]!r}'s tuple output; an op's output is the first item only.\n"
            f"  at {_source(n) or '?'}"
        )
    if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
        if any(not (u.target is operator.getitem and u.args[1] == 0) for u in n.users if u.users):
            raise TraceError(
                f"op {n.name!r} ({_describe(n)}) returns several tensors that are used and has "
                f"no rule; an opaque op outputs only its first tensor.\n  at {_source(n) or '?'}"
            )
    elif not isinstance(v, torch.Tensor):
        return None
    return opaque_op(n, gm, _describe(n))


def _unread_state(n: fx.Node) -> bool:
    """Whether the in-place write ``n`` lands in a buffer or a model input (through getitems)
    that no later node reads: state the OpGraph does not model (BatchNorm's running statistics,
    which an exported module writes back with ``copy_``)."""
    x = n.args[0] if n.args else None
    while isinstance(x, fx.Node) and x.target is operator.getitem:
        x = x.args[0]
    return (isinstance(x, fx.Node) and x.op in ("get_attr", "placeholder")
            and all(u is n or u < n for u in x.users))


def _tuple_root(n: fx.Node) -> fx.Node:
    """The call whose tuple output ``n`` is (an item of)."""
    while n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _describe(n: fx.Node) -> str:
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    if n.op == "call_module":
        return n.target
    return f".{n.target}()"
