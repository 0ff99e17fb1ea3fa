"""Homogeneous clusters: ``nodes`` machines of ``per_node`` copies of one device, joined inside
a node by a mesh or a switch and between nodes by one NIC per node or per device. The named
presets (``simulator.presets``) and the compact ``"cluster"`` JSON form
(``simulator.topology_json``) are built from it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from simulator.devices import DeviceSpec, Link
from simulator.errors import field_error

__all__ = ["INTRA_SHAPES", "INTER_SHAPES", "MAX_DEVICES", "ClusterParts", "Fabric", "cluster_parts"]

INTRA_SHAPES = ("mesh", "switch")
INTER_SHAPES = ("node-nic", "device-nic")
MAX_DEVICES = 512
"""Largest cluster built: routes are stored per ordered device pair, n² entries, so the time
and memory to build a topology grow with the square of its devices."""


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


class ClusterParts(NamedTuple):
    """What ``Topology`` is built from, less its name."""

    devices: tuple[DeviceSpec, ...]
    links: tuple[Link, ...]
    routes: dict[tuple[int, int], tuple[int, ...]]


def cluster_parts(name: str, device: DeviceSpec, nodes: int, per_node: int, intra: Fabric,
                  inter: Fabric | None = None) -> ClusterParts:
    """``nodes`` machines of ``per_node`` copies of ``device``. Inside a node a transfer crosses
    the mesh link ``src->dst``, or ``up:src`` then ``down:dst``; between nodes it crosses the
    sender's NIC out-link then the receiver's NIC in-link (the node's NIC, or the device's own).
    ``name`` names the cluster in errors."""
    where = f"cluster {name!r}"
    for what, v in (("nodes", nodes), ("per_node", per_node)):
        if not isinstance(v, int) or v < 1:
            raise field_error(where, what, v, "must be an integer >= 1")
    if intra.shape not in INTRA_SHAPES:
        raise field_error(where, "intra.shape", intra.shape, f"must be one of {INTRA_SHAPES}")
    if nodes > 1 and inter is None:
        raise field_error(where, "inter", None, "several nodes need an inter-node fabric")
    if inter is not None and inter.shape not in INTER_SHAPES:
        raise field_error(where, "inter.shape", inter.shape, f"must be one of {INTER_SHAPES}")
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
    return ClusterParts(devices, tuple(links), routes)
