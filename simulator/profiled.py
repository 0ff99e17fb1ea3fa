"""ProfiledCostModel: times each op partition for real on the local device and keeps every
measurement in a JSON file on disk, so a second model or search reuses it instantly.

A partition runs exactly as the executor would run it: the op rule's ``forward`` on random
tensors of the shapes of the regions it reads, under autograd, then its backward; the time is
the median of ``repeats`` runs after ``warmup`` runs (CUDA: synchronized around each), less
what the same harness times of a call that computes nothing (``harness_overhead``: dispatch and
autograd's bookkeeping, on a CPU most of a small op's measurement). The
executor's own per-task costs are calibrated apart (``DeviceSpec.task_overhead``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from simulator.cost import (
    LEAF_KINDS,
    AnalyticalCostModel,
    CostModel,
    get_cost_model,
    is_cpu,
    partition_regions,
    register_cost_model,
)
from simulator.devices import DeviceSpec
from simulator.paths import cache_dir
from simulator.topology import Topology
from strategies.graph import OpGraph, OpNode
from strategies.lowered import Lowered
from strategies.region import Box, box_shape
from strategies.serialize import atomic_open
from strategies.rules import OPAQUE, get_rule, no_reduce

__all__ = [
    "CACHE_FORMAT",
    "REPEATS",
    "ROUNDS",
    "WARMUP",
    "ProfiledCostModel",
    "cache_beside",
    "cost_model_for",
    "default_cache_path",
    "harness_overhead",
    "measure_partition",
    "partition_tensors",
    "plan_partitions",
]

log = logging.getLogger(__name__)

REPEATS = 5
"""Timed runs per partition (the median is kept): enough to shed one outlier at ~ms per op."""
WARMUP = 2
"""Untimed runs first: the first call pays allocator growth, kernel selection and lazy init."""
ROUNDS = 5
"""Interleaved rounds of ``ProfiledCostModel.profile`` (the median of the rounds is kept)."""
CACHE_FORMAT = "soapsearch.profile"


def cache_beside(topology_path: str | os.PathLike) -> Path:
    """The profile cache ``soapsearch calibrate`` writes beside a topology JSON:
    ``<dir>/<stem>.profile.json``."""
    p = Path(topology_path)
    return p.with_name(f"{p.stem}.profile.json")


def cost_model_for(name: str, topology: Any) -> CostModel:
    """The cost model ``name`` for plans on ``topology`` (a preset name, a JSON path or a
    Topology): "profiled" on a topology JSON reads the cache calibrated beside it
    (``cache_beside``), where its overheads were fitted; else the shared model of that name."""
    if name == "profiled" and isinstance(topology, (str, os.PathLike)) and Path(topology).is_file():
        return get_cost_model("profiled", cache_path=str(cache_beside(topology)))
    return get_cost_model(name)


def default_cache_path() -> Path:
    """``$SOAPSEARCH_CACHE_DIR/profile.json``, else ``~/.cache/soapsearch/profile.json``."""
    return cache_dir() / "profile.json"


# --- random tensors of a partition --------------------------------------------------------
def _int_bound(node: OpNode, index: int, regions: Sequence[Box | None]) -> int:
    """Exclusive upper bound for integer input ``index``: an embedding's ids < its rows, a
    cross-entropy's targets < the classes (the logits' dim 1), anything else 0 or 1."""
    if node.kind == "embedding" and index == 0 and node.weight("weight") is not None:
        return node.weight("weight").spec.shape[0]
    if node.kind == "loss" and index == 1 and regions[0] is not None:
        return box_shape(regions[0])[1]
    return 2


def _random(shape: Sequence[int], dtype_name: str, device: str, *, grad: bool = False,
            high: int = 2, positive: bool = False) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), device=device).bool()
    if not dtype.is_floating_point:
        return torch.randint(0, max(high, 1), tuple(shape), dtype=dtype, device=device)
    t = (torch.rand(tuple(shape), device=device) + 0.5 if positive
         else torch.randn(tuple(shape), device=device)).to(dtype)
    return t.requires_grad_(grad)


def partition_tensors(node: OpNode, box: Box, device: str = "cpu"
                      ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """Random inputs and weights of the partition ``box``, in its regions' shapes and dtypes.
    Floating inputs and trainable weights require grad; buffers (running statistics) are
    positive; integer inputs are nonnegative and valid (ids, class targets)."""
    regions, weight_regions = partition_regions(node, box)
    inputs = [None if r is None else _random(box_shape(r), s.dtype, device, grad=True,
                                             high=_int_bound(node, i, regions))
              for i, (r, s) in enumerate(zip(regions, node.input_specs))]
    weights = {w.role: _random(box_shape(weight_regions[w.role]), w.spec.dtype, device,
                               grad=w.trainable, positive=not w.trainable)
               for w in node.weights if w.role in weight_regions}
    return inputs, weights


def measure_partition(node: OpNode, box: Box, *, repeats: int = REPEATS, warmup: int = WARMUP,
                      device: str = "cpu") -> tuple[float, float]:
    """Median (forward, backward) seconds of the partition ``box`` of ``node`` on ``device``:
    the rule's forward under autograd, then backward of a random output gradient (0 when the
    output needs no gradient). Raises whatever the rule raises. The harness's own cost per
    call is in it (``harness_overhead``)."""
    rule = get_rule(node.kind)
    inputs, weights = partition_tensors(node, box, device)
    return _time_calls(lambda: rule.forward(node, box, inputs, weights, no_reduce),
                       [*inputs, *weights.values()], repeats, warmup, device)


def harness_overhead(*, repeats: int = 4 * REPEATS, warmup: int = WARMUP,
                     device: str = "cpu") -> tuple[float, float]:
    """What ``measure_partition`` times of a call that computes nothing (a tanh of one element):
    the (forward, backward) seconds of dispatch, autograd's bookkeeping and one
    ``autograd.backward`` call. The executor pays its own such costs per task (runs a
    device's backward steps in fewer autograd calls), which calibration fits as
    ``DeviceSpec.task_overhead``; ``ProfiledCostModel`` subtracts this from every measurement
    so they are not counted twice."""
    x = torch.zeros(1, device=device, requires_grad=True)
    return _time_calls(x.tanh, [x], repeats, warmup, device)


def _time_calls(forward: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor | None], repeats: int,
                warmup: int, device: str) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``forward()`` under autograd and of the backward
    of a random gradient of its output (0 when it needs none), after ``warmup`` untimed runs;
    CUDA synchronized around each. The ``leaves``' gradients are dropped after each run."""
    cuda = torch.device(device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    fwd, bwd = [], []
    with torch.enable_grad():
        for i in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            out = forward()
            sync()
            t_fwd, t_bwd = time.perf_counter() - t0, 0.0
            if out.requires_grad:
                grad = torch.randn_like(out)
                sync()
                t0 = time.perf_counter()
                torch.autograd.backward(out, grad)
                sync()
                t_bwd = time.perf_counter() - t0
            for t in leaves:
                if t is not None:
                    t.grad = None
            if i >= warmup:
                fwd.append(t_fwd)
                bwd.append(t_bwd)
    return statistics.median(fwd), statistics.median(bwd)


# --- the on-disk cache --------------------------------------------------------------------
def plan_partitions(graph: OpGraph, lowered: Lowered, topology: Topology) -> Iterator[tuple[OpNode, Box, DeviceSpec]]:
    """(op, box, device) of every partition of every micro-batch of a lowered plan: what
    ``ProfiledCostModel.profile`` takes to time a plan ahead of simulating it."""
    for name, per_mb in lowered.partitions.items():
        node = graph[name]
        for parts in per_mb:
            for p in parts:
                yield node, p.box, topology.devices[p.device]


def _plain(v: Any) -> Any:
    """``v`` as plain JSON data (mappings sorted, tuples as lists, anything else by repr)."""
    if isinstance(v, Mapping):
        return {str(k): _plain(v[k]) for k in sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def cache_key(node: OpNode, box: Box, device: DeviceSpec) -> str:
    """device kind | torch version | op signature (kind, attrs, op shape, box shape, input
    region shapes and dtypes, weight region shapes, dtypes and trainability, output dtype)."""
    regions, weight_regions = partition_regions(node, box)
    sig = [node.kind, _plain(node.attrs), list(node.shape), list(box_shape(box)),
           [None if r is None else [list(box_shape(r)), s.dtype]
            for r, s in zip(regions, node.input_specs)],
           [[w.role, list(box_shape(weight_regions[w.role])), w.spec.dtype, w.trainable]
            for w in node.weights if w.role in weight_regions],
           node.output.dtype]
    return f"{device.kind}|torch {torch.__version__}|{json.dumps(sig, separators=(',', ':'))}"


class _Store:
    """The measurements (cache key -> [forward s, backward s]) and the file they live in."""

    def __init__(self, path: Path) -> None:
        self.path, self.dirty, self.saved_at = path, False, float("-inf")
        self.entries: dict[str, list[float]] = self._read(warn=True)

    def _read(self, warn: bool) -> dict[str, list[float]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ValueError(f"not a {CACHE_FORMAT} file")
            return {str(k): [float(v[0]), float(v[1])] for k, v in data["entries"].items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            if warn:
                warnings.warn(f"profile cache {self.path} is unreadable ({e}); starting empty, "
                              "it will be overwritten", RuntimeWarning, stacklevel=4)
            return {}

    def flush(self) -> None:
        """Write the entries (merged with whatever another process saved meanwhile) atomically."""
        if not self.dirty:
            return
        merged = {**self._read(warn=False), **self.entries}
        try:
            with atomic_open(self.path) as f:
                json.dump({"format": CACHE_FORMAT, "version": 1, "entries": merged}, f,
                          indent=0, sort_keys=True)
        except OSError as e:  # an unwritable cache costs re-measuring later, not the search
            log.warning("cannot write the profile cache %s: %s", self.path, e)
            return
        self.entries, self.dirty, self.saved_at = merged, False, time.monotonic()


class ProfiledCostModel(CostModel):
    """Measured op times (see ``measure_partition``) less the harness's own cost per call
    (``harness_overhead``, measured once per device kind: t = max(0, t_measured − t_harness)),
    cached on disk at ``cache_path`` (default ``default_cache_path()``) keyed by ``cache_key``.
    A GPU device kind is measured on the local CUDA device (assumed to be of that kind), a CPU
    kind on the CPU. Leaf ops, opaque ops, ops
    that fail to run and GPU kinds without a CUDA device fall back to ``fallback`` (analytical).

    New measurements are written at most every ``save_interval`` seconds, by ``flush()``, and
    when the model is garbage collected or the process exits."""

    measures = True

    def __init__(self, cache_path: str | os.PathLike | None = None, repeats: int = REPEATS,
                 warmup: int = WARMUP, fallback: CostModel | None = None,
                 save_interval: float = 2.0) -> None:
        super().__init__()
        if repeats < 1 or warmup < 0:
            raise ValueError(f"ProfiledCostModel: repeats ({repeats}) must be >= 1 and warmup "
                             f"({warmup}) >= 0")
        self.repeats, self.warmup, self.save_interval = repeats, warmup, save_interval
        self.fallback = fallback if fallback is not None else AnalyticalCostModel()
        self._store = _Store(Path(cache_path) if cache_path is not None else default_cache_path())
        self._finalizer = weakref.finalize(self, self._store.flush)
        self._warned: set[str] = set()

    @property
    def cache_path(self) -> Path:
        return self._store.path

    def __len__(self) -> int:
        """How many measurements the cache holds."""
        return len(self._store.entries)

    def flush(self) -> None:
        """Write the measurements not written yet to the cache file."""
        self._store.flush()

    def _local_device(self, device: DeviceSpec) -> str | None:
        if is_cpu(device):
            return "cpu"
        if torch.cuda.is_available():
            return "cuda"
        if device.kind not in self._warned:
            self._warned.add(device.kind)
            log.warning("no CUDA device to profile %r: its ops use the %s", device.kind,
                        type(self.fallback).__name__)
        return None

    def _measurable(self, node: OpNode, device: DeviceSpec) -> str | None:
        """The local device that times ``node``'s partitions for ``device``, or None where the
        fallback answers (leaf and opaque ops, a GPU kind without a CUDA device)."""
        if node.kind in LEAF_KINDS or get_rule(node.kind).kind == OPAQUE:
            log.debug("op %r (kind %r): %s; using the %s", node.name, node.kind,
                      "not computed" if node.kind in LEAF_KINDS else "no rule to run it",
                      type(self.fallback).__name__)
            return None
        return self._local_device(device)

    def _harness(self, device: DeviceSpec, local: str) -> tuple[float, float]:
        return self._measured(f"{device.kind}|torch {torch.__version__}|harness",
                              lambda: harness_overhead(warmup=self.warmup, device=local))

    def profile(self, partitions: Iterable[tuple[OpNode, Box, DeviceSpec]], rounds: int = ROUNDS) -> int:
        """Time every partition not cached yet in ``rounds`` interleaved rounds -- each round
        runs ``measure_partition`` (median of ``repeats``) of each in turn -- and cache the
        median of its rounds, forward and backward apart. On a shared host an op's speed moves
        from one second to the next, the same call at very different times; timed in one burst, a partition keeps whatever state that burst caught,
        and two partitions of one plan can be timed in different states. Rounds spread each
        partition's samples over the whole profile. Partitions that fail to run are left to
        the fallback (``op_time``). Returns how many were timed."""
        if rounds < 1:
            raise ValueError(f"ProfiledCostModel.profile: rounds ({rounds}) must be >= 1")
        todo: dict[str, tuple[OpNode, Box, str]] = {}
        for node, box, device in partitions:
            local = self._measurable(node, device)
            if local is None:
                continue
            try:
                key = cache_key(node, box, device)
                if key not in self._store.entries and key not in todo:
                    self._harness(device, local)
                    todo[key] = (node, box, local)
            except Exception as e:  # noqa: BLE001 - op_time falls back for it, with the reason
                log.debug("op %r box %s cannot be timed (%s: %s)", node.name, box, type(e).__name__, e)
        samples: dict[str, list[tuple[float, float]]] = {key: [] for key in todo}
        for _ in range(rounds):
            for key in [k for k in todo if k in samples]:
                node, box, local = todo[key]
                try:
                    samples[key].append(measure_partition(node, box, repeats=self.repeats,
                                                          warmup=self.warmup, device=local))
                except Exception as e:  # noqa: BLE001 - op_time falls back for it, with the reason
                    log.debug("op %r box %s failed to run (%s: %s)", node.name, box, type(e).__name__, e)
                    del samples[key]
        for key, runs in samples.items():
            self._store.entries[key] = [statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs)]
            self._store.dirty = True
        self._store.flush()
        return len(samples)

    def _op_time(self, node: OpNode, box: Box, regions: tuple[Box | None, ...],
                 weight_regions: dict[str, Box], device: DeviceSpec) -> tuple[float, float]:
        local = self._measurable(node, device)
        if local is None:
            return self.fallback.op_time(node, box, device)
        try:
            fwd, bwd = self._measured(cache_key(node, box, device), lambda: measure_partition(
                node, box, repeats=self.repeats, warmup=self.warmup, device=local))
            h_fwd, h_bwd = self._harness(device, local)
        except Exception as e:  # noqa: BLE001 - any failure to run falls back, with its reason
            log.debug("op %r (kind %r) box %s failed to run (%s: %s); using the %s", node.name,
                      node.kind, box, type(e).__name__, e, type(self.fallback).__name__)
            return self.fallback.op_time(node, box, device)
        return max(0.0, fwd - h_fwd), (max(0.0, bwd - h_bwd) if bwd > 0 else 0.0)

    def _measured(self, key: str, measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
        """The cached (forward, backward) seconds at ``key``, else ``measure()``'s, cached."""
        hit = self._store.entries.get(key)
        if hit is not None:
            return hit[0], hit[1]
        fwd, bwd = measure()
        self._store.entries[key] = [fwd, bwd]
        self._store.dirty = True
        if time.monotonic() - self._store.saved_at >= self.save_interval:
            self._store.flush()
        return fwd, bwd


register_cost_model("profiled", ProfiledCostModel)
