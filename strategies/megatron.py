"""The Megatron-LM plan (Shoeybi et al. 2019; Narayanan et al. 2021; sequence parallelism:
Korthikanti et al. 2022) written in SOAP configs, found by the graph's structure.

A *block* is a row-parallel linear L2 whose input, followed backwards, passes only through
*middle* ops (reshape, permute, elementwise with one activation input, dropout, attention) and
ends at column-parallel linears L1 whose every consumer is a middle op: linear → attention →
linear (q/k/v, attention by heads, output projection) and linear → activation → linear (the
MLP). With t-way tensor parallelism and d = N / t data parallelism:

- L1: sample cut d ways, out_features t ways (``ColwiseParallel``);
- a middle op: sample d ways and the one dim whose t-way cut reads only what the producers'
  partitions on its own device hold (the heads of a reshape, the permute and the attention;
  an activation's features), so no byte moves inside a block;
- L2: sample d ways, in_features t ways (``RowwiseParallel``): a Partial sum of its output;
- every other op: sample d ways and its first attribute dim that t divides (the sequence:
  Korthikanti et al.'s sequence parallelism), so L2's Partial sums are reduce-scattered into it
  and L1 all-gathers its input from it; an embedding's vocabulary rows are cut t ways instead
  (vocab-parallel). Ops that cannot be cut so run d ways on devices 0, t, 2t, ...

Partition (sample i, tensor j) runs on device i·t + j: each tensor-parallel group is t
consecutive devices (one node's NVLink domain on a GPU cluster).
"""

from __future__ import annotations

import math
from typing import Sequence

from strategies.config import ParallelConfig, check_degrees
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.region import intersect
from strategies.pieces import partition_box_mb
from strategies.rules import get_rule
from strategies.strategy import Strategy

__all__ = ["megatron", "megatron_blocks", "default_tp"]

_MIDDLE = {"reshape", "flatten", "permute", "dropout", "attention", "elementwise"}


def default_tp(graph: OpGraph, num_devices: int) -> int:
    """The largest t <= min(N, 8) dividing N and the heads of every attention op (the issue's
    default: one node's devices at most)."""
    heads = [n.shape[n.dims.index(d)] for n in graph if n.kind == "attention"
             for d in n.dims if d.name == "heads"]
    return max(t for t in range(1, min(num_devices, 8) + 1)
               if num_devices % t == 0 and all(h % t == 0 for h in heads))


def _activation_inputs(graph: OpGraph, node: OpNode) -> list[str]:
    return [s for s in node.inputs if graph[s].kind not in ("parameter", "constant")]


def megatron_blocks(graph: OpGraph) -> list[tuple[tuple[str, ...], tuple[str, ...], str]]:
    """(column linears, middle ops in graph order, row linear) of every block (module
    docstring), in graph order."""
    out = []
    for l2 in (n for n in graph if n.kind == "linear"):
        middle, columns, stack, ok = set(), set(), [l2.inputs[0]], True
        while stack and ok:
            name = stack.pop()
            node = graph[name]
            if node.kind == "linear":
                columns.add(name)
            elif node.kind in _MIDDLE and (node.kind != "elementwise" or len(_activation_inputs(graph, node)) == 1):
                if name not in middle:
                    middle.add(name)
                    stack.extend(_activation_inputs(graph, node))
            else:
                ok = False
        if not ok or not columns or not any(graph[m].kind in ("attention", "elementwise") for m in middle):
            continue
        inside = middle | {l2.name}
        if all(set(graph.users(x)) <= inside for x in middle | columns):
            order = tuple(n.name for n in graph if n.name in middle)
            out.append((tuple(n.name for n in graph if n.name in columns), order, l2.name))
    return out


def _config(node: OpNode, d: int, dim: int | None, t: int) -> ParallelConfig | None:
    """``node`` cut d ways on its sample dim and t ways on ``dim``, partition (i, j) on device
    i·t + j; None where a degree does not divide or the rule refuses."""
    s = node.sample_dim
    ok = get_rule(node.kind).splittable(node)
    degrees = [1] * len(node.dims)
    for i, k in ((s, d), (dim, t)):
        if k == 1:
            continue
        if i is None or not ok[i] or node.shape[i] % k:
            return None
        degrees[i] = k
    if check_degrees(node, degrees) is not None:
        return None
    if s is not None and dim is not None and dim < s and d > 1 and t > 1:
        return None  # the device formula below assumes the sample dim comes first
    parts = math.prod(degrees)
    if t > 1 and dim is not None:
        return ParallelConfig(tuple(degrees), tuple(range(parts)))
    return ParallelConfig(tuple(degrees), tuple(range(0, parts * t, t)))


def _reads_locally(graph: OpGraph, node: OpNode, cfg: ParallelConfig, configs: dict[str, ParallelConfig]) -> bool:
    """Every partition of ``node`` under ``cfg`` reads each activation input only from the
    producer partitions on its own device."""
    rule = get_rule(node.kind)
    for k, dev in enumerate(cfg.devices):
        box = partition_box_mb(node, cfg.degrees, k, 0, 1)
        for src, region in zip(node.inputs, rule.input_regions(node, box)):
            p = graph[src]
            if region is None or p.kind in ("parameter", "constant"):
                continue
            pc = configs[src]
            if pc is None:  # a producer of the block that cannot be cut t ways
                return False
            for q, pdev in enumerate(pc.devices):
                held = p.output_region(partition_box_mb(p, pc.degrees, q, 0, 1))
                if pdev != dev and intersect(held, region) is not None:
                    return False
    return True


def _other(node: OpNode, d: int, t: int) -> ParallelConfig:
    """An op outside the blocks: sample d ways × its first attribute dim t ways (sequence
    parallelism; an embedding's vocabulary rows), else sample d·t ways, else sample d ways on
    devices 0, t, 2t, ..., else whole on device 0."""
    dims: list[int | None] = []
    if node.kind == "embedding":
        dims += list(node.reduction_dims)
    attributes = [i for i, dim in enumerate(node.dims) if dim.role == "attribute"]
    # a [batch, seq, ...] activation: its sequence; a flat [batch·seq, classes] one: its rows
    dims += attributes + [None] if len(node.output.shape) >= 3 else [None] + attributes
    for i in dims:
        cfg = _config(node, d, i, t) if i is not None else _config(node, d * t, None, 1)
        if cfg is not None:
            return cfg
    return _config(node, d, None, t) or ParallelConfig((1,) * len(node.dims), (0,))


def megatron(graph: OpGraph, num_devices: int, tp: int | None = None) -> Strategy:
    """The Megatron-LM plan (module docstring) with ``tp``-way tensor parallelism (default
    ``default_tp``) and data parallelism over the other num_devices / tp devices."""
    t = default_tp(graph, num_devices) if tp is None else tp
    if isinstance(t, bool) or not isinstance(t, int) or t < 1 or num_devices % t:
        raise PlanError(None, "tp", t, f"tensor-parallel degree must be a whole number dividing "
                        f"num_devices ({num_devices})")
    d = num_devices // t
    batch = graph.batch_size
    if batch is None or batch % d:
        raise PlanError(None, "tp", t, f"batch {batch} is not divisible by num_devices {num_devices} / "
                        f"tp {t} = {d} data-parallel groups")
    blocks = megatron_blocks(graph)
    if t > 1 and not blocks:
        raise PlanError(None, "model", graph.name, "no linear → attention → linear or linear → activation "
                        "→ linear block to cut tensor-parallel")
    configs: dict[str, ParallelConfig] = {}
    planned: dict[str, ParallelConfig] = {}
    for columns, middle, row in blocks:
        block: dict[str, ParallelConfig] = {}
        for c in columns:
            block[c] = _config(graph[c], d, len(graph[c].output.shape) - 1, t)
        block[row] = _config(graph[row], d, graph[row].reduction_dims[0], t)
        for name in middle:
            node = graph[name]
            seen = {**planned, **block}
            block[name] = next((cfg for i in range(len(node.dims)) if i != node.sample_dim
                                for cfg in [_config(node, d, i, t)]
                                if cfg is not None and _reads_locally(graph, node, cfg, seen)), None)
        if all(cfg is not None for cfg in block.values()):
            planned.update(block)
    for node in graph:
        configs[node.name] = planned.get(node.name) or _other(node, d, t)
    return Strategy.of({n.name: configs[n.name] for n in graph}, num_devices)
