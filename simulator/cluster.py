"""Homogeneous clusters: ``nodes`` machines of ``per_node`` copies of one device, joined inside
a node by a mesh or a switch and between nodes by one NIC per node or per device, or by a
rail-optimised fabric. Routes follow a rule (``ClusterRoutes``), never a table per device pair,
so a cluster of thousands of devices is cheap to build and hold. The named
presets (``simulator.presets``) and the compact ``"cluster"`` JSON form
(``simulator.topology_json``) are built from it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from simulator.devices import DeviceSpec, Link
from simulator.errors import field_error

__all__ = ["INTRA_SHAPES", "INTER_SHAPES", "MAX_DEVICES", "MAX_MESH", "ClusterParts", "ClusterRoutes", "Fabric",
           "cluster_parts"]

INTRA_SHAPES = ("mesh", "switch")
INTER_SHAPES = ("node-nic", "device-nic", "rail")
MAX_DEVICES = 16384
"""Largest cluster built (2,048 nodes of 8): links grow with the devices, routes are a rule."""
MAX_MESH = 512
"""Most devices in one mesh node: a mesh has a link per ordered pair, per_node² of them."""


@dataclass(frozen=True)
class Fabric:
    """How the devices of a cluster reach each other at one level: inside a node, or between nodes."""

    shape: str
    """Inside a node: ``mesh`` (a direct link per ordered device pair: NVLink 1.0, shared memory) or
    ``switch`` (one up-link and one down-link per device: NVSwitch, a PCIe switch). Between nodes:
    ``node-nic`` (one NIC per node, its devices share it), ``device-nic`` (one NIC per device, a
    non-blocking fabric between them) or ``rail`` (rail-optimised: one NIC per device, the NIC of
    each node's i-th device on rail i's leaf switch, NVIDIA DGX SuperPOD reference architecture; a
    transfer to another rail first crosses the node to its device on the destination's rail, as
    NCCL's PXN does, then that rail)."""
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
    routes: Mapping[tuple[int, int], tuple[int, ...]]


class ClusterRoutes(Mapping):
    """The routes of ``cluster_parts``'s cluster as a rule: ``(src, dst)`` -> link indices, for
    every ordered pair of distinct devices, computed on lookup from each device's own links
    (memory grows with the devices, not their pairs)."""

    def __init__(self, per_node: int, n: int, mesh: dict[tuple[int, int], int] | None,
                 up: tuple[int, ...], down: tuple[int, ...], nic_out: tuple[int, ...], nic_in: tuple[int, ...],
                 nic_of: str) -> None:
        self.per_node, self.n, self._mesh = per_node, n, mesh
        self._up, self._down, self._out, self._in, self.nic_of = up, down, nic_out, nic_in, nic_of
        self.key = (per_node, n, nic_of, mesh is not None)
        self._mesh_table: np.ndarray | None = None  # mesh[s, d] as an n x per_node array, made when first used
        self._arrays: tuple[np.ndarray, ...] | None = None  # up, down, out, in as arrays, made when first used

    def _as_arrays(self) -> tuple[np.ndarray, ...]:
        """``_up``, ``_down``, ``_out``, ``_in`` as int64 arrays, made once (``links_array`` is
        called once per copy of a fold: 8,192 times at 8,192 devices)."""
        if self._arrays is None:
            self._arrays = tuple(np.asarray(x, dtype=np.int64) for x in (self._up, self._down, self._out, self._in))
        return self._arrays

    def _intra(self, s: int, d: int) -> tuple[int, ...]:
        return (self._mesh[s, d],) if self._mesh is not None else (self._up[s], self._down[d])

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, ...]:
        s, d = key
        if not (0 <= s < self.n and 0 <= d < self.n) or s == d:
            raise KeyError(key)
        p = self.per_node
        if s // p == d // p:
            return self._intra(s, d)
        if self.nic_of == "node":
            return (self._out[s // p], self._in[d // p])
        if self.nic_of == "device" or s % p == d % p:
            return (self._out[s], self._in[d])
        via = s - s % p + d % p  # rail: to the source node's device on the destination's rail first
        return (*self._intra(s, via), self._out[via], self._in[d])

    def links_array(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """``self[src[i], dst[i]]`` for every i at once: row i the route's links in order, then -1
        (4 columns: a rail route crosses at most 4 links). Every pair distinct and in range."""
        s, d, p = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64), self.per_node
        out = np.full((len(s), 4), -1, dtype=np.int64)
        inter = s // p != d // p
        rail = inter & (s % p != d % p) if self.nic_of == "rail" else np.zeros(len(s), dtype=bool)
        via = np.where(rail, s - s % p + d % p, s)  # rail: to the source node's device on d's rail first
        hop = ~inter | rail  # rows whose route starts inside the source node
        width = self._intra_array(s[hop], np.where(inter, via, d)[hop], out, hop)
        nic = np.flatnonzero(inter)
        _, _, nic_out, nic_in = self._as_arrays()
        if self.nic_of == "node":
            a, b = nic_out[s[nic] // p], nic_in[d[nic] // p]
        else:
            a, b = nic_out[via[nic]], nic_in[d[nic]]
        out[nic, width[nic]], out[nic, width[nic] + 1] = a, b
        return out

    def _intra_array(self, s: np.ndarray, d: np.ndarray, out: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Write the intra-node hops ``s -> d`` into ``out``'s first columns at ``rows`` (a mask);
        return each row's hop count (0 where not written)."""
        width = np.zeros(len(out), dtype=np.int64)
        if self._mesh is not None:
            if self._mesh_table is None:
                table = np.full((self.n, self.per_node), -1, dtype=np.int64)
                for (a, b), link in self._mesh.items():
                    table[a, b % self.per_node] = link
                self._mesh_table = table
            out[rows, 0], width[rows] = self._mesh_table[s, d % self.per_node], 1
        else:
            up, down = self._as_arrays()[:2]
            out[rows, 0], out[rows, 1], width[rows] = up[s], down[d], 2
        return width

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((s, d) for s in range(self.n) for d in range(self.n) if s != d)

    def __len__(self) -> int:
        return self.n * (self.n - 1)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterRoutes):
            return (self.key, self._mesh, self._up, self._down, self._out, self._in) == \
                (other.key, other._mesh, other._up, other._down, other._out, other._in)
        return Mapping.__eq__(self, other)

    def __hash__(self) -> int:
        return hash((self.key, self._up, self._out))


def cluster_parts(name: str, device: DeviceSpec, nodes: int, per_node: int, intra: Fabric,
                  inter: Fabric | None = None) -> ClusterParts:
    """``nodes`` machines of ``per_node`` copies of ``device``. Inside a node a transfer crosses
    the mesh link ``src->dst``, or ``up:src`` then ``down:dst``; between nodes it crosses the
    sender's NIC out-link then the receiver's NIC in-link (the node's NIC, or the device's own;
    on a rail fabric to another rail, first the hop inside the source node to its device on the
    destination's rail). ``name`` names the cluster in errors."""
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
    if nodes * per_node > MAX_DEVICES:
        raise field_error(where, "nodes * per_node", nodes * per_node, f"at most {MAX_DEVICES} devices")
    if intra.shape == "mesh" and per_node > MAX_MESH:
        raise field_error(where, "per_node", per_node, f"a mesh node holds at most {MAX_MESH} devices "
                          "(a link per ordered pair)")
    n = nodes * per_node
    devices = tuple(replace(device, node=d // per_node) for d in range(n))
    links: list[Link] = []

    def add(link_name: str, fabric: Fabric, hops: int) -> int:
        links.append(Link(link_name, fabric.kind, fabric.latency / hops, fabric.bandwidth, fabric.collective_bandwidth,
                          fabric.send_bandwidth, fabric.send_latency))
        return len(links) - 1

    mesh, k = intra.shape == "mesh", intra.kind
    pairs: dict[tuple[int, int], int] | None = {} if mesh else None
    up: list[int] = []
    down: list[int] = []
    if per_node > 1:
        for d in range(n):
            first = d - d % per_node
            for e in (range(first, first + per_node) if mesh else ()):
                if e != d:
                    pairs[d, e] = add(f"{k}:{d}->{e}", intra, 1)
            if not mesh:
                up.append(add(f"{k}-up:{d}", intra, 2))
                down.append(add(f"{k}-down:{d}", intra, 2))
    nic_of = "node" if inter is None or inter.shape == "node-nic" else "device" if inter.shape == "device-nic" else "rail"
    out: list[int] = []
    in_: list[int] = []
    if nodes > 1:
        for owner in range(nodes if nic_of == "node" else n):
            tag = f"node{owner}" if nic_of == "node" else f"dev{owner}"
            out.append(add(f"nic-out:{tag}", inter, 2))
            in_.append(add(f"nic-in:{tag}", inter, 2))
    routes = ClusterRoutes(per_node, n, pairs, tuple(up), tuple(down), tuple(out), tuple(in_), nic_of)
    return ClusterParts(devices, tuple(links), routes)
