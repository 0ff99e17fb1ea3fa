"""Baseline plans an expert would write: one device (every op whole on device 0), data parallel, ZeRO-1 and FSDP (data parallel with
its replicated state sharded), model parallel, OWT, pipeline, and data x tensor parallel
(``hybrid``) for a batch the devices do not divide."""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from strategies.config import ParallelConfig, check_degrees
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.megatron import megatron, megatron_blocks
from strategies.megatron_layers import layer_recomputed
from strategies.drops import recomputable
from strategies.recompute_policies import attention_recomputed
from strategies.region import partition_index
from strategies.repeats import repeated_blocks
from strategies.replicas import shardable
from strategies.rules import get_rule
from strategies.stages import linear_partition
from strategies.strategy import Strategy

__all__ = ["BASELINES", "RECOMPUTE", "baseline", "data_parallel", "fsdp", "hybrid", "megatron", "model_parallel", "owt",
           "param_split", "pipeline", "balanced_stages", "megatron_lm", "recomputed", "sharded", "single_device",
           "zero1"]

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


def single_device(graph: OpGraph, num_devices: int) -> Strategy:
    """Every op whole on device 0 (of ``num_devices``): no parallelism, the plan to beat where
    parallelism does not pay."""
    _check_counts(num_devices)
    return Strategy.of({n.name: _whole(n) for n in graph}, num_devices)


def data_parallel(graph: OpGraph, num_devices: int) -> Strategy:
    """Every op cut num_devices ways on its sample dim (weights replicated); an op with no
    sample dim runs whole on device 0."""
    _check_batch(graph, num_devices)
    devices = tuple(range(num_devices))
    return Strategy.of({n.name: _split_one(n, n.sample_dim, num_devices, devices) or _whole(n)
                        for n in graph}, num_devices)


def sharded(plan: Strategy, graph: OpGraph, zero: int) -> Strategy:
    """``plan`` with sharding level ``zero`` on every op whose trainable weight shards have two
    replicas or more (``strategies.replicas.shardable``); every other op keeps level 0 (an op
    with no trainable weight may not take one, and a shard held by one device has no replicas
    to shard over)."""
    configs = {name: cfg.with_memory(zero=zero) if shardable(graph, plan, name) else cfg
               for name, cfg in plan.items()}
    return plan.with_configs(configs)


def recomputed(plan: Strategy, graph: OpGraph) -> Strategy:
    """``plan`` with every op of every transformer block (``megatron_blocks``: the attention's
    and the MLP's linears and the ops between them) recomputed in the backward: Korthikanti et
    al. 2022's full recompute of a layer's blocks. A PlanError where the graph has no block."""
    blocks = megatron_blocks(graph)
    if not blocks:
        raise PlanError(None, "recompute", True, f"model {graph.name!r} has no linear → attention → linear "
                        "or linear → activation → linear block to recompute")
    return plan.with_recompute({op for cols, mid, row in blocks for op in (*cols, *mid, row)
                                if recomputable(graph, graph[op])})


def megatron_lm(graph: OpGraph, num_devices: int, tp: int, pp: int, micro_batch: int = 1,
                precision: str = "bf16") -> Strategy:
    """The plan Megatron-LM runs GPT-3 175B with (Narayanan et al. SC'21 Table 1 and its
    ``examples/gpt3/train_gpt3_175b_distributed.sh``): ``megatron`` at ``tp`` × ``pp`` with
    sequence parallelism, ``micro_batch`` samples a micro-batch (m = batch / (d · micro_batch)
    of them, d = N / (tp · pp)) under 1F1B, every layer recomputed (``layer_recomputed``), the
    distributed optimizer (ZeRO-1 over the d data-parallel replicas, ``sharded``) and
    ``precision``. A PlanError where the batch does not divide into d · ``micro_batch``."""
    _check_counts(num_devices, micro_batch)
    if isinstance(tp, bool) or isinstance(pp, bool) or not isinstance(tp, int) or not isinstance(pp, int) \
            or tp < 1 or pp < 1 or num_devices % (tp * pp):
        raise PlanError(None, "tp x pp", f"{tp} x {pp}", f"must be whole numbers >= 1 whose product divides "
                        f"num_devices {num_devices}")
    d = num_devices // (tp * pp)
    batch = _check_batch(graph, 1)
    if batch % (d * micro_batch):
        raise PlanError(None, "micro_batch", micro_batch, f"batch {batch} is not divisible by {d} data-parallel "
                        f"replicas x {micro_batch} samples = {d * micro_batch}")
    m = batch // (d * micro_batch)
    plan = megatron(graph, num_devices, tp, pp, m, sequence_parallel=True)
    plan = plan.with_microbatches(m, "1f1b") if m > 1 else plan
    return layer_recomputed(sharded(plan, graph, 1), graph).with_precision(precision)


def zero1(graph: OpGraph, num_devices: int) -> Strategy:
    """Data parallel with ZeRO stage 1 (Rajbhandari et al. 2020): each weight's optimizer state
    Shard(0) over its replicas, gradients reduce-scattered, weights all-gathered after the
    update (DeepSpeed's ``stage: 1``, Megatron-LM's distributed optimizer)."""
    return sharded(data_parallel(graph, num_devices), graph, 1)


def fsdp(graph: OpGraph, num_devices: int) -> Strategy:
    """Data parallel with every weighted op at ZeRO stage 3: FSDP2's ``fully_shard`` of every
    module (Zhao et al. 2023, "PyTorch FSDP"): weights, gradients and optimizer state Shard(0)
    over all devices, each weight all-gathered before its op's forward and again before its
    backward, gradients reduce-scattered; each repeated block's instance (a transformer layer,
    ``strategies.repeats``) one prefetch unit where the graph has them (``fsdp_unit`` "block",
    FSDP2's ``fully_shard`` per layer), else each op's step."""
    plan = sharded(data_parallel(graph, num_devices), graph, 3)
    return plan.with_fsdp_unit("block" if repeated_blocks(graph) else "op")


def hybrid(graph: OpGraph, num_devices: int, microbatches: int = 1) -> Strategy:
    """Data parallel as far as the batch allows, the rest tensor parallel (DP x TP): s = the
    largest divisor of num_devices that divides the micro-batch (batch / ``microbatches``),
    t = num_devices / s; every op cut s ways on its sample dim and t ways on its first
    parameter dim that takes t, else its first attribute dim. Partition (sample i, other j)
    runs on device i·t + j, so each sample shard's t-way group is t consecutive devices. An op
    no other dim of which takes t runs s ways on devices 0, t, 2t...; one that cannot be cut
    s ways on its sample dim (none, or one s does not divide or its rule refuses) whole on
    device 0 (with s = 1 only its other dim is cut). Where the micro-batch divides by
    num_devices (t = 1) it is ``data_parallel``. The plan has one micro-batch
    (``with_microbatches`` sets them)."""
    batch = _check_batch(graph, 1, microbatches) // microbatches
    _check_counts(num_devices)
    s = max(d for d in range(1, num_devices + 1) if num_devices % d == 0 and batch % d == 0)
    return Strategy.of({n.name: _hybrid_one(n, s, num_devices // s, microbatches) for n in graph}, num_devices)


def _hybrid_one(node: OpNode, s: int, t: int, m: int) -> ParallelConfig:
    i = node.sample_dim
    rule = get_rule(node.kind)
    ok = rule.splittable(node)
    if s > 1 and (i is None or not ok[i] or node.shape[i] % s):
        return _whole(node)
    for k in [k for role in ("parameter", "attribute") for k, dim in enumerate(node.dims)
              if dim.role == role and k != i and t > 1 and ok[k] and node.shape[k] % t == 0]:
        degrees = tuple(s if d == i else t if d == k else 1 for d in range(len(node.dims)))
        if check_degrees(node, degrees, m) is None:
            step = {i: t, k: 1}  # the device of partition (sample c_i, dim k c_k) is c_i·t + c_k
            devices = tuple(sum(c * step[d] for d, c in enumerate(idx) if d in step)
                            for idx in map(partition_index, range(s * t), itertools.repeat(degrees)))
            return ParallelConfig(degrees, devices)
    degrees = tuple(s if d == i else 1 for d in range(len(node.dims)))
    if s > 1 and check_degrees(node, degrees, m):
        return _whole(node)
    return ParallelConfig(degrees, tuple(range(0, s * t, t)))


def balanced_stages(graph: OpGraph, stages: int) -> list[list[str]]:
    """Split the ops (in topological order) into at most ``stages`` contiguous runs minimizing
    the largest run's forward FLOPs (``strategies.stages.linear_partition``)."""
    names = [n.name for n in graph]
    starts = linear_partition([max(n.flops, 1) for n in graph], stages)
    return [names[a:b] for a, b in zip(starts, starts[1:] + [len(names)])]


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
            cfg = _split_one(n, len(n.output.shape) - 1, num_devices, devices)
        elif n.kind in ("elementwise", "dropout") and n.inputs and n.inputs[0] in p_split \
                and graph[n.inputs[0]].output.shape == n.output.shape:
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
        cut = _split_one(n, len(n.output.shape) - 1, num_devices, devices) if n.kind == "linear" else None
        configs[n.name] = cut or _whole(n)
    return Strategy.of(configs, num_devices)


BASELINES: dict[str, Callable[..., Strategy]] = {
    "data_parallel": data_parallel,
    "fsdp": fsdp,
    "hybrid": hybrid,
    "megatron": megatron,
    "model_parallel": model_parallel,
    "owt": owt,
    "pipeline": pipeline,
    "single_device": single_device,
    "zero1": zero1,
}


def baseline(name: str, graph: OpGraph, num_devices: int, microbatches: int | None = None,
             tp: int | None = None, pp: int = 1, sequence_parallel: bool = False,
             recompute: bool | str = False, virtual_stages: int = 1) -> Strategy:
    """The baseline plan ``name`` (one of BASELINES) for ``graph`` on ``num_devices``;
    ``microbatches``: of ``pipeline`` (default 4) and ``megatron`` (default 1); ``tp``, ``pp``,
    ``sequence_parallel``, ``virtual_stages``: ``megatron``'s tensor-parallel degree (default
    ``strategies.megatron.default_tp``), pipeline stages, layout between its blocks and model
    chunks per pipeline rank (the interleaved schedule above 1);
    ``recompute``: a policy of ``RECOMPUTE`` (True: "blocks", False: none)."""
    if name not in BASELINES:
        raise PlanError(None, "baseline", name, f"must be one of {sorted(BASELINES)}")
    if recompute is True:
        recompute = "blocks"
    if recompute and recompute not in RECOMPUTE:
        raise PlanError(None, "recompute", recompute, f"must be one of {sorted(RECOMPUTE)}")
    plan = _baseline(name, graph, num_devices, microbatches, tp, pp, sequence_parallel, virtual_stages)
    return RECOMPUTE[recompute](plan, graph) if recompute else plan


RECOMPUTE: dict[str, Callable[[Strategy, OpGraph], Strategy]] = {
    "blocks": recomputed,
    "layers": layer_recomputed,
    "selective": attention_recomputed,
}
"""Recompute policies by name: every op of every transformer block (Korthikanti et al. 2022's
full recompute of the blocks), every op of every layer but its closing residual add
(Megatron-LM's ``--recompute-granularity full``, torchtitan's full activation checkpointing),
the attention cores (Korthikanti et al. 2022 §5's selective recompute). Torchtitan's selective
op checkpointing is ``strategies.recompute_policies.op_recomputed``, not named here: its per-op
flags keep more than the policy does (its docstring)."""


def _baseline(name: str, graph: OpGraph, num_devices: int, microbatches: int | None, tp: int | None, pp: int,
              sequence_parallel: bool, virtual_stages: int = 1) -> Strategy:
    if name == "megatron":
        return megatron(graph, num_devices, tp, pp, 1 if microbatches is None else microbatches,
                        sequence_parallel, virtual_stages)
    microbatches = 4 if microbatches is None else microbatches
    _check_counts(num_devices, microbatches)
    if name == "pipeline":
        return pipeline(graph, num_devices, microbatches)
    return BASELINES[name](graph, num_devices)
