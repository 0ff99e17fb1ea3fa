"""Mixed precision as the lowering sees it (docs/design.md, "Mixed precision"): the graph a
``bf16``/``fp16`` plan runs, every float32 tensor (activations, the inputs ops read, the weights'
working copies) in the compute dtype, a loss's value left in float32 (torch.autocast's op lists
run losses in float32). Transfers, kept activations, weight reads, gradient buckets and each op's peak
FLOP/s then follow from the dtypes as in any plan; gradients are summed in ``reduce_dtype``
(the plan's ``Strategy.reduce_dtype``: the compute dtype, or float32); ``simulator.memory``
adds the float32 master weights."""

from __future__ import annotations

from dataclasses import replace

from strategies.errors import PlanError
from strategies.graph import DTYPE_BYTES, OpGraph, OpNode, TensorSpec, Weight
from strategies.strategy import COMPUTE_DTYPES, Strategy

__all__ = ["compute_graph", "MASTER_DTYPE", "reduce_dtype", "reduce_scale"]

MASTER_DTYPE = "float32"
"""The dtype of master weights and optimizer state in mixed precision (Micikevicius et al. 2018)."""


def _spec(spec: TensorSpec, dtype: str) -> TensorSpec:
    return TensorSpec(spec.shape, dtype) if spec.dtype == MASTER_DTYPE else spec


def _node(node: OpNode, dtype: str) -> OpNode:
    weights = tuple(Weight(w.role, w.name, _spec(w.spec, dtype), w.trainable) for w in node.weights)
    output = node.output if node.kind == "loss" else _spec(node.output, dtype)
    return replace(node, output=output, weights=weights,
                   input_specs=tuple(_spec(s, dtype) for s in node.input_specs))


def compute_graph(graph: OpGraph, dtype: str | None) -> OpGraph:
    """``graph`` as a plan computing in ``dtype`` runs it (``graph`` itself for None); made once
    per graph and dtype. PlanError where a trainable weight is not float32 (its master copy is
    float32: mixed precision starts from a float32 model)."""
    if dtype is None:
        return graph
    made = graph.__dict__.setdefault("_compute_graphs", {})
    if dtype not in made:
        for n in graph:
            for w in n.weights:
                if w.trainable and w.spec.dtype != MASTER_DTYPE:
                    raise PlanError(n.name, "precision", dtype,
                                    f"mixed precision keeps float32 master weights of a float32 model; "
                                    f"weight {w.name!r} is {w.spec.dtype}: use precision 'model' (--dtype fp32)")
        made[dtype] = OpGraph([_node(n, dtype) for n in graph], graph.outputs, graph.name, graph.capture)
    return made[dtype]


_HALF = frozenset(COMPUTE_DTYPES.values())


def reduce_dtype(strategy: Strategy | str, dtype: str) -> str:
    """The dtype the gradient of a weight held in ``dtype`` is summed in under ``strategy`` (a
    plan, or its ``reduce_dtype``): float32 where the plan's ``reduce_dtype`` is ``float32`` and
    ``dtype`` is a compute dtype (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=float32)``: the gradient is cast up before its all-reduce / reduce-scatter),
    else ``dtype`` itself."""
    wanted = strategy if isinstance(strategy, str) else strategy.reduce_dtype
    return MASTER_DTYPE if wanted == MASTER_DTYPE and dtype in _HALF else dtype


def reduce_scale(strategy: Strategy | str, dtype: str) -> int:
    """Bytes on the wire per byte of a ``dtype`` gradient: ``reduce_dtype``'s itemsize over
    ``dtype``'s (2 for a bf16/fp16 gradient reduced in float32, else 1)."""
    return DTYPE_BYTES[reduce_dtype(strategy, dtype)] // DTYPE_BYTES[dtype]
