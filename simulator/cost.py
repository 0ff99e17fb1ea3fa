"""Cost models: the (forward, backward) seconds of one op partition on one device kind.

``CostModel.op_time`` is called thousands of times a second by a search, so it memoizes: first
by the partition's exact box, then by the shapes that determine its cost (box shape and the
shapes of the input regions it reads: an edge partition of a spatial split reads a smaller halo
than an inner one, so the box shape alone is not exact). ``AnalyticalCostModel`` is the roofline
(Williams, Waterman & Patterson, "Roofline", CACM 2009): time = max(FLOPs / (peak × compute
efficiency), bytes / (bandwidth × memory efficiency)) + launch overhead per kernel.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from simulator.attention_efficiency import FLASH_BACKWARD, causal_fraction, flash_rate
from simulator.devices import DeviceSpec
from simulator.gemm_shape import gemm_efficiency
from strategies.graph import DTYPE_BYTES, OpNode
from strategies.lowered import Partition
from strategies.region import Box, box_numel, box_shape
from strategies.rules import get_rule

__all__ = [
    "ATTENTION_KERNELS",
    "COMPUTE_EFFICIENCY",
    "CPU_LAUNCH_OVERHEAD",
    "GPU_LAUNCH_OVERHEAD",
    "LEAF_KINDS",
    "MEMORY_EFFICIENCY",
    "VIEW_KINDS",
    "AnalyticalCostModel",
    "CostModel",
    "gemm_efficiency",
    "get_cost_model",
    "has_trainable_params",
    "is_cpu",
    "partition_bytes",
    "partition_flops",
    "partition_regions",
    "register_cost_model",
]

COMPUTE_EFFICIENCY = 0.6
"""Fraction of peak FLOP/s an op reaches: large GEMMs and convolutions reach 60-80 % of the
datasheet peak, smaller and odd-shaped kernels less; 0.6 is the middle of what cuBLAS/cuDNN and
oneDNN deliver on the zoo's shapes."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of the datasheet bandwidth a streaming kernel reaches (STREAM-like copies: 80-90 %;
on an A100 80GB SXM a pure read kernel measures 1.80 of 2.04 TB/s, 88 % in Nsight Compute:
NVIDIA developer forum, "Trouble to Reach Peak Bandwidth of A100"; kernels that read and write,
as softmax, dropout and the elementwise ops do, reach less)."""
GPU_LAUNCH_OVERHEAD = 5e-6
"""Seconds per kernel on a GPU: a CUDA launch plus PyTorch's eager dispatch is 4-10 µs."""
CPU_LAUNCH_OVERHEAD = 2e-6
"""Seconds per op on a CPU: no launch, only the framework's dispatch (1-5 µs an eager op)."""
ATTENTION_KERNELS = ("flash", "math", "megatron")
"""How an ``attention`` op is costed: "flash" (Dao et al. 2022: the scores never leave on-chip
memory, HBM traffic q, k, v and the output; torch's SDPA on A100/H100; on a GPU with a published
FlashAttention-2 curve, ``simulator.attention_efficiency``, at its rate by keys, head dim and
causal mask), "math" (their
Algorithm 0, the standard attention: q·kᵀ, softmax and ·v as separate kernels, the
queries × keys scores S and probabilities P of every head written to and read from HBM) or
"megatron" ("math" with dropout on the probabilities, Megatron-LM's ``CoreAttention``: baddbmm,
its fused scale-mask-softmax, ``attention_dropout`` (default 0.1; Korthikanti et al. 2022 §4.1
count its mask and output in a layer's activations), bmm)."""
MATH_ATTENTION_PASSES = (4, 7)
"""HBM passes over the queries × keys matrix of the "math" kernel (Dao et al. 2022, Algorithms 0
and 3): forward writes S, reads S, writes P, reads P; backward reads P, writes dP, reads P and
dP, writes dS, reads dS twice (for dQ and dK)."""
MATH_ATTENTION_KERNELS = (3, 5)
"""Kernels of the "math" attention: forward 2 products and the softmax; backward 4 products and
the softmax's backward."""
DROPOUT_PASSES = (2, 2)
"""HBM passes over the probabilities that the "megatron" kernel's dropout adds to "math"'s:
forward reads P and writes P' (which ·v then reads in P's place), backward reads dP' and writes
dP (torch's ``native_dropout`` and ``native_dropout_backward``, one kernel each)."""
DROPOUT_MASK_BYTES = 1
"""Bytes per score of the dropout's mask (``native_dropout`` returns a bool mask): written in
the forward, read in the backward."""

LEAF_KINDS = frozenset({"input", "parameter", "constant"})
"""Ops that are not computed (the executor slices the batch or the state): they cost 0."""
VIEW_KINDS = frozenset({"reshape", "flatten", "slice"})
"""Ops that are views of their input in torch (no kernel, no bytes moved): they cost 0. A
``permute`` is a view too, but its consumer then reads strided memory or copies it, so it is
costed as a copy (read + write), like ``concat``."""
_GATHER_KINDS = frozenset({"embedding"})
_TWO_OPERAND_KINDS = frozenset({"matmul"})
"""Products of two activations: backward computes both operands' gradients (torch.matmul)."""


def is_cpu(device: DeviceSpec) -> bool:
    """Whether the device is a CPU process slot (its kind names ``cpu``) rather than a GPU."""
    return "cpu" in device.kind.lower()


def partition_regions(node: OpNode, box: Box) -> tuple[tuple[Box | None, ...], dict[str, Box]]:
    """The input regions (None: reads nothing) and weight regions the partition ``box`` reads."""
    rule = get_rule(node.kind)
    return tuple(rule.input_regions(node, box)), dict(rule.weight_regions(node, box))


def partition_flops(node: OpNode, box: Box) -> float:
    """Forward FLOPs of the partition: the op's FLOPs × box volume / the op's volume."""
    full = 1
    for s in node.shape:
        full *= s
    return node.flops * box_numel(box) / full if full else 0.0


def partition_bytes(node: OpNode, box: Box, regions: tuple[Box | None, ...] | None = None,
                    weight_regions: dict[str, Box] | None = None) -> int:
    """Bytes the partition's forward moves: its input regions + weight regions + its output
    region (a loss outputs one scalar; a reduction cut: its Partial sum of the region). An embedding reads only the rows it gathers, not its whole table."""
    if regions is None or weight_regions is None:
        regions, weight_regions = partition_regions(node, box)
    total = sum(box_numel(r) * DTYPE_BYTES[s.dtype]
                for r, s in zip(regions, node.input_specs) if r is not None)
    out = node.output.nbytes if node.kind == "loss" else \
        box_numel(node.output_region(box)) * DTYPE_BYTES[node.output.dtype]
    for w in node.weights:
        r = weight_regions.get(w.role)
        if r is not None:
            wb = box_numel(r) * DTYPE_BYTES[w.spec.dtype]
            total += min(wb, out) if node.kind in _GATHER_KINDS else wb
    return total + out


def has_trainable_params(node: OpNode) -> bool:
    """Whether backward computes a parameter gradient as well as the input gradient: a trainable
    module weight, or parameters passed to a functional call (``attrs["param_inputs"]``)."""
    return any(w.trainable for w in node.weights) or bool(node.attrs.get("param_inputs"))


_BY_PARTITION = 1 << 18
"""Entries of ``CostModel.partition_time``'s memo by partition, and of ``op_time``'s by box, each
emptied past it (the memo by shapes stays): both grow with the plans a search scores, an entry
(its key's boxes and regions, two floats) about 200-250 bytes, so each holds at most ~64 MiB."""


class CostModel(abc.ABC):
    """Time of one op partition: ``op_time(node, box, device) -> (forward s, backward s)``, or
    ``partition_time(node, partition, device)`` for a lowered partition (its stored regions).

    ``box`` is the partition's region in the op's dims (a loss: its per-sample dims). Results
    are memoized in memory per (op object, box, device kind) and per (op, box shape, input and
    weight region shapes, device kind), which is exact (both calls share the second); subclasses
    implement ``_op_time``, called once per distinct shape key. An op is keyed by its name, kind, shape, input specs, weights and
    FLOPs, so one instance serves several graphs."""

    measures = False
    """Whether it times kernels on the local machine when asked for a partition it has not seen (then
    nothing else should run on the cores meanwhile: a search runs its chains one at a time)."""
    input_grad_overlap = False
    """Whether a collective's backward (the dual reducing its readers' input gradients) runs beside
    its readers' parameter-gradient products (``simulator.collectives``), as Megatron-LM's
    column-parallel linear issues its input gradient's all-reduce or reduce-scatter asynchronously
    and then computes its weight gradient (``LinearWithGradAccumulationAndAsyncCommunication``;
    ``--no-async-tensor-model-parallel-allreduce``: "Disable asynchronous execution of
    tensor-model-parallel all-reduce with weight gradient computation of a column-linear layer");
    the project's executor runs it after them (False)."""
    fsdp_copies = False
    """Whether each level-3 all-gather and level-2/3 reduce-scatter also pays the memory-bound
    copies FSDP2 runs on the compute stream (``simulator.zero3``; ``_fsdp_collectives.py``:
    ``foreach_all_gather_copy_out``'s ``split_with_sizes_copy`` out of the flat all-gather
    buffer, waited on by the default stream; ``foreach_reduce_scatter``'s ``torch.cat`` of the
    gradients into the flat reduce-scatter input in the reduce dtype and its pre-divide
    ``div_``, which the default stream waits on before it frees the gradients). Off by default:
    it models FSDP2's runtime (``benchmarks/published_runs.row_cost`` sets it on FSDP2's rows),
    not the project's executor, which copies otherwise (``soapsearch/executor/gathered.py``: a
    ``copy_`` per shard out of the gathered flat tensor, a ``torch.cat`` of the gradient rows
    before the reduce-scatter, no pre-divide) and whose copies no cost model charges yet."""

    def __init__(self) -> None:
        self._by_box: dict[Any, tuple[float, float]] = {}
        self._by_partition: dict[Any, tuple[float, float]] = {}
        self._by_shape: dict[Any, tuple[float, float]] = {}
        self._nodes: dict[int, tuple[OpNode, int]] = {}  # id -> (node kept alive, so its id is unique; op key)
        self._ops: dict[Any, int] = {}  # (name, kind, shape, input specs, weights, FLOPs) -> op key

    def op_time(self, node: OpNode, box: Box, device: DeviceSpec) -> tuple[float, float]:
        exact = (id(node), box, device.cost_key)  # the hot path: one hash of small tuples
        hit = self._by_box.get(exact)
        if hit is not None:
            return hit
        regions, weights = partition_regions(node, box)
        if len(self._by_box) >= _BY_PARTITION:
            self._by_box.clear()
        hit = self._by_box[exact] = self._timed(node, box, tuple(regions), tuple(
            (w.role, weights[w.role]) for w in node.weights if w.role in weights), device)
        return hit

    def partition_time(self, node: OpNode, partition: Partition, device: DeviceSpec) -> tuple[float, float]:
        """``op_time(node, partition.box, device)`` from the input and weight regions the lowering
        stored on ``partition`` (the rules' regions of its box), not recomputed per box; memoized
        per (op object, box, regions, device kind) too, a cheaper hash than the shapes' (the task
        blocks of a search's every proposal ask for it)."""
        exact = (id(node), partition.box, partition.input_regions, partition.weight_regions, device.cost_key)
        hit = self._by_partition.get(exact)
        if hit is None:
            if len(self._by_partition) >= _BY_PARTITION:
                self._by_partition.clear()
            hit = self._by_partition[exact] = self._timed(
                node, partition.box, partition.input_regions, partition.weight_regions, device)
        return hit

    def _timed(self, node: OpNode, box: Box, regions: tuple[Box | None, ...],
               weights: tuple[tuple[str, Box], ...], device: DeviceSpec) -> tuple[float, float]:
        """The memo by shapes, keyed on the op, box shape, region shapes (``weights``: the regions
        of the node's weight roles it reads, in ``node.weights`` order) and device kind."""
        held = self._nodes.get(id(node))
        if held is None:
            op = (node.name, node.kind, node.shape, node.input_specs, node.weights, node.flops)
            held = self._nodes[id(node)] = (node, self._ops.setdefault(op, len(self._ops)))
        key = (held[1], box_shape(box), tuple(None if r is None else box_shape(r) for r in regions),
               tuple((k, box_shape(r)) for k, r in weights), device.cost_key)
        hit = self._by_shape.get(key)
        if hit is None:
            f, b = self._op_time(node, box, regions, dict(weights), device)
            hit = self._by_shape[key] = (float(f), float(b))
        return hit

    @abc.abstractmethod
    def _op_time(self, node: OpNode, box: Box, regions: tuple[Box | None, ...],
                 weight_regions: dict[str, Box], device: DeviceSpec) -> tuple[float, float]:
        """(forward, backward) seconds of the partition, given the regions it reads."""


class AnalyticalCostModel(CostModel):
    """Roofline (Williams et al. 2009): t = max(F / (peak(dtype)·e_c), B / (bw·e_m)) + n·launch.
    On a device with a half-performance length n½ (``DeviceSpec.gemm_half``: calibrated on a
    CPU, fitted on published runs for the GPU presets), an op of library matrix products whose
    smallest dimension is m (``OpRule.gemm_size``) takes e_c = r∞·m / (m + n½) instead
    (``gemm_efficiency``; Hockney & Jesshope 1988), on a GPU with SMs the rate of its products'
    shapes each way (``simulator.gemm_shape``: tiles, waves, n½ over the reduction length).
    Backward is the sum over the gradients it computes, each at its rate: dA only without a
    trainable weight, dA and dB for a trained weight or a product of two activations (matmul).
    Attention and the ops without products keep the constant e_c (memory-bound ones are the
    bandwidth's either way).

    Forward: F = the partition's FLOPs, B = ``partition_bytes``, one kernel. Backward: 2F and 2
    kernels (dA + dB) for an op with trainable parameters or a matmul of two activations, 2F for
    attention (the gradients of q, k and v: four products to the forward's two), else F and one
    kernel; 2B either way (it reads the output grad and what forward read, writes the grads); an
    embedding's backward also writes its whole dense table gradient. Leaf and view ops cost 0.

    ``efficiency``: (compute, memory) fractions, or one float for both. ``launch_overhead``:
    seconds per kernel; None picks ``GPU_LAUNCH_OVERHEAD`` or ``CPU_LAUNCH_OVERHEAD`` per device.
    ``attention``: the kernel an ``attention`` op runs (``ATTENTION_KERNELS``); "flash" on a GPU
    with a published FlashAttention-2 curve runs at its rate instead (``_flash``); "math" adds the
    queries × keys scores' HBM passes (``MATH_ATTENTION_PASSES``) and kernels to its bytes;
    "megatron" adds the dropout's too (``DROPOUT_PASSES``, its mask, one kernel each way).
    ``input_grad_overlap``: ``CostModel.input_grad_overlap``; ``fsdp_copies``:
    ``CostModel.fsdp_copies``.
    """

    def __init__(self, efficiency: float | tuple[float, float] = (COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY),
                 launch_overhead: float | None = None, attention: str = "flash",
                 input_grad_overlap: bool = False, fsdp_copies: bool = False) -> None:
        super().__init__()
        self.input_grad_overlap = bool(input_grad_overlap)
        self.fsdp_copies = bool(fsdp_copies)
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"AnalyticalCostModel: attention {attention!r} must be one of {list(ATTENTION_KERNELS)}")
        self.attention = attention
        compute, memory = (efficiency, efficiency) if isinstance(efficiency, (int, float)) else efficiency
        if not (0 < compute <= 1 and 0 < memory <= 1):
            raise ValueError(f"AnalyticalCostModel: efficiency (compute {compute}, memory {memory}) "
                             "must each be in (0, 1]")
        if launch_overhead is not None and launch_overhead < 0:
            raise ValueError(f"AnalyticalCostModel: launch_overhead {launch_overhead} must be >= 0")
        self.compute_efficiency, self.memory_efficiency = float(compute), float(memory)
        self.launch_overhead = launch_overhead

    def __repr__(self) -> str:
        return (f"AnalyticalCostModel(efficiency=({self.compute_efficiency}, "
                f"{self.memory_efficiency}), launch_overhead={self.launch_overhead}, attention={self.attention!r}, "
                f"input_grad_overlap={self.input_grad_overlap}, fsdp_copies={self.fsdp_copies})")

    def launch(self, device: DeviceSpec) -> float:
        """Seconds of overhead per kernel on ``device``."""
        if self.launch_overhead is not None:
            return self.launch_overhead
        return CPU_LAUNCH_OVERHEAD if is_cpu(device) else GPU_LAUNCH_OVERHEAD

    def roofline(self, flops: float, nbytes: float, dtype: str, device: DeviceSpec,
                 kernels: int = 1, efficiency: float | None = None) -> float:
        """max(flops / (peak(dtype)·e_c), bytes / (bandwidth·e_m)) + kernels × launch;
        ``efficiency`` in place of e_c when given."""
        e_c = self.compute_efficiency if efficiency is None else efficiency
        compute = flops / (device.flops_for(dtype) * e_c)
        memory = nbytes / (device.memory_bandwidth * self.memory_efficiency)
        return max(compute, memory) + kernels * self.launch(device)

    def _op_time(self, node: OpNode, box: Box, regions: tuple[Box | None, ...],
                 weight_regions: dict[str, Box], device: DeviceSpec) -> tuple[float, float]:
        if node.kind in LEAF_KINDS or node.kind in VIEW_KINDS:
            return 0.0, 0.0
        flops = partition_flops(node, box)
        nbytes = partition_bytes(node, box, regions, weight_regions)
        dtype = node.output.dtype
        eff = gemm_efficiency(node, box, device)
        weighted = has_trainable_params(node)
        # dA, and dB (a weight's, or the other operand's)
        grads = 2 if weighted or node.kind in _TWO_OPERAND_KINDS else 1
        kernels, bwd_bytes, extra = (1, grads), 2 * nbytes, (0, 0)
        if node.kind == "attention" and self.attention == "flash" and (
                timed := self._flash(node, box, regions, flops, nbytes, dtype, device)) is not None:
            return timed
        if node.kind == "attention" and self.attention != "flash":
            count = box_numel(box[:-1]) * _span(regions[1][-2])  # every head's queries × keys
            kernels = MATH_ATTENTION_KERNELS
            extra = tuple(p * count * DTYPE_BYTES[dtype] for p in MATH_ATTENTION_PASSES)
            if self.attention == "megatron":  # dropout on P: its passes and its mask, a kernel each way
                extra = tuple(e + p * count * DTYPE_BYTES[dtype] + count * DROPOUT_MASK_BYTES
                              for e, p in zip(extra, DROPOUT_PASSES))
                kernels = tuple(k + 1 for k in kernels)
        # each gradient computed at its own rate: 2F at their harmonic mean, or F at dA's
        eff_f, eff_b = (None, None) if eff is None else (
            eff[0], 2 / (1 / eff[1] + 1 / eff[2]) if grads == 2 else eff[1])
        fwd = self.roofline(flops, nbytes + extra[0], dtype, device, kernels=kernels[0], efficiency=eff_f)
        if node.kind in _GATHER_KINDS:  # the dense gradient of the table is zeroed and written
            bwd_bytes += sum(box_numel(r) * DTYPE_BYTES[w.spec.dtype]
                             for w in node.weights if (r := weight_regions.get(w.role)) is not None)
        # attention's backward is 4 products to its forward's 2 (dQ, dK, dV, dP; Dao et al. 2022, Alg. 3)
        bwd = self.roofline(2 * flops if grads == 2 or node.kind == "attention" else flops,
                            bwd_bytes + extra[1], dtype, device, kernels=kernels[1], efficiency=eff_b)
        return fwd, bwd

    def _flash(self, node: OpNode, box: Box, regions: tuple[Box | None, ...], flops: float, nbytes: float,
               dtype: str, device: DeviceSpec) -> tuple[float, float] | None:
        """The flash kernel at FlashAttention-2's published rate on ``device``'s kind
        (``attention_efficiency.flash_rate``: by the keys the partition reads, head dim, causal
        mask), or None (no curve for the kind or dtype, or a mask: torch runs another kernel).
        Its work is the FLOPs the benchmark counts: the op's, times the share of queries × keys a
        causal mask leaves (the kernel skips the rest), forward once and backward
        ``FLASH_BACKWARD`` times (the scores recomputed), both at the curve's rate; one kernel
        each way."""
        if node.attrs.get("has_mask"):
            return None
        causal, keys = bool(node.attrs.get("is_causal")), regions[1][-2]
        rate = flash_rate(device.kind, dtype, _span(keys), node.input_specs[0].shape[-1], causal)
        if rate is None:
            return None
        work = flops * (causal_fraction(box[-2], keys, node.input_specs[1].shape[-2]) if causal else 1.0)
        eff = rate / device.flops_for(dtype)
        return (self.roofline(work, nbytes, dtype, device, efficiency=eff),
                self.roofline(FLASH_BACKWARD * work, 2 * nbytes, dtype, device, efficiency=eff))


def _span(interval: tuple[int, int]) -> int:
    return interval[1] - interval[0]


_FACTORIES: dict[str, Callable[..., CostModel]] = {"analytical": AnalyticalCostModel}
_SHARED: dict[Any, CostModel] = {}


def register_cost_model(name: str, factory: Callable[..., CostModel]) -> None:
    """Make ``get_cost_model(name, **kw)`` build ``factory(**kw)``. A model defined on top of
    this module registers itself (``simulator.profiled``: "profiled"; the ``simulator``
    package imports it), so this module never imports the models built on it."""
    _FACTORIES[name] = factory


def get_cost_model(name: str, **kw: Any) -> CostModel:
    """The cost model ``name`` ("analytical" | "profiled") built with ``kw``. Calls with the same
    (hashable) arguments share one instance, so its memo survives across simulations."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown cost model {name!r}: choose one of {', '.join(map(repr, _FACTORIES))}")
    try:
        key: Any = (name, tuple(sorted(kw.items())))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _SHARED:
        return _SHARED[key]
    model = factory(**kw)
    if key is not None:
        _SHARED[key] = model
    return model
