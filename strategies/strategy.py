"""Strategy: a ParallelConfig for every op, plus micro-batches and the pipeline schedule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Collection, Iterator, Mapping

from strategies.chunks import pipeline_chunks
from strategies.config import ParallelConfig, validate_config
from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode

__all__ = ["Strategy", "SCHEDULES", "PLAN_SCHEDULES", "PRECISIONS", "COMPUTE_DTYPES", "DTYPE_FLAGS", "FSDP_UNITS",
           "REDUCE_DTYPES", "REDUCE_HELP", "check_bucket_cap"]

SCHEDULES = ("gpipe", "1f1b")
"""The schedules any plan can run (the search draws among them)."""
PLAN_SCHEDULES = (*SCHEDULES, "interleaved")
"""Every schedule a plan may name: ``interleaved`` only where its devices form the ranks and
chunks of an interleaved pipeline (``strategies.chunks``)."""
PRECISIONS = ("model", "bf16", "fp16")
"""A plan's precision: ``model`` computes in the model's dtype (as traced); ``bf16`` / ``fp16``
is mixed precision (Micikevicius et al. 2018; FSDP2's ``MixedPrecisionPolicy`` with
param_dtype = reduce_dtype = the compute dtype): each partition runs under
``torch.autocast(dtype)`` (its op lists keep what they keep in float32), weights and the
optimizer state stay float32 (master weights), activations and transfers move in the compute
dtype, gradients are reduced in ``Strategy.reduce_dtype``."""
REDUCE_DTYPES = ("compute", "float32")
"""What a mixed precision plan reduces its gradients in (``Strategy.reduce_dtype``; FSDP2's
``MixedPrecisionPolicy.reduce_dtype``): ``compute``, the compute dtype (reduce_dtype =
param_dtype), or ``float32`` (torchtitan's ``mixed_precision_reduce`` default)."""
REDUCE_HELP = ("the dtype gradients are summed in under bf16/fp16 (FSDP2's reduce_dtype): compute, the compute "
               "dtype, or float32 (torchtitan's default; 2x the bytes on the wire); default {})")
"""The command line's help of ``--reduce-dtype`` (plan, simulate, search, run), its default to fill in."""
FSDP_UNITS = ("op", "block")
"""A plan's ZeRO-3 prefetch unit (``Strategy.fsdp_unit``)."""
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""The torch dtype name a mixed precision computes in."""
DTYPE_FLAGS = {"fp32": "model", "bf16": "bf16", "fp16": "fp16"}
"""The command line's ``--dtype`` -> a plan's precision (fp32: the model's own dtype, for a
float32 model)."""


def check_bucket_cap(value: object, field_name: str = "bucket_cap_mb") -> float:
    """``value`` as a bucket cap in MiB; PlanError in one line unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise PlanError(None, field_name, value, "the gradient bucket cap in MiB must be a finite number > 0 "
                        "(DDP's bucket_cap_mb, default 25)")
    return float(value)


@dataclass(frozen=True)
class Strategy:
    """A plan for ``num_devices`` devices. ``configs`` are (op name, ParallelConfig) pairs in
    the graph's order; ``microbatches`` slices the batch (gradients accumulate over them)."""

    configs: tuple[tuple[str, ParallelConfig], ...]
    num_devices: int
    microbatches: int = 1
    schedule: str = "gpipe"
    precision: str = "model"
    bucket_cap_mb: float = 25.0
    """The gradient buckets' cap in MiB (DDP's ``bucket_cap_mb``, its default 25):
    ``strategies.lowered.split_buckets`` cuts each device set's gradients into buckets of about
    this size, each synced as soon as its gradients are final (``strategies.overlap``)."""
    fsdp_unit: str = "op"
    """What one ZeRO-3 prefetch unit is (``strategies.prefetch``, ``FSDP_UNITS``): ``op``, each
    step reading level-3 weights; ``block``, each instance of a repeated block
    (``strategies.repeats``: a transformer layer, FSDP2's ``fully_shard`` per block)."""
    reduce_dtype: str = "compute"
    """The dtype gradients are summed in (``REDUCE_DTYPES``; FSDP2's ``reduce_dtype``): under
    mixed precision ``compute`` casts each bucket and reduce-scatter input to the compute dtype,
    ``float32`` keeps them in float32 (``strategies.precision.reduce_dtype``); only ``compute``
    in "model" precision, where the two are one."""
    overlap_grad_reduce: bool = True
    """Whether each level-0/1 gradient bucket is synced as soon as its gradients are final,
    overlapping the rest of the backward (DDP's and FSDP2's way), or every bucket after a
    device's last backward step and the pipeline sends after it (False: Megatron-LM's
    ``overlap_grad_reduce=False``, its default, and its local DDP's ``allreduce_gradients``
    after the schedule; ``strategies.overlap``)."""
    _index: Mapping[str, ParallelConfig] = field(default=None, compare=False, repr=False, hash=False)  # type: ignore[assignment]

    def __hash__(self) -> int:
        """The compared fields' hash, computed once (a search keys its results by plan value,
        ``soapsearch.search.evaluator.Evaluator``, and asks for it several times a proposal)."""
        got = self.__dict__.get("_hash")
        if got is None:
            got = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
            object.__setattr__(self, "_hash", got)
        return got

    def __getstate__(self) -> dict:
        """The fields without the kept hash: a string's hash differs from process to process."""
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", tuple((str(k), v) for k, v in self.configs))
        object.__setattr__(self, "_index", dict(self.configs))
        if len(self._index) != len(self.configs):
            raise PlanError(None, "ops", [k for k, _ in self.configs], "an op appears twice")
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise PlanError(None, "num_devices", self.num_devices, "must be a whole number >= 1")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(None, "microbatches", self.microbatches, "must be a whole number >= 1")
        if self.schedule not in PLAN_SCHEDULES:
            raise PlanError(None, "schedule", self.schedule, f"must be one of {list(PLAN_SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise PlanError(None, "precision", self.precision, f"must be one of {list(PRECISIONS)}")
        check_bucket_cap(self.bucket_cap_mb)
        if not isinstance(self.overlap_grad_reduce, bool):
            raise PlanError(None, "overlap_grad_reduce", self.overlap_grad_reduce, "must be true or false (sync "
                            "each gradient bucket as soon as it is final, or all after the backward)")
        if self.fsdp_unit not in FSDP_UNITS:
            raise PlanError(None, "fsdp_unit", self.fsdp_unit, f"must be one of {list(FSDP_UNITS)} (the ZeRO-3 "
                            "prefetch unit: each op's step, or each repeated block's instance)")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise PlanError(None, "reduce_dtype", self.reduce_dtype, f"must be one of {list(REDUCE_DTYPES)} (FSDP2's "
                            "reduce_dtype: the compute dtype's or float32)")
        if self.reduce_dtype != "compute" and self.precision == "model":
            raise PlanError(None, "reduce_dtype", self.reduce_dtype, "a gradient reduce dtype other than 'compute' "
                            "needs mixed precision (precision bf16 or fp16): in 'model' precision gradients are "
                            "reduced in the model's dtype")

    @classmethod
    def of(cls, configs: Mapping[str, ParallelConfig], num_devices: int, microbatches: int = 1,
           schedule: str = "gpipe", precision: str = "model", bucket_cap_mb: float = 25.0,
           fsdp_unit: str = "op", reduce_dtype: str = "compute", overlap_grad_reduce: bool = True) -> "Strategy":
        return cls(tuple(configs.items()), num_devices, microbatches, schedule, precision, bucket_cap_mb, fsdp_unit,
                   reduce_dtype, overlap_grad_reduce)

    @property
    def bucket_cap_bytes(self) -> int:
        """``bucket_cap_mb`` in bytes, as DDP counts it: int(mb · 1024 · 1024)."""
        return int(self.bucket_cap_mb * 1024 * 1024)

    @property
    def compute_dtype(self) -> str | None:
        """The dtype partitions compute in under mixed precision (``bfloat16``/``float16``);
        None for ``model`` precision."""
        return COMPUTE_DTYPES.get(self.precision)

    def __getitem__(self, op: str) -> ParallelConfig:
        try:
            return self._index[op]
        except KeyError:
            raise KeyError(f"the plan has no config for op {op!r}") from None

    def __contains__(self, op: object) -> bool:
        return op in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self.configs)

    def items(self):
        return self._index.items()

    def replace(self, op: str, config: ParallelConfig) -> "Strategy":
        """The same plan with ``op`` given ``config`` (one MCMC proposal). Made without
        ``__post_init__``'s pass over every op (nothing it checks changes): the configs are
        spliced at the op's position, and the device uses patched when already counted."""
        at = self._positions.get(op)
        if at is None:
            raise KeyError(f"the plan has no config for op {op!r}")
        name, old = self.configs[at]
        new = object.__new__(Strategy)
        for f, value in (("configs", self.configs[:at] + ((name, config),) + self.configs[at + 1:]),
                         ("num_devices", self.num_devices), ("microbatches", self.microbatches),
                         ("schedule", self.schedule), ("precision", self.precision),
                         ("bucket_cap_mb", self.bucket_cap_mb), ("fsdp_unit", self.fsdp_unit),
                         ("reduce_dtype", self.reduce_dtype), ("overlap_grad_reduce", self.overlap_grad_reduce),
                         ("_index", {**self._index, name: config})):
            object.__setattr__(new, f, value)
        new.__dict__["_positions"] = self._positions  # cached properties live in __dict__
        uses = self.__dict__.get("_uses")
        if uses is not None:
            uses = dict(uses)
            for d in old.devices:
                uses[d] -= 1
            for d in config.devices:
                uses[d] = uses.get(d, 0) + 1
            new.__dict__["_uses"] = {d: c for d, c in uses.items() if c}
        return new

    def with_configs(self, configs: Mapping[str, ParallelConfig]) -> "Strategy":
        """``configs`` (op -> config) under this plan's other fields (micro-batches, schedule,
        precision, bucket cap, prefetch unit, reduce dtype, gradient sync overlap)."""
        return dataclasses.replace(self, configs=tuple(configs.items()))

    def with_recompute(self, ops: Collection[str]) -> "Strategy":
        """The same plan with each op of ``ops`` recomputed in the backward (``ParallelConfig
        .recompute``), the others as they are: what every recompute policy sets
        (``strategies.recompute_policies``, ``strategies.baselines.RECOMPUTE``)."""
        return self.with_configs({name: cfg.with_memory(recompute=True) if name in ops else cfg
                                  for name, cfg in self.items()})

    def with_microbatches(self, microbatches: int, schedule: str | None = None) -> "Strategy":
        return dataclasses.replace(self, microbatches=microbatches, schedule=schedule or self.schedule)

    def with_precision(self, precision: str, reduce_dtype: str | None = None) -> "Strategy":
        """The same plan computing in ``precision`` (``PRECISIONS``), its gradients reduced in
        ``reduce_dtype`` (None: this plan's where ``precision`` is mixed, else ``compute``)."""
        if reduce_dtype is None:
            reduce_dtype = self.reduce_dtype if precision != "model" else "compute"
        return dataclasses.replace(self, precision=precision, reduce_dtype=reduce_dtype)

    def with_bucket_cap(self, bucket_cap_mb: float) -> "Strategy":
        """The same plan with gradient buckets capped at ``bucket_cap_mb`` MiB."""
        return dataclasses.replace(self, bucket_cap_mb=bucket_cap_mb)

    def with_overlap_grad_reduce(self, overlap: bool) -> "Strategy":
        """The same plan with its gradient buckets synced during the backward (True) or after
        it (False: ``overlap_grad_reduce``)."""
        return dataclasses.replace(self, overlap_grad_reduce=overlap)

    def with_fsdp_unit(self, fsdp_unit: str) -> "Strategy":
        """The same plan with ZeRO-3 prefetch units of ``fsdp_unit`` (``FSDP_UNITS``)."""
        return dataclasses.replace(self, fsdp_unit=fsdp_unit)

    @cached_property
    def devices_used(self) -> tuple[int, ...]:
        """Every device some op runs on, sorted (computed once: plans are immutable)."""
        return tuple(sorted(self._uses))

    @cached_property
    def _uses(self) -> dict[int, int]:
        """Device -> how many ops run on it (``replace`` patches it)."""
        groups: dict[tuple[int, ...], int] = {}  # ops of one device list counted once (data parallel: one)
        for _, c in self.configs:
            groups[c.devices] = groups.get(c.devices, 0) + 1
        uses: dict[int, int] = {}
        for devices, count in groups.items():
            for d in devices:
                uses[d] = uses.get(d, 0) + count
        return uses

    @cached_property
    def _positions(self) -> dict[str, int]:
        """Op -> its index in ``configs`` (shared by the plans ``replace`` makes)."""
        return {name: i for i, (name, _) in enumerate(self.configs)}

    def validate(self, graph: OpGraph, where: str = "", configs: bool = True) -> None:
        """Raise PlanError unless this is a valid plan for ``graph``: every op has a config and
        no other op does, and (``configs``) each config is valid for its op."""
        missing = [n.name for n in graph if n.name not in self._index]
        if missing:
            raise PlanError(missing[0], "ops", missing[:5],
                            f"{len(missing)} op(s) of the model have no config in the plan", where)
        extra = [k for k in self._index if k not in graph]
        if extra:
            raise PlanError(extra[0], "ops", extra[:5],
                            f"{len(extra)} op(s) of the plan are not in the model", where)
        if configs:
            for node in graph:
                self.validate_op(node, where)
        if self.schedule == "interleaved":  # its ranks and chunks (strategies.chunks)
            try:
                pipeline_chunks(graph, self)
            except PlanError as e:
                raise PlanError(e.op, e.field, e.value, e.rule, where) from None

    def validate_op(self, node: OpNode, where: str = "") -> None:
        """Raise PlanError unless this plan's config of ``node`` is valid for it."""
        try:
            validate_config(node, self._index[node.name], self.num_devices, self.microbatches)
        except PlanError as e:
            raise PlanError(node.name, e.field, e.value, e.rule, where) from None
