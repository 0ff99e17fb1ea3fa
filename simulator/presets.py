"""Named machines — the FlexFlow paper's two clusters, DGX-style A100/H100 nodes, CPU processes on
the local machine — built as homogeneous clusters (``simulator.cluster``), and ``get_topology``,
which finds one by name or reads a topology file.

Figures come from public datasheets, cited beside each number. Latencies are per transfer, order
of magnitude estimates (small-message GPU-to-GPU latencies as reported by NCCL/OSU benchmarks:
a few µs inside a node, ~5 µs across InfiniBand); ``soapsearch calibrate`` measures them.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from simulator.cluster import INTER_SHAPES, INTRA_SHAPES, MAX_DEVICES, MAX_MESH, Fabric, cluster_parts
from simulator.devices import DeviceSpec
from simulator.errors import field_error
from simulator.topology import Topology
from simulator.topology_json import read_cluster
from strategies.errors import PlanError

__all__ = ["A100_GEMM_HALF", "A100_NCCL_BUS_BANDWIDTH", "NCCL_OVERLAP_RATE", "PRESETS", "PATTERNS", "MAX_DEVICES",
           "INTRA_SHAPES", "INTER_SHAPES", "Fabric", "cluster", "check_plan_topology", "cluster_from_json",
           "get_topology"]


def cluster(name: str, device: DeviceSpec, nodes: int, per_node: int, intra: Fabric,
            inter: Fabric | None = None) -> Topology:
    """The Topology of ``simulator.cluster.cluster_parts``: ``nodes`` machines of ``per_node``
    copies of ``device``, joined by ``intra`` inside a node and ``inter`` between nodes."""
    return Topology(name, *cluster_parts(name, device, nodes, per_node, intra, inter))


def cluster_from_json(name: str, obj: Mapping[str, Any], where: str = "topology JSON") -> Topology:
    """The compact ``"cluster"`` object of a topology file (see :mod:`simulator.topology`)."""
    return Topology(*read_cluster(name, obj, where))


# ---- the machines ---------------------------------------------------------------------------
GiB = 1 << 30

P100 = DeviceSpec(  # NVIDIA Tesla P100 (SXM2, NVLink) datasheet, 2016
    kind="P100",
    memory_bytes=16 * GiB,         # "16 GB CoWoS HBM2"
    peak_flops={"float32": 10.6e12,  # "Single-Precision Performance 10.6 TeraFLOPS"
                "float16": 21.2e12,  # "Half-Precision Performance 21.2 TeraFLOPS"
                "float64": 5.3e12},  # "Double-Precision Performance 5.3 TeraFLOPS"
    memory_bandwidth=732e9,        # "Memory Bandwidth 732 GB/s"
)
# NVLink 1.0 (P100 whitepaper "NVIDIA Tesla P100", 2016, §NVLink): 4 links per GPU, each 20 GB/s per
# direction (40 GB/s bidirectional, 160 GB/s per GPU). 4 GPUs fully connected: one link per pair.
P100_NVLINK = Fabric("mesh", "nvlink", latency=2e-6, bandwidth=20e9)
# EDR InfiniBand 4x: 100 Gb/s data rate (InfiniBand Trade Association roadmap) = 12.5 GB/s; one
# NIC per node (FlexFlow, SysML 2019, §8: "100 GB/s EDR Infiniband"); ~5 µs GPU-to-GPU (estimate).
EDR_NODE_NIC = Fabric("node-nic", "ib", latency=5e-6, bandwidth=100e9 / 8)

# One device = one GK210 die (what CUDA shows as one GPU; a K80 board holds two). The paper's
# K80 cluster has 4 GPUs per node; we read them as 4 CUDA devices, 64 in all.
K80 = DeviceSpec(  # NVIDIA Tesla K80 datasheet, 2014: per-board figures halved per GK210
    kind="K80",
    memory_bytes=12 * GiB,         # "24 GB GDDR5" per board -> 12 GB per GPU
    peak_flops={"float32": 4.37e12,  # "8.73 TFLOPS single precision (GPU Boost)" per board
                "float64": 1.455e12},  # "2.91 TFLOPS double precision (GPU Boost)" per board
    memory_bandwidth=240e9,        # "480 GB/s" per board
)
# PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s per direction raw (PCI-SIG), ~12 GB/s
# achieved by cudaMemcpy; each die one up/down link to the switch (the board's two dies really
# share one x16 slot: an optimistic simplification). ~5 µs per transfer (estimate).
K80_PCIE = Fabric("switch", "pcie", latency=5e-6, bandwidth=12e9)
# FDR InfiniBand 4x: 4 x 14.0625 Gb/s signalling, 64b/66b -> 54.5 Gb/s data (IBTA) = 6.82 GB/s.
FDR_NODE_NIC = Fabric("node-nic", "ib", latency=5e-6, bandwidth=4 * 14.0625e9 * 64 / 66 / 8)

A100_GEMM_HALF = 1250.0
"""Hockney's n½ of a GPU's bf16 products over their reduction length K (a tile runs at
r∞·K/(K + n½), ``simulator.gemm_shape``, after tile and wave quantization over the SMs),
fitted on Narayanan et al.'s Table 1 rows of <= 128 GPUs (1.7B, 3.6B, 7.5B) with Megatron-LM's
attention kernels (``simulator.cost`` "megatron": dropout on the probabilities), its one fused
query-key-value product a layer (zoo gpt's ``fused_qkv``), their launch script's micro-batches
NCCL's bus bandwidth inside a node (``A100_NCCL_BUS_BANDWIDTH``) and a recomputed block's
reductions called again (rms log 0.0197: +1.8, +0.9, −2.7 %), and checked on
Korthikanti's and torchtitan's rows and Table 1's larger ones (``benchmarks/published_fit.py``,
benchmarks/README.md)."""

NCCL_OVERLAP_RATE = 1 / 1.189
"""The fraction of its rate a GPU's compute keeps while its own NCCL collectives run beside it
(``DeviceSpec.overlap_rate``): Lee et al., "Characterizing Compute-Communication Overlap in
GPU-Accelerated Distributed Deep Learning: Performance and Power Implications" (arXiv
2507.03114, 2025), abstract: overlapped with communication, GPT and LLaMA training's compute
ran "an average computational slowdown of 18.9%, with a maximum of 40.0%" against the same
compute alone, measured on 4 A100s, H100s, MI250s and MI210s. The mean over the four GPU types:
no per-type figure is taken here. The presets leave ``overlap_rate`` at 1: its passes run the
event loop twice more wherever compute runs beside a collective (the search's time), so it is
set where fidelity is measured (``benchmarks/published_runs.py``) or in a topology JSON's
device (``"overlap_rate"``)."""

A100 = DeviceSpec(  # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column
    kind="A100-SXM4-80GB",
    memory_bytes=80 * GiB,           # "80GB HBM2e" (nvidia-smi: 81920 MiB)
    peak_flops={"float32": 19.5e12,  # "FP32 19.5 TFLOPS"
                "tfloat32": 156e12,  # "Tensor Float 32 (TF32) 156 TFLOPS" (dense)
                "bfloat16": 312e12,  # "BFLOAT16 Tensor Core 312 TFLOPS" (dense)
                "float16": 312e12,   # "FP16 Tensor Core 312 TFLOPS" (dense)
                "float64": 9.7e12},  # "FP64 9.7 TFLOPS"
    memory_bandwidth=2.039e12,       # "GPU Memory Bandwidth 2,039 GB/s"
    # Hockney's r∞: the largest bf16 matmul rate found, 267.9 of 312 TFLOP/s (Bekman,
    # "ml-engineering", compute/accelerator, "Maximum Achievable Matmul FLOPS comparison table",
    # A100 SXM, CUDA 12.1)
    gemm_rate=267.9 / 312,
    gemm_half=A100_GEMM_HALF,
    sms=108,                         # A100 Tensor Core GPU Architecture whitepaper: "108 SMs"
)
# NVLink 3: 12 links x 25 GB/s per direction = 300 GB/s per direction ("NVLink: 600GB/s" total),
# through NVSwitch (DGX A100 user guide). ~2 µs per transfer (estimate). Inside NCCL's ring
# collectives a link carries less: ``A100_NCCL_BUS_BANDWIDTH``.
A100_NCCL_BUS_BANDWIDTH = 200e9
"""Bytes/s per GPU an NCCL ring all-reduce reaches among the 8 A100s of one NVSwitch node: its
"bus bandwidth" (nccl-tests' busbw = algbw · 2(n-1)/n, the B of the ring formula), measured
~200 GB/s on 8 x A100-SXM4-80GB (NVIDIA/nccl-tests issue #149, NCCL 2.18; issue #178: 208 GB/s)
of the links' 300: the ring's reduction and copy kernels, not the links, bound it."""
A100_NVSWITCH = Fabric("switch", "nvswitch", latency=2e-6, bandwidth=300e9, collective_bandwidth=A100_NCCL_BUS_BANDWIDTH)
# HDR InfiniBand 200 Gb/s, one ConnectX-6 per GPU (DGX A100 datasheet: "8x Single-Port Mellanox
# ConnectX-6 VPI 200Gb/s HDR InfiniBand") = 25 GB/s.
HDR_DEVICE_NIC = Fabric("device-nic", "ib", latency=5e-6, bandwidth=200e9 / 8)

H100 = DeviceSpec(  # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column
    kind="H100-SXM5-80GB",
    memory_bytes=80 * GiB,           # "GPU memory 80GB"
    peak_flops={"float32": 67e12,    # "FP32 67 teraFLOPS"
                # dense = half the datasheet's with-sparsity figures; the H100 architecture
                # whitepaper (SXM5): "989.4/1978.9" bf16 and fp16, "494.7/989.4" TF32
                "tfloat32": 494.7e12,  # "TF32 Tensor Core 989 teraFLOPS" is with sparsity: half dense
                "bfloat16": 989.4e12,  # "BFLOAT16 Tensor Core 1,979 teraFLOPS" with sparsity: half dense
                "float16": 989.4e12,   # "FP16 Tensor Core 1,979 teraFLOPS" with sparsity: half dense
                "float64": 34e12},     # "FP64 34 teraFLOPS"
    memory_bandwidth=3.35e12,        # "GPU memory bandwidth 3.35TB/s"
    gemm_rate=792.1 / 989.4,         # the same table, H100 SXM: 792.1 of 989 TFLOP/s (CUDA 12.1)
    gemm_half=A100_GEMM_HALF,        # no published H100 run fitted: the A100's, in K elements
    sms=132,                         # H100 architecture whitepaper, H100 SXM5: "132 SMs"
)
# NVLink 4: 18 links x 25 GB/s per direction = 450 GB/s per direction ("NVLink: 900GB/s" total).
H100_NVSWITCH = Fabric("switch", "nvswitch", latency=2e-6, bandwidth=450e9)
# NDR InfiniBand 400 Gb/s, one ConnectX-7 per GPU (DGX H100 datasheet: "8x single-port NVIDIA
# ConnectX-7 VPI, 400Gb/s InfiniBand") = 50 GB/s.
NDR_DEVICE_NIC = Fabric("device-nic", "ib", latency=5e-6, bandwidth=400e9 / 8)

# DGX nodes joined rail-optimised: the NIC of each node's i-th GPU on rail i's leaf switch, leaves
# and spines non-blocking (NVIDIA DGX SuperPOD reference architecture, DGX A100 and DGX H100
# editions, "compute fabric": eight rails, one per GPU/NIC); to another rail through NVLink first
# (NCCL's PXN, NCCL 2.12).
_GPUS = {  # family: (device, intra, inter, largest per_node)
    "p100": (P100, P100_NVLINK, EDR_NODE_NIC, 4),
    "k80": (K80, K80_PCIE, FDR_NODE_NIC, 4),
    "a100": (A100, A100_NVSWITCH, replace(HDR_DEVICE_NIC, shape="rail"), 8),
    "h100": (H100, H100_NVSWITCH, replace(NDR_DEVICE_NIC, shape="rail"), 8),
}

# Rough figures (``soapsearch calibrate`` measures the local machine's): one core with AVX2 (2 FMA units x 8 float32
# lanes x 2 FLOP x ~3 GHz ~ 96 GFLOP/s), ~15 GB/s of memory bandwidth for one core, and
# process-to-process shared memory (gloo) at ~20 µs, ~2 GB/s.
CPU_CORE_FLOPS = 1e11
CPU_CORE_MEMORY_BANDWIDTH = 15e9
SHM = Fabric("mesh", "shm", latency=20e-6, bandwidth=2e9)

PRESETS = ("p100-4x4", "k80-16x4", "a100-1x8", "a100-2x8", "h100-1x8", "h100-4x8", "local-cpu-1", "local-cpu-4")
"""Names worth listing; any name matching PATTERNS works."""
PATTERNS = ("p100-<N>x<M> (M <= 4)", "k80-<N>x<M> (M <= 4)", "a100-<N>x<M> (M <= 8)",
            "h100-<N>x<M> (M <= 8)", "local-cpu-<N>")
_GPU_NAME = re.compile(r"(p100|k80|a100|h100)-([1-9][0-9]*)x([1-9][0-9]*)")
_CPU_NAME = re.compile(r"local-cpu-([1-9][0-9]*)")


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): assume 16 GiB
        return 16 * GiB


@functools.lru_cache(maxsize=64)
def _preset(name: str) -> Topology | None:
    if m := _GPU_NAME.fullmatch(name):
        device, intra, inter, largest = _GPUS[m[1]]
        nodes, per_node = int(m[2]), int(m[3])
        if per_node > largest:
            raise field_error("topology", "name", name, f"a {m[1]} node holds at most {largest} devices")
        if nodes * per_node > MAX_DEVICES:
            raise field_error("topology", "name", name, f"{nodes * per_node} devices: at most {MAX_DEVICES}")
        return cluster(name, device, nodes, per_node, intra, inter)
    if m := _CPU_NAME.fullmatch(name):
        n = int(m[1])
        if n > MAX_MESH:
            raise field_error("topology", "name", name, f"at most {MAX_MESH} processes")
        device = DeviceSpec("cpu", max(_ram_bytes() // n, 1), {"float32": CPU_CORE_FLOPS}, CPU_CORE_MEMORY_BANDWIDTH)
        return cluster(name, device, 1, n, SHM)
    return None


def get_topology(name_or_path: str | os.PathLike) -> Topology:
    """A preset by name (PRESETS, PATTERNS), else a topology JSON file (either form)."""
    if isinstance(name_or_path, str) and (topology := _preset(name_or_path.strip().lower())) is not None:
        return topology
    path = Path(name_or_path)
    if path.is_file():
        return Topology.load(path)
    raise ValueError(f"topology {str(name_or_path)!r}: neither a preset nor a file; presets: "
                     f"{', '.join(PRESETS)}; patterns: {', '.join(PATTERNS)} (N >= 1); "
                     "or a path to a soapsearch.topology JSON file")


def check_plan_topology(topology: Mapping[str, Any], where: str = "<plan>") -> None:
    """PlanError when a plan's ``topology`` object (``{"name", "num_devices"}``) names a
    topology — a preset, or a topology file that reads — with fewer devices than
    ``num_devices``: a plan runs one process per device, on devices its topology has. A name
    that is neither (a plan made for a machine described elsewhere) is not checked."""
    name, n = topology.get("name"), topology.get("num_devices")
    if not isinstance(name, str) or not isinstance(n, int):
        return
    try:
        found = _preset(name.strip().lower())
        if found is None and Path(name).is_file():
            found = Topology.load(name)
    except ValueError:  # a name that only looks like a preset, or a file that no longer reads
        return
    if found is not None and n > found.num_devices:
        raise PlanError(None, "topology.num_devices", n,
                        f"topology {name!r} has {found.num_devices} devices and a plan uses at most its "
                        f"topology's devices ({n} > {found.num_devices})", where)
