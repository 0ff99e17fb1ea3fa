"""Baseline plans an expert would write: data parallel, model parallel, OWT and pipeline."""

from __future__ import annotations

from typing import Callable, Sequence

from strategies.config import ParallelConfig
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.rules import get_rule
from strategies.strategy import Strategy

__all__ = ["BASELINES", "baseline", "data_parallel", "model_parallel", "owt", "param_split", "pipeline",
           "balanced_stages"]

_WHOLE = {"input", "parameter", "constant"}


def _split_one(node: OpNode, dim: int | None, n: int, devices: Sequence[int]) -> ParallelConfig | None:
    """``node`` cut ``n`` ways on ``dim`` over ``devices``, or None where the rule forbids it."""
    if dim is None or n == 1 or not get_rule(node.kind).splittable(node)[dim] or node.shape[dim] % n:
        return None
    degrees = tuple(n if i == dim else 1 for i in range(len(node.dims)))
    if get_rule(node.kind).check_degrees(node, degrees):
        return None
    return ParallelConfig(degrees, tuple(devices[:n]))


def _whole(node: OpNode, device: int = 0) -> ParallelConfig:
    return ParallelConfig((1,) * len(node.dims), (device,))


def _check_counts(num_devices: int, microbatches: int = 1) -> None:
    for name, v in (("num_devices", num_devices), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(None, name, v, "must be a whole number >= 1")


def _check_batch(graph: OpGraph, n: int, microbatches: int = 1) -> int:
    """The batch, divisible by ``n`` devices x ``microbatches`` (the error blames the one that
    is not 1)."""
    _check_counts(n, microbatches)
    batch = graph.batch_size
    if batch is None:
        raise PlanError(None, "batch_size", None, "the model has no op with a sample dim to split")
    if batch % (n * microbatches):
        field, value = (("num_devices", n) if microbatches == 1 else ("microbatches", microbatches) if n == 1
                        else ("num_devices x microbatches", n * microbatches))
        raise PlanError(None, field, value, f"batch {batch} is not divisible by {n} devices x {microbatches} "
                        f"micro-batches = {n * microbatches}")
    return batch


def data_parallel(graph: OpGraph, num_devices: int) -> Strategy:
    """Every op cut num_devices ways on its sample dim (weights replicated); an op with no
    sample dim runs whole on device 0."""
    _check_batch(graph, num_devices)
    devices = tuple(range(num_devices))
    return Strategy.of({n.name: _split_one(n, n.sample_dim, num_devices, devices) or _whole(n)
                        for n in graph}, num_devices)


def balanced_stages(graph: OpGraph, stages: int) -> list[list[str]]:
    """Split the ops (in topological order) into at most ``stages`` contiguous runs minimizing
    the largest run's forward FLOPs (binary search on the bound, greedy fill: the linear
    partition problem)."""
    names = [n.name for n in graph]
    cost = [max(n.flops, 1) for n in graph]

    def fill(bound: int) -> list[list[str]]:
        runs, cur, acc = [], [], 0
        for name, c in zip(names, cost):
            if cur and acc + c > bound:
                runs.append(cur)
                cur, acc = [], 0
            cur.append(name)
            acc += c
        return runs + [cur] if cur else runs

    lo, hi = max(cost), sum(cost)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(fill(mid)) <= stages:
            hi = mid
        else:
            lo = mid + 1
    return fill(lo)


def model_parallel(graph: OpGraph, num_devices: int) -> Strategy:
    """Whole ops on devices: contiguous layers together, stages balanced by forward FLOPs."""
    configs = {}
    for dev, run in enumerate(balanced_stages(graph, num_devices)):
        for name in run:
            configs[name] = _whole(graph[name], dev)
    return Strategy.of({n.name: configs[n.name] for n in graph}, num_devices)


def pipeline(graph: OpGraph, num_devices: int, microbatches: int = 4, schedule: str = "gpipe") -> Strategy:
    """``num_devices`` balanced stages (model_parallel's placement) fed ``microbatches``
    micro-batches; the simulator overlaps the stages."""
    _check_batch(graph, 1, microbatches)
    return model_parallel(graph, num_devices).with_microbatches(microbatches, schedule)


def owt(graph: OpGraph, num_devices: int) -> Strategy:
    """"One weird trick" (Krizhevsky 2014): data parallel for the convolutional part, the
    fully-connected layers cut on their parameter dim (out_features); the elementwise ops
    between them follow their producer's cut."""
    _check_batch(graph, num_devices)
    devices = tuple(range(num_devices))
    configs: dict[str, ParallelConfig] = {}
    p_split: set[str] = set()
    for n in graph:
        cfg = None
        if n.kind == "linear":
            cfg = _split_one(n, len(n.dims) - 1, num_devices, devices)
        elif n.kind in ("elementwise", "dropout") and n.inputs and n.inputs[0] in p_split \
                and graph[n.inputs[0]].shape == n.shape:
            cfg = _split_one(n, len(n.dims) - 1, num_devices, devices)
        if cfg is not None:
            p_split.add(n.name)
        else:
            cfg = _split_one(n, n.sample_dim, num_devices, devices) or _whole(n)
        configs[n.name] = cfg
    return Strategy.of(configs, num_devices)


def param_split(graph: OpGraph, num_devices: int) -> Strategy:
    """Every linear cut ``num_devices`` ways on its parameter dim (out_features), every other op
    whole on device 0: tensor parallelism of the linears alone (not one of ``BASELINES``: the
    simulator-accuracy benchmark and its ranking test measure it as a plan of their own)."""
    devices = tuple(range(num_devices))
    configs = {}
    for n in graph:
        cut = _split_one(n, len(n.dims) - 1, num_devices, devices) if n.kind == "linear" else None
        configs[n.name] = cut or _whole(n)
    return Strategy.of(configs, num_devices)


BASELINES: dict[str, Callable[..., Strategy]] = {
    "data_parallel": data_parallel,
    "model_parallel": model_parallel,
    "owt": owt,
    "pipeline": pipeline,
}


def baseline(name: str, graph: OpGraph, num_devices: int, microbatches: int = 4) -> Strategy:
    """The baseline plan ``name`` (one of BASELINES) for ``graph`` on ``num_devices``."""
    if name not in BASELINES:
        raise PlanError(None, "baseline", name, f"must be one of {sorted(BASELINES)}")
    _check_counts(num_devices, microbatches)
    if name == "pipeline":
        return pipeline(graph, num_devices, microbatches)
    return BASELINES[name](graph, num_devices)
