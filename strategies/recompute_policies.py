"""Recompute policies of the frameworks, as per-op recompute flags (``ParallelConfig.recompute``: the
op drops its output after its forward and runs it again before its backward).

- ``attention_recomputed``: each attention core, Korthikanti et al. 2022 §5's selective
  recompute (Megatron-LM's ``--recompute-granularity selective``).
- ``op_recomputed``: torchtitan's selective op checkpointing (``activation_checkpoint.mode =
  "selective"``, ``selective_ac_option = "op"``). Each transformer block runs under one
  ``torch.utils.checkpoint`` with a selective-checkpoint policy (``create_selective_checkpoint_
  contexts``) that saves the outputs of the ops on its save list and recomputes every other op:
  the list holds ``aten.mm`` and the flash and memory-efficient attention kernels, and the
  policy counts the block's ``aten.mm`` calls and recomputes every second one (the 2nd, 4th,
  ...). A LLaMA layer so keeps its q and v projections, its attention core, and its MLP's w1
  and w2 products, and recomputes its k and output projections, its w3, its norms, rotary
  embedding, SiLU and products. An op runs as ``aten.mm`` where it is a linear with no bias
  (torch's ``linear`` folds the leading dims into one product; with a bias it runs as
  ``aten.addmm``, not on the list) or a matmul whose second operand is 2-D. The list also holds
  the functional reduce-scatter, whose outputs (tensor parallelism's) are collectives here, not
  ops: a recomputed row-parallel linear is charged its product again.

  The same ops run twice, each once more, so the time is the policy's. What stays kept is not:
  a recompute op here drops its output only where every consumer recomputes too or reads
  nothing back (``strategies.drops.drops_output``, docs/design.md "Recompute"), so the outputs
  a saved product's or the attention's backward reads (the norms', the rotary embedding's, the
  SwiGLU product's) stay kept, where torch's selective checkpoint drops them and recomputes
  them with the block's first backward. A LLaMA-2 70B layer at 4,096 tokens in bf16 keeps 849
  MiB here against the policy's 489 (its input and the saved outputs).

Whole-layer and whole-block recompute are ``strategies.megatron_layers.layer_recomputed`` and
``strategies.baselines.recomputed``; ``strategies.baselines.RECOMPUTE`` names them and
``attention_recomputed`` (``plan --recompute``).
"""

from __future__ import annotations

from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.megatron_layers import layer_ops
from strategies.strategy import Strategy

__all__ = ["attention_recomputed", "op_recomputed", "op_saved", "runs_as_mm"]


def attention_recomputed(plan: Strategy, graph: OpGraph) -> Strategy:
    """``plan`` with each attention core recomputed (Korthikanti et al. 2022 §5: the scores,
    softmax and dropout on them, whose activations grow with the sequence squared); a
    PlanError where the graph has none."""
    if not any(node.kind == "attention" for node in graph):
        raise PlanError(None, "recompute", "selective", f"model {graph.name!r} has no attention op to recompute")
    return plan.with_recompute({node.name for node in graph if node.kind == "attention"})


def runs_as_mm(node: OpNode) -> bool:
    """Whether ``node`` runs as one ``aten.mm``: a linear with no bias, or a matmul whose second
    operand is 2-D (module docstring)."""
    if node.kind == "linear":
        return not any(w.role == "bias" for w in node.weights)
    return node.kind == "matmul" and len(node.input_specs) == 2 and len(node.input_specs[1].shape) == 2 \
        and len(node.input_specs[0].shape) >= 2


def op_saved(graph: OpGraph, layer: set[str]) -> set[str]:
    """The ops of one layer (``megatron_layers.layer_ops``) whose outputs torchtitan's selective
    op checkpointing saves: its attention cores and its 1st, 3rd, ... ``aten.mm``, counted in
    graph order (the order the block runs them)."""
    saved, mms = set(), 0
    for node in graph:
        if node.name not in layer:
            continue
        if node.kind == "attention":
            saved.add(node.name)
        elif runs_as_mm(node):
            mms += 1
            if mms % 2:
                saved.add(node.name)
    return saved


def op_recomputed(plan: Strategy, graph: OpGraph, layers: list[set[str]] | None = None) -> Strategy:
    """``plan`` under torchtitan's selective op checkpointing (module docstring): in every layer
    of ``layers`` (default: every one, ``layer_ops``; a PlanError where the graph's blocks do not
    pair into layers) every op but those ``op_saved`` keeps recomputed; each layer's closing
    residual add stays kept (the next block's checkpoint input)."""
    layers = layer_ops(graph) if layers is None else layers
    return plan.with_recompute(set().union(*(layer - op_saved(graph, layer) for layer in layers)))
