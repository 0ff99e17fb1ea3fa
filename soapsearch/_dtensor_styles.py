"""From per-op placements to per-module ParallelStyles: the walk behind
``soapsearch.export_dtensor.dtensor_plan`` (its docstring says what maps to what), and the
``Style`` / ``DTensorPlan`` records it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.megatron import megatron_blocks
from strategies.strategy import Strategy

__all__ = ["SOURCE_KINDS", "Style", "DTensorPlan", "Styles", "head_chains"]

SOURCE_KINDS = ("input", "parameter", "constant")
_NORMS = ("layernorm", "rms_norm")
_SEQ = 1
"""Sequence parallelism cuts dim 1 of a [batch, sequence, ...] activation (``Shard(1)``)."""
_HEAD_CHAIN = ("reshape", "flatten", "elementwise")
"""Ops between an lm_head and its cross-entropy that follow the logits' vocabulary shards."""


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
    loss_parallel: bool = False
    """Whether the cross-entropy is cut on its classes: the user computes the loss and its
    backward under ``torch.distributed.tensor.parallel.loss_parallel()``."""

    @property
    def mapping(self) -> dict[str, str]:
        """FQN → the style's source, as the generated ``TP_PLAN`` reads."""
        return {s.fqn: s.source() for s in self.styles}


def head_chains(graph: OpGraph) -> list[tuple[str, tuple[str, ...], str]]:
    """(linear, ops between, loss) for each cross-entropy whose logits a linear produces through
    reshapes and casts with no other reader (an lm_head), as ``strategies.megatron.vocab_head``
    walks them."""
    out = []
    for loss in (n for n in graph if n.kind == "loss" and n.attrs.get("fn") == "cross_entropy"):
        chain, x = [], graph[loss.inputs[0]]
        while x.kind in _HEAD_CHAIN and len(graph.users(x.name)) == 1 and x.inputs:
            chain.append(x.name)
            x = graph[x.inputs[0]]
        if x.kind == "linear" and len(graph.users(x.name)) == 1:
            out.append((x.name, tuple(reversed(chain)), loss.name))
    return out


def _gather(fqn: str, op: str) -> Style:
    """The module runs whole on every tp rank after an all-gather of its sequence-parallel input."""
    return Style(fqn, "PrepareModuleInput", (("input_layouts", "(Shard(1),)"),
                                             ("desired_input_layouts", "(Replicate(),)"),
                                             ("use_local_output", "True")), op)


class Styles:
    """The walk from per-op layouts to per-module styles."""

    def __init__(self, graph: OpGraph, strategy: Strategy, layout, modules: Mapping[str, str], t: int, d: int):
        self.g, self.strategy, self.layout, self.modules, self.t, self.d = graph, strategy, layout, modules, t, d
        self.middle: set[str] = set()
        self.reshaping: set[str] = set()  # column linears whose block middle reshapes
        for columns, middle, _ in megatron_blocks(graph):
            self.middle.update(middle)
            if any(graph[m].kind in ("reshape", "flatten", "attention") for m in middle):
                self.reshaping.update(columns)
        for m in self.middle:  # a block's middle follows its column linears' shards: never the sequence
            if layout[m][0] == "S":
                layout[m] = ("M", layout[m][1])
        self.vocab_heads: dict[str, str] = {}  # lm_head -> its loss, cut on the classes
        for head, chain, loss in head_chains(graph):
            if not self._last(head):
                continue
            follows = all(self._last(c) for c in chain)
            if follows:  # the reshapes of the logits follow the lm_head's vocabulary shards
                for c in chain:
                    layout[c] = ("M", layout[c][1])
            if self._class_cut(loss):
                self._check_loss_parallel(graph[loss], follows, chain[-1] if chain else head)
                self.vocab_heads[head] = loss

    def _last(self, name: str) -> bool:
        """Whether ``name`` is cut t ways on its output's last dim (an lm_head's vocabulary)."""
        return self.layout[name] == ("S", len(self.g[name].output.shape) - 1)

    def _class_cut(self, name: str) -> bool:
        kind, dim = self.layout[name]
        return kind == "P" and self.g[name].dims[dim].name == "classes"

    def _check_loss_parallel(self, loss: OpNode, follows: bool, logits: str) -> None:
        """A class-cut cross-entropy is ``loss_parallel()``'s: logits Shard(-1) on the classes, no
        label smoothing (torch's vocab-parallel cross-entropy has none)."""
        cfg = self._cfg(loss)
        if not follows:
            raise PlanError(loss.name, "config", cfg, f"cut on 'classes' where its logits {logits!r} are not "
                            "cut alike: loss_parallel() reads the logits Shard(-1) on the classes, from a "
                            "ColwiseParallel lm_head through its reshapes")
        smoothing = loss.attrs.get("label_smoothing", 0.0)
        if smoothing:
            raise PlanError(loss.name, "label_smoothing", smoothing, "a cross-entropy cut on 'classes' is "
                            "loss_parallel()'s, which supports no label smoothing")

    def _cfg(self, node: OpNode) -> str:
        return self.strategy[node.name].show(node.dims)

    def _acts(self, node: OpNode) -> list[str]:
        return [s for s in node.inputs if self.g[s].kind not in SOURCE_KINDS]

    def _seq(self, name: str) -> bool:
        """Whether ``name`` is sequence-parallel: Shard(1) of a [batch, sequence, ...] output."""
        return self.layout[name] == ("S", _SEQ) and len(self.g[name].output.shape) > 2

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

    def plan(self) -> DTensorPlan:
        styles: list[Style] = []
        params: list[str] = []
        dtensor_out: set[str] = set()  # embeddings whose output a Replicate parameter joins
        for node in self.g:
            kind, dim = self.layout[node.name]
            cfg = self._cfg(node)
            if kind == "R":
                if node.kind == "linear" and any(self._seq(a) for a in self._acts(node)):
                    styles.append(_gather(self._fqn(node, "PrepareModuleInput"), node.name))
                elif node.kind not in SOURCE_KINDS and any(self._seq(a) for a in self._acts(node)):
                    raise PlanError(node.name, "config", cfg, "reads a sequence-parallel input whole on "
                                    "every tp rank: only a linear module (PrepareModuleInput) gathers it")
                elif node.kind == "parameter" and node.weights and any(self._seq(u) for u in self.g.users(node.name)):
                    params.append(node.weights[0].name)
                continue
            if kind == "M" or node.name in self.vocab_heads.values():
                continue
            if node.kind == "loss" and self._class_cut(node.name):
                raise PlanError(node.name, "config", cfg, "cut on 'classes' where no linear produces its logits "
                                "(through reshapes only): loss_parallel() reads them Shard(-1) from a "
                                "ColwiseParallel lm_head")
            if node.kind == "linear":
                styles.append(self._linear(node, kind, dim, cfg))
            elif node.kind == "embedding" and kind == "P":
                out = (("output_layouts", "Shard(1)"),) if self._users_seq(node) else ()
                styles.append(Style(self._fqn(node, "RowwiseParallel"), "RowwiseParallel",
                                    (("input_layouts", "Replicate()"),) + out, node.name))
            elif node.kind in _NORMS + ("dropout",) and self._seq(node.name) and (
                    node.kind != "dropout" or node.name in self.modules):
                styles.append(Style(self._fqn(node, "SequenceParallel"), "SequenceParallel", (), node.name))
            elif node.weights or kind == "P" or not self._seq(node.name):
                what = f"{node.kind} cut on {node.dims[dim].name!r}"
                raise PlanError(node.name, "config", cfg, f"{what}: no ParallelStyle expresses it "
                                "(ColwiseParallel/RowwiseParallel cut linear and embedding modules, "
                                "SequenceParallel cuts a norm's or dropout's sequence; a Megatron block's "
                                "middle ops follow its column linears)")
            if self._seq(node.name):
                self._check_seq_inputs(node, dtensor_out)
        styles = [self._dtensor_output(s) if s.op in dtensor_out else s for s in styles]
        attn = any(n.kind == "attention" and self.layout[n.name][0] in ("S", "M") for n in self.g)
        return DTensorPlan(self.g.name, self.t, self.d, tuple(styles), tuple(params), attn,
                           bool(self.vocab_heads))

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
            if node.name in self.vocab_heads:  # the logits stay Shard(-1) into loss_parallel()
                kw += (("use_local_output", "False"),)
            elif users and all(u in self.middle for u in users):
                if node.name in self.reshaping:
                    kw += (("use_local_output", "False"),)
            else:
                kw += (("output_layouts", "Replicate()"),)
            return Style(fqn, "ColwiseParallel", kw, node.name)
        if self._seq(node.name) and all(self._seq(u) for u in self.g.users(node.name)):
            return Style(fqn, "SequenceParallel", (), node.name)
        if self._seq(node.name):  # its weight whole, its consumers need the whole sequence (an lm_head)
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
