"""ParallelConfig: how one op is cut (one degree per dim) and where its partitions run."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence

from strategies.errors import PlanError
from strategies.graph import Dim, OpNode
from strategies.members import hashed
from strategies.rules import get_rule

__all__ = ["ROLE_LETTER", "ZERO_LEVELS", "ParallelConfig", "validate_config", "enumerate_configs", "check_degrees", "degree_grids",
           "device_blocks", "format_devices"]

ROLE_LETTER = {"sample": "S", "attribute": "A", "parameter": "P", "reduction": "R"}

ZERO_LEVELS = (0, 1, 2, 3)
"""How an op's replicated weight shards are held across their replicas (Rajbhandari et al.
2020, "ZeRO"; FSDP2's ``fully_shard`` for 3): 0 Replicate everything (DDP: gradients
all-reduced); 1 the optimizer state Shard(0) over the shard's replicas (gradients
reduce-scattered, each member updates its chunk, weights all-gathered); 2 the gradients too;
3 the weights too (all-gathered before the op's forward and again before its backward, freed
after each). A shard held by one device has no replicas: every level holds it as 0 does."""


def format_devices(devices: Sequence[int]) -> str:
    """``0-3,8-11`` for runs of consecutive devices."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass(frozen=True)
class ParallelConfig:
    """One degree per dim of the op; partition k (mixed radix over the degrees, last dim fastest)
    runs on ``devices[k]``, so ``len(devices) == prod(degrees)``. ``zero`` is the sharding
    level of the op's replicated weight shards (``ZERO_LEVELS``); ``recompute`` drops what the
    op keeps for backward after its forward and recomputes it before its backward (Chen et al.
    2016, "Training Deep Nets with Sublinear Memory Cost"; ``torch.utils.checkpoint``)."""

    degrees: tuple[int, ...]
    devices: tuple[int, ...]
    zero: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "degrees", tuple(self.degrees))
        object.__setattr__(self, "devices", hashed(self.devices))  # thousands of devices: hashed once
        for i, d in enumerate(self.degrees):
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise PlanError(None, f"degrees[{i}]", d, "a degree is a whole number >= 1")
        for i, d in enumerate(self.devices):
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise PlanError(None, f"devices[{i}]", d, "a device is a whole number >= 0")
        if len(self.devices) != self.parts:
            raise PlanError(None, "devices", list(self.devices),
                            f"{len(self.devices)} devices for prod(degrees {list(self.degrees)}) = "
                            f"{self.parts} partitions; they must be equal")
        if self.zero not in ZERO_LEVELS or isinstance(self.zero, bool):
            raise PlanError(None, "zero", self.zero, f"a sharding level is one of {list(ZERO_LEVELS)}")
        if not isinstance(self.recompute, bool):
            raise PlanError(None, "recompute", self.recompute, "must be true or false")
        if len(set(self.devices)) != len(self.devices):
            dup = sorted({d for d in self.devices if self.devices.count(d) > 1})
            raise PlanError(None, "devices", list(self.devices),
                            f"device(s) {dup} appear twice; each partition needs its own device")

    @property
    def parts(self) -> int:
        return math.prod(self.degrees)

    @cached_property
    def last_device(self) -> int:
        """The highest device (thousands of devices: one pass per config, not per check)."""
        return max(self.devices, default=-1)

    def show(self, dims: Sequence[Dim] | None = None) -> str:
        """Short form: ``S4·P2 @ 0-7`` (S/A/P by the dims' roles; ``@ 3`` for a whole op),
        then ``zero3`` / ``recompute`` where set."""
        cuts = []
        for i, d in enumerate(self.degrees):
            if d > 1:
                cuts.append(f"{ROLE_LETTER[dims[i].role] if dims else 'd' + str(i) + '='}{d}")
        extra = (f" zero{self.zero}" if self.zero else "") + (" recompute" if self.recompute else "")
        return f"{'·'.join(cuts)} @ {format_devices(self.devices)}".strip() + extra

    def with_memory(self, zero: int | None = None, recompute: bool | None = None) -> "ParallelConfig":
        """The same cut with another sharding level and/or recompute choice."""
        return ParallelConfig(self.degrees, self.devices, self.zero if zero is None else zero,
                              self.recompute if recompute is None else recompute)

    def __str__(self) -> str:
        return self.show()


def validate_config(node: OpNode, config: ParallelConfig, num_devices: int,
                    microbatches: int = 1) -> None:
    """Raise PlanError unless ``config`` is a valid way to cut ``node`` over ``num_devices``."""
    if len(config.degrees) != len(node.dims):
        raise PlanError(node.name, "degrees", list(config.degrees),
                        f"{len(config.degrees)} degrees for {len(node.dims)} dims "
                        f"{[d.name for d in node.dims]}; give one per dim")
    ok = get_rule(node.kind).splittable(node)
    for i, (dim, deg) in enumerate(zip(node.dims, config.degrees)):
        if deg == 1:
            continue
        if not ok[i]:
            raise PlanError(node.name, "degrees", list(config.degrees),
                            f"dim {dim.name!r} of a {node.kind!r} op may not be split (degree {deg})")
        size = dim.size
        if dim.role == "sample" and microbatches > 1:
            if size % microbatches:
                raise PlanError(node.name, "microbatches", microbatches,
                                f"{microbatches} micro-batches do not divide dim 'sample'({size})")
            size //= microbatches
            if size % deg:
                raise PlanError(node.name, "degrees", list(config.degrees),
                                f"degree {deg} on dim 'sample'({dim.size} / {microbatches} "
                                f"micro-batches = {size}) does not divide it")
        elif size % deg:
            raise PlanError(node.name, "degrees", list(config.degrees),
                            f"degree {deg} on dim {dim.name!r}({size}) does not divide it")
    why = check_degrees(node, config.degrees, microbatches)
    if why:
        raise PlanError(node.name, "degrees", list(config.degrees), why)
    if config.zero and not any(w.trainable for w in node.weights):
        raise PlanError(node.name, "zero", config.zero, f"a {node.kind!r} op has no trainable weight to shard; "
                        "use 0 (a sharding level of a shard held by one device is a no-op)")
    if config.recompute and node.kind == "input":
        raise PlanError(node.name, "recompute", True, "an input op computes nothing to recompute: "
                        "its batch slice is read, not kept")
    if config.devices and config.last_device >= num_devices:
        i, d = next((i, d) for i, d in enumerate(config.devices) if d >= num_devices)
        raise PlanError(node.name, f"devices[{i}]", d,
                        f"device {d} is out of range for {num_devices} devices (0-{num_devices - 1})")


def check_degrees(node: OpNode, degrees: Sequence[int], microbatches: int = 1) -> str | None:
    """The op rule's ``check_degrees`` on the pieces the partitions compute: ``microbatches``
    micro-batches of a sample dim cut d ways make m·d contiguous pieces of it, the pieces of
    degree m·d (a reshape's piece must fall on whole rows of its input either way)."""
    i = node.sample_dim
    if microbatches == 1 or i is None:
        return get_rule(node.kind).check_degrees(node, degrees)
    why = get_rule(node.kind).check_degrees(node, tuple(d * microbatches if k == i else d
                                                        for k, d in enumerate(degrees)))
    return why and (f"{why} (with {microbatches} micro-batches, degree {degrees[i]} on the sample dim "
                    f"cuts it as degree {degrees[i] * microbatches} would)")


def degree_grids(node: OpNode, max_parts: int, microbatches: int = 1) -> list[tuple[int, ...]]:
    """Every grid of degrees valid for ``node`` with prod(degrees) <= max_parts, the unsplit
    grid first."""
    rule = get_rule(node.kind)
    ok = rule.splittable(node)
    choices = []
    for i, dim in enumerate(node.dims):
        size = dim.size // microbatches if dim.role == "sample" and dim.size % microbatches == 0 else dim.size
        choices.append([d for d in range(1, max_parts + 1) if size % d == 0] if ok[i] else [1])
    out = []
    for g in itertools.product(*choices):
        if math.prod(g) <= max_parts and ((math.prod(g) == 1 and microbatches == 1)
                                          or check_degrees(node, g, microbatches) is None):
            out.append(g)
    return out


def device_blocks(parts: int, num_devices: int, node_size: int | None = None) -> list[tuple[int, ...]]:
    """Device lists for ``parts`` partitions: contiguous blocks aligned to their size
    (FlexFlow's choice), and, given a node size, blocks of one device per node across
    ``parts`` consecutive nodes (same local index), which spread an op over the nodes' links."""
    blocks = [tuple(range(s, s + parts)) for s in range(0, num_devices - parts + 1, parts)]
    if node_size and 1 < parts and node_size < num_devices:
        nodes = num_devices // node_size
        if parts <= nodes:
            for n0 in range(0, nodes - parts + 1, parts):
                for local in range(node_size):
                    blocks.append(tuple((n0 + k) * node_size + local for k in range(parts)))
    return list(dict.fromkeys(blocks))


def enumerate_configs(node: OpNode, num_devices: int, microbatches: int = 1,
                      node_size: int | None = None) -> Iterator[ParallelConfig]:
    """Every valid ParallelConfig of ``node`` over ``num_devices`` devices: each degree grid
    with prod <= num_devices times each device block of that size."""
    for grid in degree_grids(node, num_devices, microbatches):
        for block in device_blocks(math.prod(grid), num_devices, node_size):
            yield ParallelConfig(grid, block)
