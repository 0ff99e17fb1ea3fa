"""Ground-truth check of op rules: trace a small module, run it for real, then compute every
partition of an op from only the input and weight regions its rule names and compare with that
slice of the real output (a cut of a reduction dim: the sum of the Partial outputs of the
partitions that share an output region). Reductions run as a real all-reduce would: every partition of a group
in its own thread, summing in partition order behind a barrier."""

from __future__ import annotations

import copy
import itertools
import math
import random
import threading
from typing import Any, Sequence

import torch
import torch.fx as fx

from soapsearch._fx.base import adapter_for
from soapsearch.trace import _symbolic_trace, trace
from strategies.graph import OpGraph, OpNode
from strategies.region import partition_boxes, partition_index, slice_box
from strategies.rules import get_rule
from strategies.rules.cross_entropy import CLASS_SUMS, ClassShards


def run_fx(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """``model`` symbolic-traced and run for real, each node's value in ``meta["val"]``."""
    gm = _symbolic_trace(model)  # the tracer trace() uses: buffers read in forward are get_attr

    class Keep(fx.Interpreter):
        def run_node(self, n):
            n.meta["val"] = super().run_node(n)
            return n.meta["val"]

    Keep(gm).run(*inputs)
    return gm


def adapt(model: torch.nn.Module, inputs: Sequence[torch.Tensor], target: Any) -> list[Any]:
    """The fx adapter's answer (FxOp or None) for each call of ``target``, from a real run."""
    gm = run_fx(model, inputs)
    return [adapter_for(n, gm)() for n in gm.graph.nodes if n.target == target]


def reference_values(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[OpGraph, dict[str, Any]]:
    """The OpGraph of ``model`` and every op's real output on ``inputs``."""
    graph = trace(model, tuple(inputs))
    env = {n.name: n.meta["val"] for n in run_fx(model, inputs).graph.nodes}
    values = {}
    for node in graph:
        v = env[node.name]
        while isinstance(v, (tuple, list)):
            v = v[0]
        values[node.name] = v
    return graph, values


def grids(node: OpNode, max_parts: int = 8, count: int = 6, seed: int = 0) -> list[tuple[int, ...]]:
    """Up to ``count`` random valid degree grids of ``node`` (always including the single-dim
    splits), each degree dividing its dim, product <= max_parts."""
    rule = get_rule(node.kind)
    ok = rule.splittable(node)
    choices = [[d for d in range(1, max_parts + 1) if s % d == 0] if ok[i] else [1]
               for i, s in enumerate(node.shape)]
    all_grids = [g for g in itertools.product(*choices)
                 if 1 < _prod(g) <= max_parts and rule.check_degrees(node, g) is None]
    rng = random.Random(seed)
    singles = [g for g in all_grids if sum(d > 1 for d in g) == 1]
    rest = [g for g in all_grids if g not in singles]
    rng.shuffle(rest)
    return singles + rest[: max(0, count - len(singles))]


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def run_partitions(graph: OpGraph, values: dict[str, Any], model: torch.nn.Module, name: str,
                   degrees: Sequence[int], external: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every partition's output of op ``name`` under ``degrees``, computed from regions only."""
    node = graph[name]
    rule = get_rule(node.kind)
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    gm = _symbolic_trace(model)  # fx's folded constants (_tensor_constant0) live here
    state.update({n.target: getattr(gm, n.target) for n in gm.graph.nodes
                  if n.op == "get_attr" and n.target not in state and hasattr(gm, n.target)})
    boxes = partition_boxes(node.shape, degrees)
    reds = rule.reductions(node, degrees)
    over = set(i for r in reds for i in r.over)
    groups: dict[tuple, list[int]] = {}
    for k in range(len(boxes)):
        c = partition_index(k, degrees)
        groups.setdefault(tuple(x for i, x in enumerate(c) if i not in over), []).append(k)
    results: list[Any] = [None] * len(boxes)
    shards = _class_shards(node, degrees, reds)

    def run(k: int, reducer) -> None:
        box = boxes[k]
        regions = rule.input_regions(node, box)
        ins = [None if r is None else values[src][slice_box(r)]
               for src, r in zip(node.inputs, regions)]
        ws = {role: state[node.weight(role).name][slice_box(r)]
              for role, r in rule.weight_regions(node, box).items()}
        try:
            extra = {"shards": ClassShards(*shards[k])} if k in shards else {}
            results[k] = rule.forward(node, box, ins, ws, reducer, **extra)
        except BaseException as e:  # noqa: BLE001
            results[k] = e

    for members in groups.values():
        reducers = _collective(members, _add)
        threads = [threading.Thread(target=run, args=(k, reducers[k])) for k in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _add(ts: list[torch.Tensor]) -> torch.Tensor:
    return sum(ts[1:], ts[0])


def _max(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ts).amax(0)


def _collective(members: Sequence[int], combine) -> dict[int, Any]:
    """Per member of a group run in threads, a call that combines every member's tensor (in
    member order, behind a barrier), as a collective would."""
    barrier = threading.Barrier(len(members))
    slots: dict[int, torch.Tensor] = {}
    lock = threading.Lock()

    def make(k: int):
        def call(t: torch.Tensor) -> torch.Tensor:
            with lock:
                slots[k] = t
            barrier.wait()
            total = combine([slots[m] for m in members])
            barrier.wait()
            return total
        return call
    return {k: make(k) for k in members}


def _class_shards(node: OpNode, degrees: Sequence[int], reds) -> dict[int, tuple[Any, Any]]:
    """Partition -> (max, sum) over its class shards, for a loss whose rule asks for them
    (``CLASS_SUMS``); every class group lies inside one group of ``run_partitions``' threads."""
    over = {i for r in reds if r.name in CLASS_SUMS for i in r.over}
    if not over:
        return {}
    groups: dict[tuple, list[int]] = {}
    for k in range(math.prod(degrees)):
        c = partition_index(k, degrees)
        groups.setdefault(tuple(x for i, x in enumerate(c) if i not in over), []).append(k)
    out = {}
    for members in groups.values():
        maxes, sums = _collective(members, _max), _collective(members, _add)
        out.update({k: (maxes[k], sums[k]) for k in members})
    return out


def check_op(graph: OpGraph, values: dict[str, Any], model: torch.nn.Module, name: str,
             degrees: Sequence[int], atol: float = 1e-10) -> None:
    """Assert every partition equals its slice of the real output (a loss: the whole value); the
    partitions of one output region on a cut reduction dim: their sum equals it, each added in
    partition order."""
    node = graph[name]
    full = values[name]
    outs = run_partitions(graph, values, model, name, degrees)
    # a loss is whole on every partition once its sums are done (its classes are summed inside)
    partial = node.kind != "loss" and any(degrees[i] > 1 for i in node.reduction_dims)
    sums: dict[Any, tuple[int, tuple, torch.Tensor]] = {}
    for k, (box, out) in enumerate(zip(partition_boxes(node.shape, degrees), outs)):
        region = node.output_region(box) if partial else k
        first = sums.get(region)
        sums[region] = (k, box, out) if first is None else (first[0], first[1], first[2] + out)
    if partial:
        assert len(sums) * _prod(degrees[i] for i in node.reduction_dims) == len(outs)
    for k, box, out in sums.values():
        want = full if node.kind == "loss" else full[slice_box(node.output_region(box))]
        assert out.shape == want.shape, f"{name} {degrees} partition {k}: shape {tuple(out.shape)} != {tuple(want.shape)}"
        torch.testing.assert_close(out, want, atol=atol, rtol=1e-9,
                                   msg=lambda m: f"{name} ({node.kind}) degrees {tuple(degrees)} partition {k} box {box}: {m}")


def check_model(model: torch.nn.Module, inputs: Sequence[torch.Tensor], kinds: set[str] | None = None,
                count: int = 6, max_parts: int = 8, seed: int = 0) -> int:
    """check_op over every op of ``model`` (of ``kinds``, if given) and random grids; returns
    how many (op, grid) pairs were checked. Runs in float64."""
    model = copy.deepcopy(model).double()
    inputs = [x.double() if x.is_floating_point() else x for x in inputs]
    graph, values = reference_values(model, inputs)
    n = 0
    for node in graph:
        if node.kind in ("input",) or (kinds is not None and node.kind not in kinds):
            continue
        for g in grids(node, max_parts=max_parts, count=count, seed=seed):
            check_op(graph, values, model, node.name, g)
            n += 1
    return n
