"""The op-rule interface: which dims of an op may be cut, what each partition reads, and how a
partition computes its piece from only what it read.

A rule is stateless; everything it needs is on the OpNode (its ``attrs``, ``input_specs`` and
``weights``). ``forward`` is the ground truth the executor stands on: for any valid grid,
computing every partition from the regions ``input_regions`` / ``weight_regions`` name must
reproduce that partition's slice of the op's full output exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from strategies.graph import Dim, OpNode, TensorSpec
from strategies.region import Box, full_box

__all__ = ["Reduction", "OpRule", "Reduce", "no_reduce", "register", "get_rule", "rule_kinds",
           "OPAQUE"]

OPAQUE = "opaque"

Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The reduce of a partition that is alone in its reduction group."""
    return t


@dataclass(frozen=True)
class Reduction:
    """A sum the partitions of one op must share so that a split run equals one device.

    ``over`` are the dims whose partitions are summed together: the group of a partition is
    every partition with the same coordinates on all other dims (e.g. batch statistics of a
    batchnorm: over sample, height, width; a mean loss over a split batch: over every dim).
    """

    name: str
    over: tuple[int, ...]
    deferred: bool = False
    """The partitions' outputs need not wait for it: a loss's sum and count, which only the
    gradient's scale 1/count and the reported loss read (see ``strategies.lowering.gates``)."""


class OpRule:
    """Default rule: an op that may not be split at all (``strategies.rules.opaque``)."""

    kind: str = OPAQUE

    # --- dims -----------------------------------------------------------------------------
    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        """Names and roles of the op's dims, given which one is the batch (``sample``)."""
        return tuple(
            Dim("sample" if i == sample else f"d{i}", s, "sample" if i == sample else "attribute")
            for i, s in enumerate(node.shape)
        )

    def splittable(self, node: OpNode) -> tuple[bool, ...]:
        """Which dims a degree > 1 may cut."""
        return tuple(False for _ in node.dims)

    def check_degrees(self, node: OpNode, degrees: Sequence[int]) -> str | None:
        """Why ``degrees`` is not a valid grid for this op beyond divisibility, or None."""
        return None

    # --- regions --------------------------------------------------------------------------
    def input_regions(self, node: OpNode, box: Box) -> tuple[Box | None, ...]:
        """For each input, the region the partition computing ``box`` reads (None: nothing)."""
        return tuple(full_box(s.shape) for s in node.input_specs)

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        """For each weight role, the region the partition computing ``box`` reads."""
        return {w.role: full_box(w.spec.shape) for w in node.weights}

    def reductions(self, node: OpNode, degrees: Sequence[int]) -> tuple[Reduction, ...]:
        """The sums across partitions this grid needs (none for most ops)."""
        return ()

    def gemm_size(self, node: OpNode, box: Box) -> int | None:
        """The smallest dimension of the matrix products the partition computing ``box`` runs
        (where its FLOPs go; ``simulator.devices.DeviceSpec.gemm_half``), or None: no product."""
        return None

    def gemm_shape(self, node: OpNode, box: Box) -> tuple[int, int, int, int] | None:
        """(batch, M, N, K) of the forward product(s) the partition computing ``box`` runs, batch
        products [M, K] × [K, N] (``simulator.gemm_shape``), or None: no product, or one whose
        shape the rule does not give (then ``gemm_size`` alone)."""
        return None

    # --- compute --------------------------------------------------------------------------
    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        """The partition's output (shape ``box``) from the regions it read, in the same order
        as ``input_regions`` / ``weight_regions``; ``reduce`` sums a tensor over the partition's
        reduction group."""
        raise NotImplementedError(f"op {node.name!r}: kind {node.kind!r} has no rule to compute it")


class SplitAll(OpRule):
    """Base for rules whose every dim may be cut unless ``unsplittable`` says otherwise."""

    def unsplittable(self, node: OpNode) -> set[int]:
        return set()

    def splittable(self, node: OpNode) -> tuple[bool, ...]:
        fixed = self.unsplittable(node)
        return tuple(i not in fixed for i in range(len(node.dims)))


_RULES: dict[str, OpRule] = {}


def register(*kinds: str) -> Callable[[type[OpRule]], type[OpRule]]:
    """Class decorator: one instance of the rule serves every kind named."""

    def deco(cls: type[OpRule]) -> type[OpRule]:
        inst = cls()
        for k in kinds:
            if k in _RULES:
                raise ValueError(f"op kind {k!r} has two rules: {type(_RULES[k]).__name__}, {cls.__name__}")
            _RULES[k] = inst
        cls.kind = kinds[0]
        return cls

    return deco


def get_rule(kind: str) -> OpRule:
    """The rule for ``kind``; kinds with none are opaque (unsplit, on one device:
    ``strategies.rules.opaque``)."""
    rule = _RULES.get(kind)
    return rule if rule is not None else _RULES[OPAQUE]


def rule_kinds() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def broadcast_region(box: Box, in_shape: Sequence[int], out_ndim: int) -> Box:
    """The region of an input broadcast to an output of rank ``out_ndim`` that feeds ``box``:
    leading dims it lacks are dropped, dims of size 1 read [0, 1) (numpy broadcasting)."""
    lead = out_ndim - len(in_shape)
    return tuple((0, 1) if s == 1 else box[lead + i] for i, s in enumerate(in_shape))


def dim_named(i: int, sample: int | None, name: str, role: str, size: int) -> Dim:
    """A Dim that is the sample dim when ``i == sample``, else ``name``/``role``."""
    if i == sample:
        return Dim("sample", size, "sample")
    return Dim(name, size, role)


def numel_in(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))
