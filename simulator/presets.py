"""Named machines — the FlexFlow paper's two clusters, DGX-style A100/H100 nodes, CPU processes on
this machine — and the homogeneous-cluster builder behind them (and behind the compact JSON form).

Figures come from public datasheets, cited beside each number. Latencies are per transfer, order
of magnitude estimates (small-message GPU-to-GPU latencies as reported by NCCL/OSU benchmarks:
a few µs inside a node, ~5 µs across InfiniBand); the profiler issue may calibrate them.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from simulator.devices import DeviceSpec, Link
from simulator.topology import Topology, _err
from simulator.topology_json import _device, _get, _link_extras

__all__ = ["PRESETS", "PATTERNS", "MAX_DEVICES", "INTRA_SHAPES", "INTER_SHAPES", "Fabric", "cluster",
           "cluster_from_json", "get_topology"]

INTRA_SHAPES = ("mesh", "switch")
INTER_SHAPES = ("node-nic", "device-nic")
MAX_DEVICES = 512
"""Largest cluster built here: routes are stored per ordered device pair (n² entries; 512
devices take ~2 s to build)."""


@dataclass(frozen=True)
class Fabric:
    """How the devices of a cluster reach each other at one level: inside a node, or between nodes."""

    shape: str
    """Inside a node: ``mesh`` (a direct link per ordered device pair: NVLink 1.0, shared memory) or
    ``switch`` (one up-link and one down-link per device: NVSwitch, a PCIe switch). Between nodes:
    ``node-nic`` (one NIC per node, its devices share it) or ``device-nic`` (one NIC per device)."""
    kind: str
    """Link family: ``nvlink``, ``nvswitch``, ``pcie``, ``ib``, ``shm``."""
    latency: float
    """Seconds per transfer at this level, split evenly over the route's hops (alpha)."""
    bandwidth: float
    """Bytes/s of each link, per direction (1 / beta)."""
    collective_bandwidth: float | None = None
    """Bytes/s of each link inside a ring collective (``Link.collective_bandwidth``; None: ``bandwidth``)."""
    send_bandwidth: float | None = None
    """Bytes/s the sender's host copies a message at (``Link.send_bandwidth``; None: not held)."""
    send_latency: float = 0.0
    """The sender's host seconds per message besides the copy (``Link.send_latency``)."""


def cluster(name: str, device: DeviceSpec, nodes: int, per_node: int, intra: Fabric,
            inter: Fabric | None = None) -> Topology:
    """``nodes`` machines of ``per_node`` copies of ``device``. Inside a node a transfer crosses
    the mesh link ``src->dst``, or ``up:src`` then ``down:dst``; between nodes it crosses the
    sender's NIC out-link then the receiver's NIC in-link (the node's NIC, or the device's own)."""
    where = f"cluster {name!r}"
    for what, v in (("nodes", nodes), ("per_node", per_node)):
        if not isinstance(v, int) or v < 1:
            raise _err(where, what, v, "must be an integer >= 1")
    if intra.shape not in INTRA_SHAPES:
        raise _err(where, "intra.shape", intra.shape, f"must be one of {INTRA_SHAPES}")
    if nodes > 1 and inter is None:
        raise _err(where, "inter", None, "several nodes need an inter-node fabric")
    if inter is not None and inter.shape not in INTER_SHAPES:
        raise _err(where, "inter.shape", inter.shape, f"must be one of {INTER_SHAPES}")
    n = nodes * per_node
    devices = tuple(replace(device, node=d // per_node) for d in range(n))
    links: list[Link] = []
    index: dict[str, int] = {}

    def add(link_name: str, fabric: Fabric, hops: int) -> None:
        index[link_name] = len(links)
        links.append(Link(link_name, fabric.kind, fabric.latency / hops, fabric.bandwidth, fabric.collective_bandwidth,
                          fabric.send_bandwidth, fabric.send_latency))

    mesh, k = intra.shape == "mesh", intra.kind
    if per_node > 1:
        for d in range(n):
            first = d - d % per_node
            for e in (range(first, first + per_node) if mesh else ()):
                if e != d:
                    add(f"{k}:{d}->{e}", intra, 1)
            if not mesh:
                add(f"{k}-up:{d}", intra, 2)
                add(f"{k}-down:{d}", intra, 2)
    per_device = inter is not None and inter.shape == "device-nic"
    if nodes > 1:
        for owner in range(n if per_device else nodes):
            tag = f"dev{owner}" if per_device else f"node{owner}"
            add(f"nic-out:{tag}", inter, 2)
            add(f"nic-in:{tag}", inter, 2)
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for s in range(n):
        for d in range(n):
            if s != d and s // per_node == d // per_node:
                routes[s, d] = (index[f"{k}:{s}->{d}"],) if mesh else (index[f"{k}-up:{s}"], index[f"{k}-down:{d}"])
            elif s != d:
                a, b = (f"dev{s}", f"dev{d}") if per_device else (f"node{s // per_node}", f"node{d // per_node}")
                routes[s, d] = (index[f"nic-out:{a}"], index[f"nic-in:{b}"])
    return Topology(name, devices, tuple(links), routes)


def _fabric(obj: Any, path: str, where: str, shapes: tuple[str, ...]) -> Fabric:
    shape = _get(obj, "shape", path, "str", where)
    if shape not in shapes:
        raise _err(where, f"{path}shape", shape, f"must be one of {shapes}")
    return Fabric(shape, _get(obj, "kind", path, "str", where), _get(obj, "latency", path, "num>=0", where),
                  _get(obj, "bandwidth", path, "num>0", where),
                  *_link_extras(obj, path, where))


def cluster_from_json(name: str, obj: Mapping[str, Any], where: str = "topology JSON") -> Topology:
    """The compact ``"cluster"`` object of a topology file (see :mod:`simulator.topology`)."""
    nodes, per_node = _get(obj, "nodes", "cluster.", "int>0", where), _get(obj, "per_node", "cluster.", "int>0", where)
    device = _device(_get(obj, "device", "cluster.", "object", where), "cluster.device.", where, node=False)
    intra = _fabric(_get(obj, "intra", "cluster.", "object", where), "cluster.intra.", where, INTRA_SHAPES)
    inter = (_fabric(_get(obj, "inter", "cluster.", "object", where), "cluster.inter.", where, INTER_SHAPES)
             if nodes > 1 or "inter" in obj else None)
    if nodes * per_node > MAX_DEVICES:
        raise _err(where, "cluster.nodes * cluster.per_node", nodes * per_node, f"must be <= {MAX_DEVICES}")
    return cluster(name, device, nodes, per_node, intra, inter)


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

A100 = DeviceSpec(  # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column
    kind="A100-SXM4-80GB",
    memory_bytes=80 * GiB,           # "80GB HBM2e" (nvidia-smi: 81920 MiB)
    peak_flops={"float32": 19.5e12,  # "FP32 19.5 TFLOPS"
                "tfloat32": 156e12,  # "Tensor Float 32 (TF32) 156 TFLOPS" (dense)
                "bfloat16": 312e12,  # "BFLOAT16 Tensor Core 312 TFLOPS" (dense)
                "float16": 312e12,   # "FP16 Tensor Core 312 TFLOPS" (dense)
                "float64": 9.7e12},  # "FP64 9.7 TFLOPS"
    memory_bandwidth=2.039e12,       # "GPU Memory Bandwidth 2,039 GB/s"
)
# NVLink 3: 12 links x 25 GB/s per direction = 300 GB/s per direction ("NVLink: 600GB/s" total),
# through NVSwitch (DGX A100 user guide). ~2 µs per transfer (estimate).
A100_NVSWITCH = Fabric("switch", "nvswitch", latency=2e-6, bandwidth=300e9)
# HDR InfiniBand 200 Gb/s, one ConnectX-6 per GPU (DGX A100 datasheet: "8x Single-Port Mellanox
# ConnectX-6 VPI 200Gb/s HDR InfiniBand") = 25 GB/s.
HDR_DEVICE_NIC = Fabric("device-nic", "ib", latency=5e-6, bandwidth=200e9 / 8)

H100 = DeviceSpec(  # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column
    kind="H100-SXM5-80GB",
    memory_bytes=80 * GiB,           # "GPU memory 80GB"
    peak_flops={"float32": 67e12,    # "FP32 67 teraFLOPS"
                "tfloat32": 494.7e12,  # "TF32 Tensor Core 989 teraFLOPS" is with sparsity: half dense
                "bfloat16": 989.4e12,  # "BFLOAT16 Tensor Core 1,979 teraFLOPS" with sparsity: half dense
                "float16": 989.4e12,   # "FP16 Tensor Core 1,979 teraFLOPS" with sparsity: half dense
                "float64": 34e12},     # "FP64 34 teraFLOPS"
    memory_bandwidth=3.35e12,        # "GPU memory bandwidth 3.35TB/s"
)
# NVLink 4: 18 links x 25 GB/s per direction = 450 GB/s per direction ("NVLink: 900GB/s" total).
H100_NVSWITCH = Fabric("switch", "nvswitch", latency=2e-6, bandwidth=450e9)
# NDR InfiniBand 400 Gb/s, one ConnectX-7 per GPU (DGX H100 datasheet: "8x single-port NVIDIA
# ConnectX-7 VPI, 400Gb/s InfiniBand") = 50 GB/s.
NDR_DEVICE_NIC = Fabric("device-nic", "ib", latency=5e-6, bandwidth=400e9 / 8)

_GPUS = {  # family: (device, intra, inter, largest per_node)
    "p100": (P100, P100_NVLINK, EDR_NODE_NIC, 4),
    "k80": (K80, K80_PCIE, FDR_NODE_NIC, 4),
    "a100": (A100, A100_NVSWITCH, HDR_DEVICE_NIC, 8),
    "h100": (H100, H100_NVSWITCH, NDR_DEVICE_NIC, 8),
}

# ROUGH figures, to be calibrated by a later issue: one core with AVX2 (2 FMA units x 8 float32
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
            raise _err("topology", "name", name, f"a {m[1]} node holds at most {largest} devices")
        if nodes * per_node > MAX_DEVICES:
            raise _err("topology", "name", name, f"{nodes * per_node} devices: at most {MAX_DEVICES}")
        return cluster(name, device, nodes, per_node, intra, inter)
    if m := _CPU_NAME.fullmatch(name):
        n = int(m[1])
        if n > MAX_DEVICES:
            raise _err("topology", "name", name, f"at most {MAX_DEVICES} processes")
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
