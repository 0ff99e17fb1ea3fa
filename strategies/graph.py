"""The OpGraph IR: what a traced model is, independent of how it is parallelized.

Vocabulary (docs/design.md, "Glossary"): an *op* is one node of the graph; its *dims* are the dims of
its iteration space: its output tensor's dims (a loss: its per-sample losses' dims), then the
dims it sums over, if any; each dim has a role: ``sample`` (the batch), ``attribute`` (a split
does not split the weights), ``parameter`` (a split splits the weights) or ``reduction`` (a dim
the op sums over: a split leaves each partition a Partial sum of its output region).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping

__all__ = ["ROLES", "TensorSpec", "Dim", "Weight", "OpNode", "OpGraph", "DTYPE_BYTES"]

ROLES = ("sample", "attribute", "parameter", "reduction")

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (dtype as torch names it, without the ``torch.``)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"TensorSpec: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Dim:
    """One dim of an op's iteration space: its name, size and SOAP role."""

    name: str
    size: int
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Dim {self.name!r}: role {self.role!r} is not one of {ROLES}")


@dataclass(frozen=True)
class Weight:
    """A parameter or buffer an op reads: its role in the op (``weight``, ``bias``, ...), its
    qualified name in the model's ``state_dict`` and its spec."""

    role: str
    name: str
    spec: TensorSpec
    trainable: bool = True


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class OpNode:
    """One op: a unique name (the fx node name), a kind (the op rule that applies), its
    producers (and the spec of what it reads from each), the tensor it outputs, the dims a ParallelConfig may cut, its weights and the
    attributes its rule needs (stride, padding, the function of an elementwise op, ...).

    ``flops`` counts the forward pass (torch.utils.flop_counter); ``bytes_read`` covers inputs
    and weights, ``bytes_written`` the output.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    output: TensorSpec
    dims: tuple[Dim, ...]
    weights: tuple[Weight, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    input_specs: tuple[TensorSpec, ...] = ()
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "dims", tuple(self.dims))
        object.__setattr__(self, "weights", tuple(self.weights))
        object.__setattr__(self, "input_specs", tuple(self.input_specs))
        object.__setattr__(self, "attrs", _freeze(dict(self.attrs)))
        out = len(self.output.shape)
        if self.kind != "loss" and tuple(d.size for d in self.dims[:out]) != self.output.shape:
            raise ValueError(
                f"op {self.name!r}: dims {[d.size for d in self.dims[:out]]} do not match its output "
                f"shape {list(self.output.shape)}"
            )
        extra = [d.name for d in self.dims[out:] if d.role != "reduction"] if self.kind != "loss" else []
        if extra:
            raise ValueError(f"op {self.name!r}: dims {extra} beyond its output's {out} are not "
                             "reduction dims (only a dim the op sums over may follow the output's)")

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the op's dims (its iteration space)."""
        return tuple(d.size for d in self.dims)

    @cached_property
    def reduction_dims(self) -> tuple[int, ...]:
        """Indices of the dims the op sums over (role ``reduction``): they follow the output's
        dims, so a partition's box holds its output region in its first ``len(output.shape)``
        coordinates (``output_region``)."""
        return tuple(i for i, d in enumerate(self.dims) if d.role == "reduction")

    def output_region(self, box: tuple) -> tuple:
        """The output region of the partition computing ``box``: its first
        ``len(output.shape)`` coordinates (a loss: the scalar's empty region)."""
        return box[:len(self.output.shape)]

    @cached_property
    def sample_dim(self) -> int | None:
        """Index of the sample (batch) dim, or None when the op has none."""
        for i, d in enumerate(self.dims):
            if d.role == "sample":
                return i
        return None

    def weight(self, role: str) -> Weight | None:
        return next((w for w in self.weights if w.role == role), None)

    @property
    def weight_bytes(self) -> int:
        return sum(w.spec.nbytes for w in self.weights)


class OpGraph:
    """Ops in topological order, with their names unique; the graph's ``outputs`` are the names
    of the ops whose values the model returns (its loss)."""

    def __init__(self, nodes: Iterable[OpNode], outputs: Iterable[str] = (), name: str = "model",
                 capture: str = "fx"):
        self.name = name
        self.capture = capture
        """The front end that captured the model: ``fx`` (torch.fx) or ``export`` (torch.export)."""
        self.nodes: tuple[OpNode, ...] = tuple(nodes)
        self._by_name: dict[str, OpNode] = {}
        for node in self.nodes:
            if node.name in self._by_name:
                raise ValueError(f"OpGraph: op name {node.name!r} appears twice")
            for src in node.inputs:
                if src not in self._by_name:
                    raise ValueError(
                        f"OpGraph: op {node.name!r} reads {src!r}, which is not an earlier op "
                        "(nodes must be in topological order)"
                    )
            self._by_name[node.name] = node
        self.outputs: tuple[str, ...] = tuple(outputs)
        for out in self.outputs:
            if out not in self._by_name:
                raise ValueError(f"OpGraph: output {out!r} is not an op")
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for node in self.nodes:
            for src in node.inputs:
                users[src].append(node.name)
        self._users = {k: tuple(v) for k, v in users.items()}
        self.needs_grad: dict[str, bool] = {}
        """Whether an op's output carries a gradient in training: a floating output that depends
        on a trainable weight (the executor runs, and the simulator times, a backward only then).
        Both ends of a transfer decide from this alone whether its gradient moves, so the
        executor's sends and receives always pair."""
        for n in self.nodes:
            floating = n.output.dtype.startswith(("float", "bfloat"))
            if n.kind in ("input", "constant"):
                self.needs_grad[n.name] = False
            elif n.kind == "parameter":
                self.needs_grad[n.name] = floating and any(w.trainable for w in n.weights)
            else:
                self.needs_grad[n.name] = floating and (any(w.trainable for w in n.weights)
                                                        or any(self.needs_grad[s] for s in n.inputs))

    def moves_grad(self, src: str, dst: str) -> bool:
        """Whether the gradient of what ``dst`` reads from ``src`` goes back: both carry one
        (``needs_grad``). The executor's sends and receives, the lowering's receive buffers and
        the simulator's sends all decide by this."""
        return self.needs_grad[src] and self.needs_grad[dst]

    def __getitem__(self, name: str) -> OpNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"OpGraph {self.name!r} has no op {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def users(self, name: str) -> tuple[str, ...]:
        """Names of the ops that read ``name``'s output, in topological order."""
        return self._users[name]

    @property
    def batch_size(self) -> int | None:
        """Size of the sample dim of the first op that has one."""
        for node in self.nodes:
            if node.sample_dim is not None:
                return node.dims[node.sample_dim].size
        return None

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    @property
    def weight_bytes(self) -> int:
        return sum(w.spec.nbytes for w in {w.name: w for n in self.nodes for w in n.weights}.values())

    @cached_property
    def weight_dtypes(self) -> dict[str, str]:
        """Weight name -> its dtype (a tied weight once)."""
        return {w.name: w.spec.dtype for n in self.nodes for w in n.weights}

    def fingerprint(self) -> str:
        """sha256 over (name, kind, inputs, output shape and dtype, dims, weight shapes) of
        every op, in order: equal for the same model and batch, different when any changes."""
        items = [
            [n.name, n.kind, list(n.inputs), list(n.output.shape), n.output.dtype,
             [[d.name, d.size, d.role] for d in n.dims],
             [[w.role, w.name, list(w.spec.shape)] for w in n.weights]]
            for n in self.nodes
        ]
        blob = json.dumps(items, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"OpGraph({self.name!r}, {len(self.nodes)} ops, fingerprint={self.fingerprint()})"
