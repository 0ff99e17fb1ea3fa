"""The Megatron-LM plan (Shoeybi et al. 2019; Narayanan et al. 2021; sequence parallelism:
Korthikanti et al. 2022) written in SOAP configs, found by the graph's structure.

A *block* is a row-parallel linear L2 whose input, followed backwards, passes only through
*middle* ops (reshape, permute, slice, concat, pointwise ops, dropout, attention; a producer
with no sample dim, such as a rotary table, is read whole like a weight) and ends at
column-parallel linears L1 whose every consumer is a middle op: linear → attention → linear
(q/k/v, attention by heads, output projection) and linear → activation → linear (the MLP, a
SwiGLU's two column linears included). With t-way tensor parallelism, p pipeline stages and
d = N / (t·p) data parallelism in each stage:

- L1: sample cut d ways, out_features t ways (``ColwiseParallel``);
- a middle op: sample d ways and the one dim whose t-way cut reads only what the producers'
  partitions on its own device hold (the heads of a reshape, the permute, the rotary slices
  and the attention; an activation's features), so no byte moves inside a block;
- L2: sample d ways, in_features t ways (``RowwiseParallel``): a Partial sum of its output;
- the linear producing a cross-entropy's logits (through reshapes and casts): column-parallel
  on its out_features (the vocabulary), the reshapes cut alike, and the loss cut t ways on its dim
  named ``classes`` where its rule has one (Megatron's vocab-parallel cross-entropy, which
  never gathers the logits); without it the loss reads whole rows of the logits;
- an embedding: its vocabulary rows t ways (vocab-parallel), a Partial sum of its output;
- every other op (LayerNorm, residual adds, dropout between the blocks): with
  ``sequence_parallel``, sample d ways × its first attribute dim that t divides (the sequence,
  Korthikanti et al.'s layout); without it, sample d·t ways (each tensor-parallel group's
  micro-batch shared out over its t devices), else the sequence. Either way L2's Partial
  sums are reduce-scattered into it and L1 all-gathers its input from it: the bytes of
  Megatron-LM's all-reduce (a ring all-reduce is a reduce-scatter then an all-gather, Patarasuk
  & Yuan 2009). Megatron without sequence parallelism *replicates* these ops on the t ranks;
  a SOAP config computes each output element once, so the replicated layout has no config of
  its own: the sample-dim cut keeps Megatron's bytes and differs only in computing the
  between-block ops once instead of t times (1/t of their time and activations per device).
  Ops that cannot be cut so run d ways on devices 0, t, 2t, ... A [batch, seq] op read only
  through flattening reshapes (the targets) whose replica holds g samples a micro-batch,
  1 < g < t, g dividing t, is cut g·d ways on its samples and t/g on its sequence, as the
  flattened rows are cut (``_other``).

Partition (sample i, tensor j) of a stage starting at device f runs on device f + i·t + j:
each tensor-parallel group is t consecutive devices (one node's NVLink domain on a GPU
cluster). Pipeline stages (``pp``) are contiguous runs of ops, a block never split, balanced by
forward FLOPs (the simulated time's proxy: ``megatron_stages``); stage s runs on devices
[s·N/p, (s+1)·N/p). ``microbatches`` sets the plan's micro-batches (1F1B, Megatron's
schedule, when there are several). With ``virtual_stages`` v the ops are cut into p·v such
stages and stage s runs on the devices of pipeline rank s mod p, under the interleaved schedule
(``strategies.chunks``).
"""

from __future__ import annotations

import math
from typing import Hashable

from strategies.config import ParallelConfig, check_degrees
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.megatron_stages import megatron_stages
from strategies.pieces import box_at, check_microbatches, grid_of, overlapping
from strategies.repeats import signature
from strategies.rules import get_rule
from strategies.strategy import Strategy

__all__ = ["Block", "block_layout", "default_tp", "flattened", "flattened_cut", "flattened_relaid", "megatron",
           "megatron_blocks", "vocab_head"]

_MIDDLE = {"reshape", "flatten", "permute", "dropout", "attention", "elementwise", "add", "mul", "slice",
           "concat", "expand", "repeat_interleave"}
_ACTIVATION = {"attention", "elementwise"}

Block = tuple[tuple[str, ...], tuple[str, ...], str]
"""(column linears, middle ops in graph order, row linear)."""


def default_tp(graph: OpGraph, num_devices: int) -> int:
    """The largest t <= min(N, 8) dividing N and the heads of every attention op (the issue's
    default: one node's devices at most)."""
    heads = _heads(graph)
    return max(t for t in range(1, min(num_devices, 8) + 1)
               if num_devices % t == 0 and all(h % t == 0 for _, h in heads))


def _heads(graph: OpGraph) -> list[tuple[str, int]]:
    return [(n.name, n.shape[n.dims.index(d)]) for n in graph if n.kind == "attention"
            for d in n.dims if d.name == "heads"]


def _walked(graph: OpGraph, node: OpNode) -> list[str]:
    """The producers a block follows: activations with a sample dim (a weight, a constant or a
    table computed from positions alone is read whole, like a weight); an attention's query,
    key and value, not its mask (built outside the block, read as it is)."""
    inputs = node.inputs[:3] if node.kind == "attention" else node.inputs
    return [s for s in inputs
            if graph[s].kind not in ("parameter", "constant") and graph[s].sample_dim is not None]


def megatron_blocks(graph: OpGraph) -> list[Block]:
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
            elif node.kind in _MIDDLE:
                if name not in middle:
                    middle.add(name)
                    stack.extend(_walked(graph, node))
            else:
                ok = False
        if not ok or not columns or not any(graph[m].kind in _ACTIVATION for m in middle):
            continue
        inside = middle | {l2.name}
        if all(set(graph.users(x)) <= inside for x in middle | columns):
            order = tuple(n.name for n in graph if n.name in middle)
            out.append((tuple(n.name for n in graph if n.name in columns), order, l2.name))
    return out


def _config(node: OpNode, d: int, dim: int | None, t: int, m: int = 1) -> ParallelConfig | None:
    """``node`` cut d ways on its sample dim (per micro-batch of ``m``) and t ways on ``dim``,
    partition (i, j) on device i·t + j; None where a degree does not divide or the rule
    refuses."""
    s = node.sample_dim
    ok = get_rule(node.kind).splittable(node)
    degrees = [1] * len(node.dims)
    for i, k in ((s, d), (dim, t)):
        if k == 1:
            continue
        size = node.shape[i] // m if i is not None and i == s else node.shape[i] if i is not None else 0
        if i is None or not ok[i] or size % k or (i == s and node.shape[i] % m):
            return None
        degrees[i] = k
    if check_degrees(node, degrees, m) is not None:
        return None
    if s is not None and dim is not None and dim < s and d > 1 and t > 1:
        return None  # the device formula below assumes the sample dim comes first
    parts = math.prod(degrees)
    if t > 1 and dim is not None:
        return ParallelConfig(tuple(degrees), tuple(range(parts)))
    return ParallelConfig(tuple(degrees), tuple(range(0, parts * t, t)))


def _reads_locally(graph: OpGraph, node: OpNode, cfg: ParallelConfig, configs: dict[str, ParallelConfig]) -> bool:
    """Every partition of ``node`` under ``cfg`` reads each activation input in ``configs``
    only from the producer partitions on its own device: those whose boxes overlap the region
    it reads, found per dim on the producer's grid (``pieces.overlapping``, as the lowering finds
    them) rather than by intersecting every pair of partitions."""
    rule = get_rule(node.kind)
    grid = grid_of(node, cfg.degrees)
    for k, dev in enumerate(cfg.devices):
        for src, region in zip(node.inputs, rule.input_regions(node, box_at(grid, cfg.degrees, k))):
            pc = configs.get(src)
            if region is None or pc is None:
                continue
            p = graph[src]
            if p.kind == "loss":  # its scalar output is whole on every partition
                if any(d != dev for d in pc.devices):
                    return False
                continue
            whole = tuple((0, p.shape[i]) for i in p.reduction_dims)  # every holder of a Partial sum
            if any(pc.devices[q] != dev for q, _, _ in overlapping(grid_of(p, pc.degrees), pc.degrees, region + whole)):
                return False
    return True


def _shift(cfg: ParallelConfig, first: int) -> ParallelConfig:
    return cfg if first == 0 else ParallelConfig(cfg.degrees, tuple(x + first for x in cfg.devices), cfg.zero,
                                                 cfg.recompute)


def block_layout(graph: OpGraph, block: Block, d: int, t: int, m: int = 1,
                 first: int = 0) -> dict[str, ParallelConfig] | None:
    """The configs of one block's ops with t-way tensor parallelism (t = 1: the block data
    parallel) and d-way data parallelism on devices [first, first + d·t); None where an op
    cannot be cut so (a degree does not divide, or no middle-op cut reads locally)."""
    columns, middle, row = block
    out: dict[str, ParallelConfig | None] = {c: _config(graph[c], d, len(graph[c].output.shape) - 1, t, m)
                                             for c in columns}
    out[row] = _config(graph[row], d, graph[row].reduction_dims[0], t, m)
    for name in middle:
        node = graph[name]
        out[name] = next((cfg for i in range(len(node.dims)) if i != node.sample_dim
                          for cfg in [_config(node, d, i, t, m)]
                          if cfg is not None and _reads_locally(graph, node, cfg, out)), None)
        if out[name] is None:
            return None
    if any(cfg is None for cfg in out.values()):
        return None
    return {k: _shift(v, first) for k, v in out.items()}


def _block_key(graph: OpGraph, block: Block) -> Hashable:
    """What ``block_layout`` reads of ``block``: its ops' counts, each op's ``repeats.signature``
    and dims' names, and which of its ops each input is (None: outside the block, which
    ``_reads_locally`` does not check). Blocks of one key take the same configs, op for op."""
    columns, middle, row = block
    ops = (*columns, *middle, row)
    at = {op: i for i, op in enumerate(ops)}
    return (len(columns), len(middle), tuple((signature(graph[op]), tuple(dim.name for dim in graph[op].dims),
                                              tuple(at.get(src) for src in graph[op].inputs)) for op in ops))


def vocab_head(graph: OpGraph, d: int, t: int, m: int = 1) -> dict[str, ParallelConfig]:
    """Megatron's vocab-parallel head: the linear producing each cross-entropy's logits
    (through reshapes and casts with no other reader) column-parallel on the vocabulary, the reshapes cut
    alike, and the loss cut t ways on its dim named ``classes`` where its rule has one and
    takes the cut (module docstring)."""
    out: dict[str, ParallelConfig] = {}
    for loss in (n for n in graph if n.kind == "loss" and n.attrs.get("fn") == "cross_entropy"):
        chain, x = [], graph[loss.inputs[0]]
        while (x.kind in ("reshape", "flatten", "elementwise") and len(graph.users(x.name)) == 1
               and len(_walked(graph, x)) == 1):
            chain.append(x)
            x = graph[x.inputs[0]]
        if x.kind != "linear" or len(graph.users(x.name)) != 1:
            continue
        head = {x.name: _config(x, d, len(x.output.shape) - 1, t, m)}
        for r in reversed(chain):
            cfg = _config(r, d, len(r.output.shape) - 1, t, m)
            head[r.name] = cfg if cfg is not None and _reads_locally(graph, r, cfg, head) else None
        if any(c is None for c in head.values()):
            continue
        out.update(head)
        classes = next((i for i, dim in enumerate(loss.dims) if dim.name == "classes"), None)
        cfg = _config(loss, d, classes, t, m) if classes is not None and t > 1 else None
        if cfg is not None:
            out[loss.name] = cfg
    return out


def _other(graph: OpGraph, node: OpNode, d: int, t: int, m: int, sequence_parallel: bool) -> ParallelConfig:
    """An op outside the blocks and the head (module docstring): an embedding's vocabulary
    rows; the sequence (``sequence_parallel``) or the sample dim d·t ways; else sample d ways
    on devices 0, t, 2t, ..., else whole on device 0. An op read only through flattening
    reshapes (the targets [batch, seq] of a flattened loss) is cut as ``flattened_cut`` cuts it
    over d·t devices: device i·t + j then holds the j-th of t contiguous blocks of replica i's
    flattened rows, the block the flatten cut d·t ways reads there, so no piece crosses members
    (``member_symmetry``)."""
    if not (sequence_parallel and len(node.output.shape) >= 3) and flattened(graph, node.name):
        cfg = flattened_cut(node, tuple(range(d * t)), m)
        if cfg is not None:
            return cfg
    cuts: list[tuple[int, int | None, int]] = []  # (sample degree, dim, its degree)
    if node.kind == "embedding":
        cuts += [(d, i, t) for i in node.reduction_dims]
    attributes = [(d, i, t) for i, dim in enumerate(node.dims) if dim.role == "attribute"]
    whole = (d * t, None, 1)
    # a [batch, seq, ...] activation: its sequence (or its samples); a flat [batch·seq, classes]
    # one: its rows
    cuts += attributes + [whole] if sequence_parallel and len(node.output.shape) >= 3 else [whole] + attributes
    for sample, i, k in cuts:
        cfg = _config(node, sample, i, k, m)
        if cfg is not None:
            return cfg
    return _config(node, d, None, t, m) or ParallelConfig((1,) * len(node.dims), (0,))


def flattened(graph: OpGraph, name: str) -> bool:
    """Whether op ``name`` is read, and only, by reshapes that merge its sample dim with the
    dims after it (fewer dims out, a sample dim kept): the targets a flattened loss reads."""
    users = graph.users(name)
    out = len(graph[name].output.shape)
    return bool(users) and all(graph[u].kind in ("reshape", "flatten") and graph[u].sample_dim is not None
                               and len(graph[u].output.shape) < out for u in users)


def flattened_cut(node: OpNode, devices: tuple[int, ...], m: int, config: ParallelConfig | None = None
                  ) -> ParallelConfig | None:
    """``node`` [batch, seq, ...] (read through flattening reshapes) cut over the R = len(``devices``)
    devices in order so that partition k holds the k-th of R contiguous blocks of a micro-batch's
    flattened rows (of m micro-batches), as a flatten cut R ways on its rows on those devices reads
    them: R ways on its samples where R divides a micro-batch's b samples; else, where b divides R,
    one sample a partition × R/b of its first attribute dim (the sequence); None where neither cut
    holds (``config``: its sharding level and recompute flag kept)."""
    s, r = node.sample_dim, len(devices)
    if s is None or node.shape[s] % m:
        return None
    b = node.shape[s] // m
    first = next((i for i, dim in enumerate(node.dims) if dim.role == "attribute" and i > s), None)
    if b % r == 0:
        cut = _config(node, r, None, 1, m)
    elif r % b == 0 and first is not None:
        cut = _config(node, b, first, r // b, m)
    else:
        return None
    if cut is None:
        return None
    return ParallelConfig(cut.degrees, devices, *((config.zero, config.recompute) if config else ()))


def flattened_relaid(graph: OpGraph, plan: Strategy) -> Strategy:
    """``plan`` with every op read only through flattening reshapes (``flattened``), each of which
    cuts its rows alone len(devices) ways on the op's devices in their order, re-cut by
    ``flattened_cut`` at the plan's micro-batch count (its sharding level and recompute flag
    kept): after a change of micro-batch count, a cut laid out for the other count (the
    targets on the sequence at one sample a replica's micro-batch) would make the flatten read
    across devices. ``plan`` itself where nothing changes."""
    changed: dict[str, ParallelConfig] = {}
    for node in graph:
        if node.sample_dim is None or not flattened(graph, node.name):
            continue
        cfg = plan[node.name]
        r = len(cfg.devices)
        if r == 1 or any(plan[u].devices != cfg.devices or plan[u].degrees[graph[u].sample_dim] != r
                         for u in graph.users(node.name)):
            continue
        new = flattened_cut(node, cfg.devices, plan.microbatches, cfg)
        if new is not None and new != cfg:
            changed[node.name] = new
    return plan.with_configs({op: changed.get(op, cfg) for op, cfg in plan.items()}) if changed else plan


def _whole_number(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(None, field, value, "must be a whole number >= 1")
    return value


def _check(graph: OpGraph, n: int, t: int, p: int, m: int, blocks: list[Block]) -> int:
    """d, the data-parallel degree, once every count is valid (one line with the arithmetic
    where one is not)."""
    if n % (t * p):
        raise PlanError(None, "tp x pp", t * p, f"tp {t} x pp {p} = {t * p} does not divide num_devices {n}")
    d = n // (t * p)
    for op, h in _heads(graph):
        if h % t:
            raise PlanError(op, "tp", t, f"the attention's {h} heads are not divisible by tp {t} "
                            f"({h} % {t} = {h % t})")
    batch = graph.batch_size
    if batch is None:
        raise PlanError(None, "batch_size", None, "the model has no op with a sample dim to split")
    if batch % m:
        raise PlanError(None, "microbatches", m, f"batch {batch} is not divisible by {m} micro-batches "
                        f"({batch} % {m} = {batch % m})")
    if (batch // m) % d:
        raise PlanError(None, "tp", t, f"batch {batch} / {m} micro-batch(es) = {batch // m} is not divisible by "
                        f"num_devices {n} / (tp {t} x pp {p}) = {d} data-parallel groups")
    if t > 1 and not blocks:
        raise PlanError(None, "model", graph.name, "no linear → attention → linear or linear → activation "
                        "→ linear block to cut tensor-parallel")
    if p > max(len(blocks), 1):
        raise PlanError(None, "pp", p, f"more pipeline stages than the model's {len(blocks)} transformer "
                        f"blocks; give pp <= {max(len(blocks), 1)}")
    check_microbatches(graph, m)
    return d


def megatron(graph: OpGraph, num_devices: int, tp: int | None = None, pp: int = 1, microbatches: int = 1,
             sequence_parallel: bool = False, virtual_stages: int = 1) -> Strategy:
    """The Megatron-LM plan (module docstring): ``tp``-way tensor parallelism (default
    ``default_tp`` of a stage's devices), ``pp`` pipeline stages, data parallelism over the
    other num_devices / (tp·pp) devices of each stage, ``microbatches`` micro-batches, the ops
    between the blocks cut on the sequence (``sequence_parallel``) or on the samples. With
    ``virtual_stages`` v > 1 the model is cut into pp·v stages and stage s runs on pipeline
    rank s mod pp under the interleaved schedule (Narayanan et al. SC'21, section 2.2.2)."""
    n, p, m = _whole_number("num_devices", num_devices), _whole_number("pp", pp), _whole_number("microbatches",
                                                                                                   microbatches)
    v = _whole_number("virtual_stages", virtual_stages)
    if n % p:
        raise PlanError(None, "pp", p, f"{p} pipeline stages do not divide num_devices {n} ({n} % {p} = {n % p})")
    if v > 1 and (p < 2 or m % p):
        raise PlanError(None, "virtual_stages", v, f"the interleaved schedule needs pp >= 2 and micro-batches a "
                        f"multiple of pp (pp {p}, microbatches {m})")
    t = default_tp(graph, n // p) if tp is None else tp
    if isinstance(t, bool) or not isinstance(t, int) or t < 1 or num_devices % t:
        raise PlanError(None, "tp", t, f"tensor-parallel degree must be a whole number dividing "
                        f"num_devices ({num_devices})")
    blocks = megatron_blocks(graph)
    d = _check(graph, n, t, p, m, blocks)
    if p * v > max(len(blocks), 1):
        raise PlanError(None, "virtual_stages", v, f"pp {p} x virtual_stages {v} = {p * v} stages but the model "
                        f"has {len(blocks)} transformer blocks")
    stage = megatron_stages(graph, blocks, p * v)
    size = n // p
    planned: dict[str, ParallelConfig] = {}
    layouts: dict[Hashable, list[ParallelConfig] | None] = {}  # by _block_key: a repeated layer laid out once
    for block in blocks:
        ops = (*block[0], *block[1], block[2])
        key = _block_key(graph, block)
        if key not in layouts:
            layout = block_layout(graph, block, d, t, m)
            layouts[key] = None if layout is None else [layout[op] for op in ops]
        if layouts[key] is not None:
            planned.update(zip(ops, layouts[key]))
    planned.update(vocab_head(graph, d, t, m))
    configs = {node.name: _shift(planned.get(node.name) or _other(graph, node, d, t, m, sequence_parallel),
                                 stage[node.name] % p * size) for node in graph}
    schedule = "interleaved" if v > 1 else "1f1b" if m > 1 else "gpipe"
    return Strategy.of(configs, n, m, schedule)
