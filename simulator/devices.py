"""What a device and a link are, as the simulator sees them (figures in SI units: bytes,
seconds, FLOP/s, bytes/s)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = ["DeviceSpec", "Link", "OVERHEAD_FIELDS"]


OVERHEAD_FIELDS = ("task_overhead", "message_overhead", "exchange_overhead", "collective_overhead")
"""A device's host-cost fields, seconds, 0 unless measured (optional in topology JSON)."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device: a GPU, or a CPU process slot."""

    kind: str
    """Device kind: ``P100``, ``A100-SXM4-80GB``, ``cpu`` (the profiled cost model's cache key:
    what was measured on one device of a kind holds for all)."""
    memory_bytes: int
    """Memory capacity; a plan whose peak exceeds it does not fit."""
    peak_flops: Mapping[str, float]
    """Peak FLOP/s per dtype name (``float32``, ``float16``, ``bfloat16``, ...)."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s (the roofline's slope)."""
    node: int = 0
    """Which machine the device sits in (devices of one node share its intra-node links)."""
    task_overhead: float = 0.0
    """Seconds of host work per forward or backward task of a partition beyond its kernels (the
    executor's per-partition Python: slicing, dispatch, an autograd call); measured by
    ``soapsearch calibrate``, 0 in the datasheet presets."""
    message_overhead: float = 0.0
    """Seconds of host work on this device per point-to-point piece it receives (posting and
    waiting on the receive, copying it into place), beyond the link's time."""
    exchange_overhead: float = 0.0
    """``message_overhead`` of a piece exchanged: received from a device to which the same op
    (in the same micro-batch) sends a piece back, as in OWT's or a tensor-parallel op's
    all-to-all, where both processes compute, send and receive at once and contend for the
    cores that one-way pieces (pipelines, model parallel) leave to the waiting receiver."""
    collective_overhead: float = 0.0
    """Seconds of host work on this device per collective it is a member of (a reduction's
    all-gather or sum, a gradient bucket's all-reduce, the loss value's all-reduce), beyond the
    ring formula: the call, and waking up to ranks that arrive apart on busy cores. Charged as
    a task on the device after the collective ends, before anything that waits on it there
    (``simulator.step.member_ends``)."""
    contention: float = 1.0
    """How many times slower this device computes when every device of its node computes at
    once than when it computes alone (>= 1; 1: nothing shared, as GPUs). CPU processes share
    cores, caches and memory bandwidth: ``soapsearch calibrate`` measures it, and the
    simulator slows each compute task by how many devices of the node compute with it
    (``simulator.contention``)."""
    gemm_half: float = 0.0
    """Hockney's half-performance length n½ of the device's matrix products (Hockney & Jesshope
    1988): a product whose smallest dimension is m runs at peak · m / (m + n½), so half the peak
    at m = n½ (a few rows of a batch split across devices and micro-batches run far below the
    rate of a large product). With ``sms``, n½ is over the reduction length K
    (``simulator.gemm_shape``). 0: not modelled, the cost model's constant compute efficiency
    applies. ``soapsearch calibrate`` fits it (r∞ 1: the peak is then a measured
    product's rate); the GPU presets carry one fitted on published runs (``simulator.presets``)."""
    gemm_rate: float = 1.0
    """Hockney's r∞ as a fraction of the dtype peak: the rate the device's large matrix products
    reach (cuBLAS on a GPU: 0.80-0.86 of the datasheet's tensor-core peak), so a product of
    smallest dimension m runs at peak · gemm_rate · m / (m + gemm_half) (with ``sms``: K for m,
    after tile and wave quantization). Read only where
    ``gemm_half`` > 0; 1 where the peak is itself measured on a product (``soapsearch calibrate``)."""
    overlap_rate: float = 1.0
    """The fraction of its rate a compute task keeps while one of this device's own collectives
    runs beside it (0 < f <= 1; 1: no slowdown): NCCL's kernels take SMs and HBM bandwidth from
    the products they overlap (``simulator.comm_overlap_rate``). Not a cost-model figure: the
    event passes apply it to the timeline."""
    sms: int = 0
    """Streaming multiprocessors of a GPU (A100 108, H100 132: NVIDIA's architecture
    whitepapers). > 0 with ``gemm_half`` > 0: its matrix products run at their shape's rate, tile and wave quantization
    over the SMs and a per-tile rate r∞·K/(K + ``gemm_half``) over the reduction length K
    (``simulator.gemm_shape``); 0: Hockney's form over the smallest dimension (``gemm_half``);
    read only where ``gemm_half`` > 0."""
    cost_key: str = field(init=False, repr=False, compare=False)
    """The figures an op's time depends on (kind, peak FLOP/s, memory bandwidth, n½, r∞, SMs), as one
    string: cost models memoize by it, so two devices of one kind but other figures (a preset
    and a calibration of this machine, both ``cpu``) never share a time."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"device {self.kind!r}: memory_bytes ({self.memory_bytes}) and "
                             f"memory_bandwidth ({self.memory_bandwidth}) must be > 0")
        for name in OVERHEAD_FIELDS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"device {self.kind!r}: {name} = {getattr(self, name)!r}: must be >= 0")
        if not (math.isfinite(self.contention) and self.contention >= 1):
            raise ValueError(f"device {self.kind!r}: contention = {self.contention!r}: must be finite and >= 1 "
                             "(the slowdown when its node's devices compute at once)")
        if not (math.isfinite(self.gemm_half) and self.gemm_half >= 0):
            raise ValueError(f"device {self.kind!r}: gemm_half = {self.gemm_half!r}: must be finite and >= 0 "
                             "(the smallest product dimension at half the peak; 0: not modelled)")
        if not (math.isfinite(self.gemm_rate) and 0 < self.gemm_rate <= 1):
            raise ValueError(f"device {self.kind!r}: gemm_rate = {self.gemm_rate!r}: must be in (0, 1] "
                             "(the fraction of the peak its large matrix products reach)")
        if not (math.isfinite(self.overlap_rate) and 0 < self.overlap_rate <= 1):
            raise ValueError(f"device {self.kind!r}: overlap_rate = {self.overlap_rate!r}: must be in (0, 1] "
                             "(the fraction of its rate a compute task keeps beside the device's collectives)")
        if self.overlap_rate != 1.0 and self.contention != 1.0:
            raise ValueError(f"device {self.kind!r}: overlap_rate {self.overlap_rate!r} with contention "
                             f"{self.contention!r}: a device slows by one of them, not both")
        if not (type(self.sms) is int and self.sms >= 0):
            raise ValueError(f"device {self.kind!r}: sms = {self.sms!r}: must be an int >= 0 "
                             "(the GPU's streaming multiprocessors; 0: no tile model)")
        if not self.peak_flops or min(self.peak_flops.values()) <= 0:
            raise ValueError(f"device {self.kind!r}: peak_flops {dict(self.peak_flops)} needs at "
                             "least one dtype, every figure > 0")
        object.__setattr__(self, "cost_key", repr((self.kind, sorted(self.peak_flops.items()),
                                                   self.memory_bandwidth, self.gemm_half, self.gemm_rate, self.sms)))

    def __reduce__(self):  # the read-only mapping does not pickle; rebuild from a dict
        return (DeviceSpec, (self.kind, self.memory_bytes, dict(self.peak_flops), self.memory_bandwidth,
                             self.node, *(getattr(self, f) for f in OVERHEAD_FIELDS), self.contention,
                             self.gemm_half, self.gemm_rate, self.overlap_rate, self.sms))

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32's when the dtype has no figure of its own)."""
        return self.peak_flops.get(dtype) or self.peak_flops.get("float32") or max(self.peak_flops.values())


@dataclass(frozen=True)
class Link:
    """One direction of one physical link: it carries one transfer at a time."""

    name: str
    """Unique, e.g. ``nvlink:0->1``, ``nic-out:node0``."""
    kind: str
    """Family, for the bytes-moved report: ``nvlink``, ``nvswitch``, ``pcie``, ``ib``, ``shm``."""
    latency: float
    """Seconds per message (alpha)."""
    bandwidth: float
    """Bytes per second (1 / beta)."""
    collective_bandwidth: float | None = None
    """Bytes per second the link carries inside a ring collective, every link of the ring busy
    at once and the receiver reducing what arrives; None: ``bandwidth``. Fabrics with their own
    copy engines (NVLink, InfiniBand) lose nothing; shared-memory links between CPU processes
    do (the cores that copy and add are the ones that send: ``soapsearch calibrate`` fits it
    from the measured all-reduce's slope)."""
    send_bandwidth: float | None = None
    """Bytes per second the sending device's host copies a message onto this link at, computing
    nothing else meanwhile, where the first link of a route holds the sender so (gloo between
    CPU processes: ``isend`` writes into the socket in the calling thread once the receive is
    posted); None: the sender's host is free while its message moves (copy engines)."""
    send_latency: float = 0.0
    """Seconds of the sender's host per message besides the copy (with ``send_bandwidth``):
    a send holds it ``send_latency + bytes / send_bandwidth``."""

    def __post_init__(self) -> None:
        if self.latency < 0 or self.bandwidth <= 0:
            raise ValueError(f"link {self.name!r}: latency {self.latency} must be >= 0 and "
                             f"bandwidth {self.bandwidth} > 0")
        if self.collective_bandwidth is not None and not (
                math.isfinite(self.collective_bandwidth) and self.collective_bandwidth > 0):
            raise ValueError(f"link {self.name!r}: collective_bandwidth {self.collective_bandwidth} must be finite "
                             "and > 0 (or None: the link's bandwidth)")
        if self.send_bandwidth is not None and not (math.isfinite(self.send_bandwidth) and self.send_bandwidth > 0):
            raise ValueError(f"link {self.name!r}: send_bandwidth {self.send_bandwidth} must be finite and > 0 "
                             "(or None: the sender's host is not held)")
        if not (math.isfinite(self.send_latency) and self.send_latency >= 0):
            raise ValueError(f"link {self.name!r}: send_latency {self.send_latency} must be finite and >= 0")
        if self.send_latency and self.send_bandwidth is None:
            raise ValueError(f"link {self.name!r}: send_latency {self.send_latency} needs a send_bandwidth "
                             "(a send holds its sender only where the link has one)")

    def send_time(self, nbytes: float) -> float:
        """Seconds a message of ``nbytes`` holds the sender's host: send_latency + bytes /
        send_bandwidth; 0 without a send bandwidth."""
        return 0.0 if self.send_bandwidth is None else self.send_latency + nbytes / self.send_bandwidth

    @property
    def ring_bandwidth(self) -> float:
        """``collective_bandwidth``, else ``bandwidth``: what a ring collective gets."""
        return self.bandwidth if self.collective_bandwidth is None else self.collective_bandwidth
