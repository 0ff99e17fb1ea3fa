"""Transformer layers as Megatron-LM checkpoints them: full recompute of every layer
(``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``) keeps
each layer's input and recomputes the rest in the backward, 2sbh bytes a layer at 16 bits
(Korthikanti et al. 2022 §4.3; /t with sequence parallelism).

A layer is an attention block followed by an MLP block (``megatron.megatron_blocks``); its ops
are those after its input (the residual stream the attention block's closing add reads) up to,
not including, the residual add after its MLP block, whose output is the next layer's input.
"""

from __future__ import annotations

from strategies.errors import PlanError
from strategies.graph import OpGraph
from strategies.megatron import megatron_blocks
from strategies.drops import recomputable
from strategies.strategy import Strategy

__all__ = ["layer_ops", "layer_recomputed"]


def _closing_add(graph: OpGraph, row: str) -> str:
    """The residual add a block's output (``row``) reaches through single-reader ops (a dropout)."""
    name = row
    while graph[name].kind != "add":
        users = graph.users(name)
        if len(users) != 1:
            raise PlanError(row, "recompute", "layer", "the block's output reaches no residual add "
                            f"(op {name!r} has {len(users)} readers)")
        name = users[0]
    return name


def layer_ops(graph: OpGraph) -> list[set[str]]:
    """Per transformer layer, its recomputable ops (``drops.recomputable``) but its closing
    residual add, in graph order (module docstring). A PlanError where the blocks do not pair
    into layers (an odd count, or a block's output reaching no residual add)."""
    blocks = megatron_blocks(graph)
    if not blocks or len(blocks) % 2:
        raise PlanError(None, "recompute", "layer", f"model {graph.name!r} has {len(blocks)} blocks: "
                        "layers need an attention block and an MLP block each")
    position = {node.name: i for i, node in enumerate(graph)}
    out = []
    for (_, _, attention_row), (_, _, mlp_row) in zip(blocks[0::2], blocks[1::2]):
        middle, last = graph[_closing_add(graph, attention_row)], _closing_add(graph, mlp_row)
        start = min(position[x] for x in middle.inputs)  # the layer's input: the residual stream
        out.append({node.name for node in graph.nodes[start + 1:position[last]] if recomputable(graph, node)})
    return out


def layer_recomputed(plan: Strategy, graph: OpGraph, layers: list[set[str]] | None = None) -> Strategy:
    """``plan`` with every op of ``layers`` (default: every layer's, ``layer_ops``) recomputed
    in the backward: Megatron-LM's full recompute, each layer keeping its input only."""
    return plan.with_recompute(set().union(*(layer_ops(graph) if layers is None else layers)))
