"""Plans the parity tests run: the baselines, a parameter split of the linears, a spatial
(attribute) split of the convs, plans that place the loss so that its sum gates the step or a
backward step (``strategies.lowering.gates``), and seeded random plans from
``enumerate_configs``."""

from __future__ import annotations

import math
import random

from strategies.baselines import balanced_stages, baseline, data_parallel, hybrid, model_parallel, owt, pipeline
from strategies.config import ParallelConfig, enumerate_configs
from strategies.graph import OpGraph
from strategies.recompute_policies import op_recomputed
from strategies.rules import get_rule
from strategies.strategy import Strategy


def _cut(node, dim: int, n: int) -> ParallelConfig | None:
    if not get_rule(node.kind).splittable(node)[dim] or node.shape[dim] % n:
        return None
    degrees = tuple(n if i == dim else 1 for i in range(len(node.dims)))
    if get_rule(node.kind).check_degrees(node, degrees):
        return None
    return ParallelConfig(degrees, tuple(range(n)))


def _heads(node, n: int) -> ParallelConfig | None:
    """Attention cut on its heads by the largest degree d <= n its rule allows (grouped-query
    attention: d divides the key/value heads), times its sample dim by n / d."""
    h = next(i for i, d in enumerate(node.dims) if d.name == "heads")
    for d in (k for k in range(n, 1, -1) if n % k == 0):
        degrees = [1] * len(node.dims)
        degrees[h] = d
        if n // d > 1 and node.sample_dim is not None:
            degrees[node.sample_dim] = n // d
        if (math.prod(degrees) == n and node.shape[h] % d == 0
                and all(s % g == 0 for s, g in zip(node.shape, degrees))
                and get_rule(node.kind).check_degrees(node, degrees) is None):
            return ParallelConfig(tuple(degrees), tuple(range(n)))
    return None


def _megatron_mlp(graph: OpGraph, node, n: int) -> ParallelConfig | None:
    """A zoo gpt block's MLP as Megatron-LM cuts it (Shoeybi et al. 2019): ``mlp_fc``
    column-parallel (out_features), ``mlp_gelu`` on its features, ``mlp_proj`` row-parallel
    (in_features); None for every other op."""
    if node.name.endswith("mlp_fc"):
        return _cut(node, len(node.output.shape) - 1, n)
    if node.name.endswith("mlp_gelu"):
        return _cut(node, len(node.dims) - 1, n)
    if node.name.endswith("mlp_proj"):
        return _cut(node, node.reduction_dims[0], n)
    return None


def _with(graph: OpGraph, n: int, pick) -> Strategy:
    base = data_parallel(graph, n)
    return Strategy.of({node.name: pick(node) or base[node.name] for node in graph}, n)


def _sample_cut(node, devices: tuple[int, ...]) -> ParallelConfig:
    """``node`` cut on its sample dim over ``devices``, or whole on the first of them."""
    s = node.sample_dim
    if s is not None and get_rule(node.kind).splittable(node)[s] and len(devices) > 1:
        return ParallelConfig(tuple(len(devices) if i == s else 1 for i in range(len(node.dims))), devices)
    return ParallelConfig((1,) * len(node.dims), devices[:1])


def _stages_dp(graph: OpGraph, n: int) -> Strategy:
    """Two pipeline stages (balanced by FLOPs), each data parallel over half the devices, two
    GPipe micro-batches: the loss is split over the last stage only."""
    half = n // 2
    configs = {}
    for s, run in enumerate(balanced_stages(graph, 2)):
        for name in run:
            configs[name] = _sample_cut(graph[name], tuple(range(s * half, (s + 1) * half)))
    return Strategy.of({node.name: configs[node.name] for node in graph}, n, 2, "gpipe")


def _vocab(graph: OpGraph, n: int) -> Strategy:
    """Megatron-LM's vocab-parallel head (Shoeybi et al. 2019): the loss cut on its classes 2
    ways (times its samples n/2 ways), the linear that makes its logits column-parallel on
    out_features and the reshapes between them cut alike, on the same devices, so the logits
    never move; the rest data parallel."""
    loss = graph[graph.outputs[0]]
    chain, node = [loss], graph[loss.inputs[0]]
    while node.kind == "reshape":
        chain.append(node)
        node = graph[node.inputs[0]]
    chain.append(node)
    configs = {}
    for op in chain:
        degrees = [1] * len(op.dims)
        degrees[len(op.dims) - 1 if op is loss else len(op.output.shape) - 1] = 2
        if n > 2:
            degrees[op.sample_dim] = n // 2
        configs[op.name] = ParallelConfig(tuple(degrees), tuple(range(n)))
    return _with(graph, n, lambda node: configs.get(node.name))


def recompute(plan: Strategy, ops) -> Strategy:
    """``plan`` with recompute set on ``ops``."""
    for op in ops:
        plan = plan.replace(op, plan[op].with_memory(recompute=True))
    return plan


def _block(graph: OpGraph, i: int) -> list[str]:
    """Every op of zoo gpt's transformer block i: from its ``ln_1`` to its second residual add
    (the op before the next block's ``ln_1``, or ``ln_f``)."""
    names = [node.name for node in graph]
    start = names.index(f"blocks_{i}_ln_1")
    end = next(k for k in range(start + 1, len(names)) if names[k] in (f"blocks_{i + 1}_ln_1", "ln_f"))
    return names[start:end]


def recompute_ops(graph: OpGraph, what: str) -> list[str]:
    """The ops a ``+rc_<what>`` plan recomputes: ``block<i>`` (every op of gpt block i),
    ``blocks`` (of every block), ``layers`` (of every block but its closing residual add, whose
    output, the next block's input, is then all a block keeps: Korthikanti et al. 2022 §4.1), ``mlp`` (each block's ``mlp_fc`` and ``mlp_gelu``: fc's output
    dropped, gelu's kept for the row-parallel proj), ``attn`` (Korthikanti et al. 2022's
    selective recompute: the attention core and the reshapes around it, from q/k/v's outputs to
    the proj's input), ``op`` (``strategies.recompute_policies.op_recomputed``), ``mid`` (the tiny mlp's layers_1..layers_3), ``seed<k>`` (a random half
    of the ops with a backward and no sum across devices)."""
    if what.startswith("block") and what != "blocks":
        return _block(graph, int(what.removeprefix("block")))
    blocks = sorted({int(n.name.split("_")[1]) for n in graph if n.name.startswith("blocks_")})
    if what == "blocks":
        return [op for i in blocks for op in _block(graph, i)]
    if what == "layers":  # Megatron-LM's full recompute: all but the closing residual add, whose output is kept
        return [op for i in blocks for op in _block(graph, i)[:-1]]
    if what == "mlp":
        return [op for i in blocks for op in (f"blocks_{i}_mlp_fc", f"blocks_{i}_mlp_gelu")]
    if what == "attn":
        out = []
        for i in blocks:
            ops = _block(graph, i)
            first = max(ops.index(f"blocks_{i}_attn_{x}") for x in "qkv") + 1
            out += [op for op in ops[first:ops.index(f"blocks_{i}_attn_proj")]
                    if not op.startswith(f"blocks_{i}_attn_")]
        return out
    if what == "op":  # torchtitan's selective op checkpointing, as per-op flags
        plan = op_recomputed(data_parallel(graph, 1), graph)
        return [n.name for n in graph if plan[n.name].recompute]
    if what == "mid":
        return ["layers_1", "layers_2", "layers_3"]
    if what.startswith("seed"):
        rng = random.Random(int(what.removeprefix("seed")))
        ok = [n.name for n in graph if graph.needs_grad[n.name] and n.kind not in ("parameter", "constant", "input")
              and n.kind != "loss"]
        return rng.sample(ok, len(ok) // 2)
    raise ValueError(f"unknown recompute set {what!r}")


def zero(level: int, plan: Strategy, graph: OpGraph) -> Strategy:
    """``plan`` with every op that has a trainable weight at sharding level ``level``
    (``ParallelConfig.zero``: ZeRO stage)."""
    return Strategy.of({node.name: plan[node.name].with_memory(zero=level)
                        if any(w.trainable for w in node.weights) else plan[node.name] for node in graph},
                       plan.num_devices, plan.microbatches, plan.schedule, plan.precision)


def make_plan(graph: OpGraph, name: str, n: int) -> Strategy:
    """The plan ``name`` for ``graph`` on ``n`` devices (``random<seed>``, ``random_mb<seed>``:
    a random config per op; the second with 2 GPipe micro-batches; ``<plan>+rc_<what>``:
    ``<plan>`` with recompute on ``recompute_ops(graph, what)``; ``zero<level>_<plan>``:
    ``plan`` with every weighted op at that sharding level; ``first1_<plan>``: its first weighted
    op at level 1, a gradient bucket of its own that starts after the others, ``strategies.overlap``;
    ``cap<K>k_<plan>``: ``plan`` with gradient buckets capped at K KiB, ``split_buckets``;
    ``unitblock_<plan>``: ``plan`` with ``fsdp_unit`` "block"; ``after_<plan>``: ``plan`` with its
    buckets synced after the backward and its sends, ``overlap_grad_reduce`` False)."""
    if name.startswith("after_"):  # <plan> with every gradient bucket synced after the backward (overlap_grad_reduce)
        return make_plan(graph, name.removeprefix("after_"), n).with_overlap_grad_reduce(False)
    if name.startswith("unitblock_"):  # <plan> with ZeRO-3 prefetch units of whole repeated blocks (fsdp_unit)
        return make_plan(graph, name.removeprefix("unitblock_"), n).with_fsdp_unit("block")
    if name.startswith("cap") and "k_" in name:  # <plan> with gradient buckets capped at <KiB> KiB (DDP's bucket_cap_mb)
        kib, rest = name.removeprefix("cap").split("k_", 1)
        return make_plan(graph, rest, n).with_bucket_cap(int(kib) / 1024)
    if "+rc_" in name:
        base, what = name.split("+rc_")
        return recompute(make_plan(graph, base, n), recompute_ops(graph, what))
    if name.startswith("first1_"):  # <plan> with its first weighted op at level 1: a bucket of its own, started last
        plan = make_plan(graph, name.removeprefix("first1_"), n)
        first = next(node.name for node in graph if any(w.trainable for w in node.weights))
        return Strategy.of({node.name: plan[node.name].with_memory(zero=1) if node.name == first else plan[node.name]
                            for node in graph}, plan.num_devices, plan.microbatches, plan.schedule, plan.precision)
    if name.startswith("zero") and "_" in name:
        level, rest = name.removeprefix("zero").split("_", 1)
        return zero(int(level), make_plan(graph, rest, n), graph)
    if name == "dp":
        return data_parallel(graph, n)
    if name == "dp_mb2":  # the loss on every device, 2 micro-batches
        return data_parallel(graph, n).with_microbatches(2, "gpipe")
    if name == "loss_some":  # data parallel but the loss on the last n/2 devices only
        loss = graph[graph.outputs[0]]
        return _with(graph, n, lambda node: _sample_cut(node, tuple(range(n - n // 2, n))) if node is loss else None)
    if name == "stages_dp":
        return _stages_dp(graph, n)
    if name == "mp":
        return model_parallel(graph, n)
    if name == "owt":
        return owt(graph, n)
    if name == "hybrid":
        return hybrid(graph, n)
    if name in ("gpipe", "1f1b"):
        return pipeline(graph, n, 2, name)
    if name == "param":  # every linear cut on out_features, the rest data parallel
        return _with(graph, n, lambda node: _cut(node, len(node.output.shape) - 1, n) if node.kind == "linear" else None)
    if name == "heads":  # tensor parallel by heads: attention on heads, linears on out_features
        return _with(graph, n, lambda node: _heads(node, n) if node.kind == "attention" else
                     _cut(node, len(node.output.shape) - 1, n) if node.kind == "linear" else None)
    if name == "heads_proj":  # "heads", and 3-D matmuls (a projection by a sliced weight) on cols
        return _with(graph, n, lambda node: _heads(node, n) if node.kind == "attention" else
                     _cut(node, len(node.output.shape) - 1, n) if node.kind == "linear"
                     or (node.kind == "matmul" and len(node.output.shape) == 3) else None)
    if name == "spatial":  # every conv cut on height (attribute), the rest data parallel
        return _with(graph, n, lambda node: _cut(node, 2, n) if node.kind == "conv2d" else None)
    if name.startswith("megatron"):  # strategies.megatron, tensor parallel 2 ways (data parallel over the
        # rest); "_sp": sequence parallel between the blocks; "_pp2": 2 stages fed 2 micro-batches (1F1B);
        # "_tp1" / "_tp4": tensor parallel 1 / 4 ways; "_v2": 2 chunks per rank (interleaved); "_mb2" /
        # "_mb4": 2 / 4 micro-batches
        pp = 2 if "_pp2" in name else 1
        m = 4 if "_mb4" in name else 2 if "_mb2" in name else pp
        return baseline("megatron", graph, n, microbatches=m, tp=1 if "_tp1" in name else 4 if "_tp4" in name else 2,
                        pp=pp, sequence_parallel="_sp" in name, virtual_stages=2 if "_v2" in name else 1)
    if name == "row":  # every linear cut on in_features (row-parallel: Partial sums), the rest data parallel
        return _with(graph, n, lambda node: _cut(node, node.reduction_dims[0], n) if node.kind == "linear" else None)
    if name == "conv_in":  # every conv that can be cut n ways on its in channels so (Partial sums)
        return _with(graph, n, lambda node: _cut(node, 4, n) if node.kind == "conv2d" else None)
    if name == "vocab":  # the loss vocab-parallel with the linear before it column-parallel
        return _vocab(graph, n)
    if name == "rowcol":  # a linear reading a linear: the first row-parallel, the second column-parallel
        users = {src: node for node in graph for src in node.inputs}
        return _with(graph, n, lambda node: _cut(node, node.reduction_dims[0], n)
                     if node.kind == "linear" and getattr(users.get(node.name), "kind", None) == "linear"
                     else _cut(node, len(node.output.shape) - 1, n)
                     if node.kind == "linear" and graph[node.inputs[0]].kind == "linear" else None)
    if name == "colrow":  # Megatron-LM's MLP: fc column-parallel, its activation cut alike, proj row-parallel
        return _with(graph, n, lambda node: _megatron_mlp(graph, node, n))
    if name.startswith("random_r"):  # random configs; every op with a reduction dim cut on it
        rng = random.Random(int(name.removeprefix("random_r")))
        configs = {}
        for node in graph:
            every = list(enumerate_configs(node, n))
            cut = [c for c in every if any(c.degrees[i] > 1 for i in node.reduction_dims)]
            configs[node.name] = rng.choice(cut or every)
        return Strategy.of(configs, n)
    if name.startswith("random"):
        m = 2 if name.startswith("random_mb") else 1
        rng = random.Random(int(name.rsplit("random_mb" if m == 2 else "random", 1)[1]))
        configs = {node.name: rng.choice(list(enumerate_configs(node, n, microbatches=m))) for node in graph}
        return Strategy.of(configs, n, m, "gpipe")
    raise ValueError(f"unknown test plan {name!r}")


def partial_sources(lowered) -> set[str]:
    """The ops whose Partial sums someone reads: point to point (``Transfer.partial``) or
    through an all-reduce or reduce-scatter (``Lowered.collectives``)."""
    return ({t.src_op for t in lowered.transfers if t.partial and not t.local}
            | {c.op for c in lowered.collectives if c.kind != "all_gather"})
