"""A Megatron-shaped plan as torch's own tensor-parallel API: a ``parallelize_module`` plan,
module FQN → ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` /
``PrepareModuleInput``, in the shape of torchtitan's ``parallelize_llama``.

The plan's devices form a (dp, tp) mesh: device i·t + j is data-parallel group i, tensor-parallel
rank j (``init_device_mesh(type, (d, t), mesh_dim_names=("dp", "tp"))`` numbers ranks so). Each op's
config says what a tensor-parallel rank holds of its output, in DTensor's words
(``Placement``): ``Replicate`` (not cut over tp; its samples cut d ways, or d·t ways: the
megatron plan without sequence parallelism, whose ops between the blocks torch runs replicated
on the t ranks), ``Shard(dim)`` (one output dim cut t ways) or ``Partial`` (a reduction dim cut
t ways). From those, per module:

- linear, out_features Shard(-1): ``ColwiseParallel``; its input ``Shard(1)`` where the producer
  is sequence-parallel; its output kept sharded for a block's middle ops (a DTensor where the
  middle reshapes it, so the model's views with global sizes run), else gathered (``Replicate``);
- the linear producing a cross-entropy's logits (lm_head), out_features (the vocabulary)
  Shard(-1): ``ColwiseParallel(use_local_output=False)`` where the loss is cut on its
  ``classes`` dim: the logits stay a DTensor ``Shard(-1)`` through the reshapes and the
  cross-entropy runs under ``torch.distributed.tensor.parallel.loss_parallel()`` (max and
  sum-exp all-reduced over the tp ranks, the logits never gathered, each rank's gradient its
  own classes': Megatron's vocab-parallel cross-entropy), which the generated file's
  ``loss_context()`` enters; else ``ColwiseParallel(output_layouts=Replicate())``;
- linear, in_features Partial: ``RowwiseParallel``, output ``Shard(1)`` (reduce-scatter) into
  sequence-parallel consumers, else ``Replicate`` (all-reduce);
- embedding, vocabulary rows Partial: ``RowwiseParallel(input_layouts=Replicate())`` (vocab
  parallel), output as a row-parallel linear's;
- norm or dropout module on Shard(1) (sequence parallelism): ``SequenceParallel``;
- linear on Shard(1) with its weight whole and consumers that need the whole sequence (an
  lm_head before a loss over flat rows): ``PrepareModuleInput`` all-gathers the sequence first, so
  DTensor runs it whole on each tp rank where the plan cut it by sequence;
- a parameter read outside any module by a sequence-parallel op (GPT's learned positions): a
  ``Replicate`` DTensor, and the embedding before it keeps a DTensor output so the sum shards.

Anything else cut over tp has no ParallelStyle: ``dtensor_plan`` refuses it in one line naming the
op, its config and why; so are plans of several micro-batches or pipeline stages
(``torch.distributed.pipelining`` is a separate API).
"""

from __future__ import annotations

from typing import Mapping

from soapsearch._dtensor_styles import SOURCE_KINDS, DTensorPlan, Style, Styles
from strategies.config import ParallelConfig
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.region import partition_index
from strategies.strategy import Strategy

__all__ = ["Style", "DTensorPlan", "dtensor_plan", "module_names"]


def module_names(model) -> dict[str, str]:
    """fx node name → module FQN for every submodule (fx names a ``call_module`` node by its
    target with dots as underscores)."""
    return {fqn.replace(".", "_"): fqn for fqn, _ in model.named_modules() if fqn}


def _one_cut(node: OpNode, cfg: ParallelConfig) -> list[int]:
    """The non-sample dims ``cfg`` cuts; PlanError when there are several."""
    cut = [i for i, g in enumerate(cfg.degrees) if g > 1 and i != node.sample_dim]
    if len(cut) > 1:
        names = " and ".join(f"{node.dims[i].name!r}" for i in cut)
        raise PlanError(node.name, "config", cfg.show(node.dims), f"cut on both {names}: a ParallelStyle "
                        f"cuts one dim of an op over the tp mesh (ColwiseParallel out_features, "
                        f"RowwiseParallel in_features, SequenceParallel the sequence)")
    return cut


def _split(node: OpNode, cfg: ParallelConfig, t: int, d: int) -> tuple[int, int | None]:
    """(sample degree, the one non-sample dim cut t ways or None); PlanError for any other cut."""
    s = node.sample_dim
    cut = _one_cut(node, cfg)
    sample = cfg.degrees[s] if s is not None else 1
    show = cfg.show(node.dims)
    if cut and cfg.degrees[cut[0]] != t:
        raise PlanError(node.name, "config", show, f"dim {node.dims[cut[0]].name!r} cut "
                        f"{cfg.degrees[cut[0]]} ways where the plan's tensor-parallel degree is {t}")
    if cut and sample != d:
        raise PlanError(node.name, "config", show, f"sample degree {sample} with a tp cut: the mesh is "
                        f"(dp, tp) = ({d}, {t}), so a tp-cut op is cut {d} ways on its sample dim")
    if not cut and node.kind not in SOURCE_KINDS and sample not in (d, d * t):
        raise PlanError(node.name, "config", show, f"sample degree {sample}: the mesh (dp, tp) = "
                        f"({d}, {t}) cuts an op's samples {d} ways (or its rows {d}·{t} = {d * t})")
    return sample, (cut[0] if cut else None)


def _check_devices(node: OpNode, cfg: ParallelConfig, t: int, d: int, dim: int | None) -> None:
    """Partition (sample i, tp j) on device i·t + j; an op not cut over tp on a device of group i,
    or, with its rows cut d·t ways, row block i on device i."""
    s = node.sample_dim
    sample = cfg.degrees[s] if s is not None else 1
    for k, dev in enumerate(cfg.devices):
        c = partition_index(k, cfg.degrees)
        i = c[s] if s is not None else 0
        if dim is not None:
            want = str(i * t + c[dim])
        elif sample == d * t:
            want = str(i)
        elif node.kind in SOURCE_KINDS:
            continue
        else:
            want = f"{i * t}-{i * t + t - 1}"
            if dev // t == i:
                continue
        if want != str(dev):
            raise PlanError(node.name, "devices", list(cfg.devices), f"partition {k} (sample {i}) on device "
                            f"{dev}, not {want}: a (dp, tp) mesh puts tp rank j of data-parallel group i on "
                            f"device i·t + j, t = {t} consecutive devices per group")


def _check_one_stage(graph: OpGraph, strategy: Strategy) -> None:
    """PlanError where a tp-cut op runs on part of the devices: the plan has pipeline stages."""
    n = strategy.num_devices
    for node in graph:
        cfg = strategy[node.name]
        if _one_cut(node, cfg) and set(cfg.devices) != set(range(n)):
            raise PlanError(node.name, "devices", f"{min(cfg.devices)}-{max(cfg.devices)}", f"runs on "
                            f"{len(set(cfg.devices))} of the plan's {n} devices: pipeline stages (pp > 1) have "
                            "no parallelize_module form (torch.distributed.pipelining is separate); export a "
                            "plan of one stage")


def _tp_degree(graph: OpGraph, strategy: Strategy) -> int:
    cuts = {}
    for n in graph:
        cfg = strategy[n.name]
        cut = _one_cut(n, cfg)
        if cut:
            cuts.setdefault(cfg.degrees[cut[0]], n.name)
    if not cuts:
        raise PlanError(None, "plan", "no tensor-parallel cut", "no op is cut on a dim other than its "
                        "samples: nothing for parallelize_module to do (this is data parallelism: DDP/FSDP)")
    return max(cuts)


def dtensor_plan(graph: OpGraph, strategy: Strategy, modules: Mapping[str, str]) -> DTensorPlan:
    """The ParallelStyles of a Megatron-shaped plan (module docstring); ``modules`` maps op
    names to module FQNs (``module_names``). PlanError naming the op for any other plan."""
    if strategy.microbatches != 1:
        raise PlanError(None, "microbatches", strategy.microbatches, "parallelize_module has no "
                        "micro-batches or pipeline stages (torch.distributed.pipelining is separate); "
                        "export a plan of 1 micro-batch")
    if strategy.precision != "model":
        raise PlanError(None, "precision", strategy.precision, "the export writes tensor-parallel styles only; "
                        "wrap the training step in torch.autocast (or FSDP2's MixedPrecisionPolicy) yourself, "
                        "or export the plan made with --dtype fp32")
    for name, cfg in strategy.items():
        if cfg.zero or cfg.recompute:
            field, value = ("zero", cfg.zero) if cfg.zero else ("recompute", True)
            raise PlanError(name, field, value, "the export writes tensor-parallel styles only (no fully_shard "
                            "or checkpoint wrapping); export a plan without sharded state or recompute")
    t = _tp_degree(graph, strategy)
    _check_one_stage(graph, strategy)
    n = strategy.num_devices
    if n % t:
        raise PlanError(None, "num_devices", n, f"not a multiple of the tensor-parallel degree {t}")
    d = n // t
    layout: dict[str, tuple[str, int | None]] = {}  # op -> ("R"|"S"|"P", dim)
    for node in graph:
        cfg = strategy[node.name]
        _, dim = _split(node, cfg, t, d)
        _check_devices(node, cfg, t, d, dim)
        if dim is None:
            layout[node.name] = ("R", None)
        elif node.dims[dim].role == "reduction":
            layout[node.name] = ("P", dim)
        else:
            layout[node.name] = ("S", dim)
    return Styles(graph, strategy, layout, modules, t, d).plan()
