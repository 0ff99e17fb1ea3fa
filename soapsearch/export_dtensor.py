"""A Megatron-shaped plan as torch's own tensor-parallel API: a ``parallelize_module`` plan,
module FQN → ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` /
``PrepareModuleInput``, in the shape of torchtitan's ``parallelize_llama``.

The plan's devices form a (dp, tp) mesh: device i·t + j is data-parallel group i, tensor-parallel
rank j (``init_device_mesh(type, (d, t), mesh_dim_names=("dp", "tp"))`` numbers ranks so). Each op's
config says what a tensor-parallel rank holds of its output, in DTensor's words
(``Placement``): ``Replicate`` (not cut over tp; rows may be cut over dp), ``Shard(dim)`` (one
output dim cut t ways) or ``Partial`` (a reduction dim cut t ways). From those, per module:

- linear, out_features Shard(-1): ``ColwiseParallel``; its input ``Shard(1)`` where the producer
  is sequence-parallel; its output kept sharded for a block's middle ops (a DTensor where the
  middle reshapes it, so the model's views with global sizes run), else gathered (``Replicate``);
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
op, its config and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from strategies.config import ParallelConfig
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.megatron import megatron_blocks
from strategies.region import partition_index
from strategies.strategy import Strategy

__all__ = ["Style", "DTensorPlan", "dtensor_plan", "module_names"]

_SOURCE_KINDS = ("input", "parameter", "constant")
_NORMS = ("layernorm", "rmsnorm")
_SEQ = 1
"""Sequence parallelism cuts dim 1 of a [batch, sequence, ...] activation (``Shard(1)``)."""


@dataclass(frozen=True)
class Style:
    """One module's ParallelStyle: its FQN, the style's class name and keyword arguments as
    Python source, and the op it comes from."""

    fqn: str
    name: str
    kwargs: tuple[tuple[str, str], ...]
    op: str

    def source(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.kwargs)})"


@dataclass(frozen=True)
class DTensorPlan:
    """A plan in torch's tensor-parallel API: ``tp`` × ``dp`` devices, one Style per module, the
    parameters read outside modules that become Replicate DTensors."""

    model: str
    tp: int
    dp: int
    styles: tuple[Style, ...]
    replicated_parameters: tuple[str, ...]
    sharded_attention: bool
    """Whether an attention op runs on DTensors cut by heads (the generated file then gives
    DTensor the CPU attention kernel's rule, which it has for the CUDA kernels)."""

    @property
    def mapping(self) -> dict[str, str]:
        """FQN → the style's source, as the generated ``TP_PLAN`` reads."""
        return {s.fqn: s.source() for s in self.styles}


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
    if not cut and node.kind not in _SOURCE_KINDS and sample not in (d, d * t):
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
        elif node.kind in _SOURCE_KINDS:
            continue
        else:
            want = f"{i * t}-{i * t + t - 1}"
            if dev // t == i:
                continue
        if want != str(dev):
            raise PlanError(node.name, "devices", list(cfg.devices), f"partition {k} (sample {i}) on device "
                            f"{dev}, not {want}: a (dp, tp) mesh puts tp rank j of data-parallel group i on "
                            f"device i·t + j, t = {t} consecutive devices per group")


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
    t = _tp_degree(graph, strategy)
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
    return _Styles(graph, layout, modules, t, d).plan(strategy)


def _gather(fqn: str, op: str) -> Style:
    """The module runs whole on every tp rank after an all-gather of its sequence-parallel input."""
    return Style(fqn, "PrepareModuleInput", (("input_layouts", "(Shard(1),)"),
                                             ("desired_input_layouts", "(Replicate(),)"),
                                             ("use_local_output", "True")), op)


class _Styles:
    """The walk from per-op layouts to per-module styles."""

    def __init__(self, graph: OpGraph, layout, modules: Mapping[str, str], t: int, d: int):
        self.g, self.layout, self.modules, self.t, self.d = graph, layout, modules, t, d
        self.middle: set[str] = set()
        self.reshaping: set[str] = set()  # column linears whose block middle reshapes
        for columns, middle, _ in megatron_blocks(graph):
            self.middle.update(middle)
            if any(graph[m].kind in ("reshape", "flatten", "attention") for m in middle):
                self.reshaping.update(columns)
        for m in self.middle:  # a block's middle follows its column linears' shards: never the sequence
            if layout[m][0] == "S":
                layout[m] = ("M", layout[m][1])

    def _acts(self, node: OpNode) -> list[str]:
        return [s for s in node.inputs if self.g[s].kind not in _SOURCE_KINDS]

    def _seq(self, name: str) -> bool:
        return self.layout[name] == ("S", _SEQ)

    def _fqn(self, node: OpNode, style: str) -> str:
        fqn = self.modules.get(node.name)
        if fqn is None and node.weights:
            w = node.weights[0].name
            fqn = w.rsplit(".", 1)[0] if "." in w else None
        if fqn is None:
            raise PlanError(node.name, "module", None, f"{style} applies to a module and no module of "
                            "the model computes this op (a functional call)")
        return fqn

    def _input_kw(self, node: OpNode) -> tuple[tuple[str, str], ...]:
        acts = self._acts(node)
        if acts and all(self._seq(a) for a in acts):
            return (("input_layouts", "Shard(1)"),)
        if any(self._seq(a) for a in acts):
            raise PlanError(node.name, "inputs", acts, "some inputs sequence-parallel, some not")
        return ()

    def _users_seq(self, node: OpNode) -> bool:
        users = self.g.users(node.name)
        seq = [self._seq(u) for u in users]
        if any(seq) and not all(seq):
            raise PlanError(node.name, "users", list(users), "some consumers sequence-parallel, some not: "
                            "one output_layouts serves them all")
        return bool(users) and all(seq)

    def plan(self, strategy: Strategy) -> DTensorPlan:
        styles: list[Style] = []
        params: list[str] = []
        dtensor_out: set[str] = set()  # embeddings whose output a Replicate parameter joins
        for node in self.g:
            kind, dim = self.layout[node.name]
            cfg = strategy[node.name].show(node.dims)
            if kind == "R":
                if node.kind == "linear" and any(self._seq(a) for a in self._acts(node)):
                    styles.append(_gather(self._fqn(node, "PrepareModuleInput"), node.name))
                elif node.kind not in _SOURCE_KINDS and any(self._seq(a) for a in self._acts(node)):
                    raise PlanError(node.name, "config", cfg, "reads a sequence-parallel input whole on "
                                    "every tp rank: only a linear module (PrepareModuleInput) gathers it")
                elif node.kind == "parameter" and node.weights and any(self._seq(u) for u in self.g.users(node.name)):
                    params.append(node.weights[0].name)
                continue
            if kind == "M":
                continue
            if node.kind == "linear":
                styles.append(self._linear(node, kind, dim, cfg))
            elif node.kind == "embedding" and kind == "P":
                out = (("output_layouts", "Shard(1)"),) if self._users_seq(node) else ()
                styles.append(Style(self._fqn(node, "RowwiseParallel"), "RowwiseParallel",
                                    (("input_layouts", "Replicate()"),) + out, node.name))
            elif node.kind in _NORMS + ("dropout",) and (kind, dim) == ("S", _SEQ) and (
                    node.kind != "dropout" or node.name in self.modules):
                styles.append(Style(self._fqn(node, "SequenceParallel"), "SequenceParallel", (), node.name))
            elif node.weights or kind == "P" or (kind, dim) != ("S", _SEQ):
                what = f"{node.kind} cut on {node.dims[dim].name!r}"
                raise PlanError(node.name, "config", cfg, f"{what}: no ParallelStyle expresses it "
                                "(ColwiseParallel/RowwiseParallel cut linear and embedding modules, "
                                "SequenceParallel cuts a norm's or dropout's sequence; a Megatron block's "
                                "middle ops follow its column linears)")
            if self.layout[node.name] == ("S", _SEQ):
                self._check_seq_inputs(node, dtensor_out)
        styles = [self._dtensor_output(s) if s.op in dtensor_out else s for s in styles]
        attn = any(n.kind == "attention" and self.layout[n.name][0] in ("S", "M") for n in self.g)
        return DTensorPlan(self.g.name, self.t, self.d, tuple(styles), tuple(params), attn)

    def _linear(self, node: OpNode, kind: str, dim: int, cfg: str) -> Style:
        fqn = self._fqn(node, "a ParallelStyle")
        if kind == "P":
            out = (("output_layouts", "Shard(1)"),) if self._users_seq(node) else ()
            acts = self._acts(node)
            if acts and any(self.layout[a] == ("R", None) for a in acts):
                return Style(fqn, "RowwiseParallel", (("input_layouts", "Replicate()"),) + out, node.name)
            return Style(fqn, "RowwiseParallel", out, node.name)
        if dim == len(node.output.shape) - 1:
            kw = self._input_kw(node)
            users = self.g.users(node.name)
            if users and all(u in self.middle for u in users):
                if node.name in self.reshaping:
                    kw += (("use_local_output", "False"),)
            else:
                kw += (("output_layouts", "Replicate()"),)
            return Style(fqn, "ColwiseParallel", kw, node.name)
        if dim == _SEQ and all(self._seq(u) for u in self.g.users(node.name)):
            return Style(fqn, "SequenceParallel", (), node.name)
        if dim == _SEQ:  # its weight whole, its consumers need the whole sequence (an lm_head)
            self.layout[node.name] = ("R", None)
            return _gather(fqn, node.name)
        raise PlanError(node.name, "config", cfg, f"linear cut on {node.dims[dim].name!r}: ColwiseParallel "
                        "cuts out_features, RowwiseParallel in_features, SequenceParallel the sequence of "
                        "a linear whose consumers are sequence-parallel too")

    def _check_seq_inputs(self, node: OpNode, dtensor_out: set[str]) -> None:
        """A sequence-parallel op reads sequence shards: from a sequence-parallel op, a row-parallel
        linear or vocab-parallel embedding reduce-scattering into it, or a Replicate parameter
        (then the embedding's output stays a DTensor and the op's consumers are modules that
        take it back to a local shard)."""
        acts = self._acts(node)
        params = [s for s in node.inputs if self.g[s].kind == "parameter"]
        for a in acts:
            if not self._seq(a) and self.layout[a][0] != "P":
                raise PlanError(node.name, "inputs", a, f"sequence-parallel op reading {a!r} whole on every "
                                "tp rank: SequenceParallel reads a shard of the sequence")
        if params:
            bad = [u for u in self.g.users(node.name) if self.g[u].kind not in _NORMS + ("dropout",)
                   or u not in self.modules]
            embeddings = [a for a in acts if self.g[a].kind == "embedding" and self.layout[a][0] == "P"]
            if bad or not embeddings:
                raise PlanError(node.name, "inputs", params, "a parameter read outside any module joins a "
                                "sequence-parallel op only after a vocab-parallel embedding and before a norm "
                                "or dropout module (DTensor carries the sum between them)")
            dtensor_out.update(embeddings)

    @staticmethod
    def _dtensor_output(style: Style) -> Style:
        return Style(style.fqn, style.name, style.kwargs + (("use_local_output", "False"),), style.op)
