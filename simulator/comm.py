"""Communication cost formulas over a Topology: point-to-point transfers, ring all-reduce and
ring all-gather (across nodes, NCCL's channels: one ring per NIC), and the executor's choice
between the last two for a small sum.

Pure functions of (topology, devices, bytes). They read the Topology's precomputed per-route
latency sums and bottleneck bandwidths, and cache each all-reduce group's ring, so the search
can call them many thousands of times per second.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence

from simulator.topology import Topology
from strategies.lowering import SMALL_SUM

__all__ = ["transfer_time", "allreduce_time", "allgather_time", "reduce_scatter_time", "collective_time",
           "group_sum_time", "ring_links", "ring_resources"]


def transfer_time(topology: Topology, src: int, dst: int, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from device ``src`` to ``dst``, alpha–beta (Hockney 1994,
    "The communication challenge for MPP"): ``sum(link.latency for link in route) + nbytes /
    min(link.bandwidth for link in route)``; 0 when ``src == dst`` or ``nbytes == 0``."""
    if nbytes < 0:
        raise ValueError(f"transfer {src}->{dst}: nbytes = {nbytes}: must be >= 0")
    if src == dst or nbytes == 0:
        return 0.0
    return topology.route_latency(src, dst) + nbytes / topology.route_bandwidth(src, dst)


@functools.lru_cache(maxsize=1 << 16)
def _ring(topology: Topology, devices: tuple[int, ...]) -> tuple[float, float, tuple[int, ...]]:
    """(largest latency, ring bandwidth, link indices) of a ring collective over ``devices``:
    the latency the largest over the caller's ring's neighbour routes; the bandwidth the
    slowest neighbour route's (``Topology.route_ring_bandwidth``: a link's
    ``collective_bandwidth`` where it has one), or NCCL's channels' where the group spans
    nodes alike (``_channels``)."""
    if len(set(devices)) != len(devices):
        raise ValueError(f"all-reduce group {list(devices)}: a device appears twice; "
                         "a replica group names each device once")
    pairs = [(devices[i], devices[(i + 1) % len(devices)]) for i in range(len(devices))]
    alpha = max(topology.route_latency(s, d) for s, d in pairs)
    bandwidth = min(topology.route_ring_bandwidth(s, d) for s, d in pairs)
    links = {j for s, d in pairs for j in topology.route(s, d)}
    channels = _channels(topology, devices)
    if channels is not None:
        bandwidth, rails = channels
        links.update(rails)
    return alpha, bandwidth, tuple(sorted(links))


def _channels(topology: Topology, devices: tuple[int, ...]) -> tuple[float, set[int]] | None:
    """(bandwidth, the rails' link indices) of NCCL's ring channels over a group of g >= 2
    devices on each of k >= 2 nodes, else None. NCCL builds one ring per channel, channel i
    leaving each node through its i-th member's NIC, each channel carrying 1/g of the data
    (NCCL's topology search, src/graph/search.cc and connect.cc: each channel's ring its own
    send and receive NIC per node), so the ring's bandwidth is min(the slowest
    route between members of one node, the sum over channels of each inter-node route's
    bandwidth, a link that several channels cross shared between them): g NICs' worth where
    each device has its own (DGX rails), one NIC's where a node shares one."""
    nodes: dict[int, list[int]] = {}
    for d in devices:
        nodes.setdefault(topology.node_of(d), []).append(d)
    members = list(nodes.values())
    g = len(members[0])
    if len(members) < 2 or g < 2 or any(len(m) != g for m in members):
        return None
    intra = min(topology.route_ring_bandwidth(m[i], m[(i + 1) % g]) for m in members for i in range(g))
    inter, rails = math.inf, set()
    for here, there in zip(members, members[1:] + members[:1]):
        routes = [topology.route(here[i], there[i]) for i in range(g)]
        crossings = Counter(j for r in routes for j in r)
        inter = min(inter, sum(min(topology.links[j].ring_bandwidth / crossings[j] for j in r) for r in routes))
        rails.update(crossings)
    return min(intra, inter), rails


def allreduce_time(topology: Topology, devices: Sequence[int], nbytes: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``devices`` (Patarasuk & Yuan 2009,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations"):
    ``2(n-1)/n * nbytes / B + 2(n-1) * alpha`` — n-1 reduce-scatter then n-1 all-gather steps,
    each moving nbytes/n — with B the slowest ring bandwidth (``Link.collective_bandwidth``, else
    its bandwidth; for a group of as many devices on each of several nodes, the bandwidth of
    NCCL's channels, one leaving each node per member: ``_channels``) and alpha the largest
    latency among the routes between ring neighbours (the given order, closing back to the
    first device). 0 for n <= 1 or nbytes == 0. The order is
    the caller's: listing a node's devices together crosses fewer NICs (see ring_links), though
    the formula only sees the worst neighbour pair."""
    ring = _collective("all-reduce", topology, devices, nbytes)
    if ring is None:
        return 0.0
    n, alpha, bandwidth = ring
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha


def allgather_time(topology: Topology, devices: Sequence[int], nbytes: float) -> float:
    """Seconds for a ring all-gather of ``nbytes`` per member over ``devices`` (Thakur,
    Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH",
    ring algorithm): ``(n-1) * alpha + (n-1) * nbytes / B`` — n-1 steps, each passing one
    member's block to the next device — with alpha and B as in ``allreduce_time`` (the ring's
    largest neighbour latency and smallest neighbour ring bandwidth). 0 for n <= 1 or nbytes == 0."""
    ring = _collective("all-gather", topology, devices, nbytes)
    if ring is None:
        return 0.0
    n, alpha, bandwidth = ring
    return (n - 1) * alpha + (n - 1) * nbytes / bandwidth


def reduce_scatter_time(topology: Topology, devices: Sequence[int], nbytes: float) -> float:
    """Seconds for a ring reduce-scatter of a tensor of ``nbytes`` over ``devices``, each
    member left with its 1/n (Patarasuk & Yuan 2009: an all-reduce's first half):
    ``(n-1) * alpha + (n-1)/n * nbytes / B``, alpha and B as in ``allreduce_time``. 0 for
    n <= 1 or nbytes == 0."""
    ring = _collective("reduce-scatter", topology, devices, nbytes)
    if ring is None:
        return 0.0
    n, alpha, bandwidth = ring
    return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth


def collective_time(topology: Topology, kind: str, devices: Sequence[int], nbytes: float) -> float:
    """Seconds of a ``strategies.lowered.Collective`` of ``kind`` over ``devices`` moving a
    region of ``nbytes``: a ring all-reduce (``allreduce_time``), reduce-scatter
    (``reduce_scatter_time``) or all-gather of each member's 1/n (``allgather_time``): the
    ring's (n-1)/n · nbytes per member each way, twice for the all-reduce."""
    if kind == "all_reduce":
        return allreduce_time(topology, devices, nbytes)
    if kind == "reduce_scatter":
        return reduce_scatter_time(topology, devices, nbytes)
    if kind == "all_gather":
        return allgather_time(topology, devices, nbytes / len(devices))
    raise ValueError(f"collective kind {kind!r} is not one of all_reduce, reduce_scatter, all_gather")


def _collective(what: str, topology: Topology, devices: Sequence[int],
                nbytes: float) -> tuple[int, float, float] | None:
    """(n, alpha, B) of a collective's ring, None when it moves nothing (n <= 1 or no bytes)."""
    if nbytes < 0:
        raise ValueError(f"{what} over {list(devices)}: nbytes = {nbytes}: must be >= 0")
    if len(devices) <= 1 or nbytes == 0:
        return None
    alpha, bandwidth, _ = _ring(topology, tuple(devices))
    return len(devices), alpha, bandwidth


def group_sum_time(topology: Topology, devices: Sequence[int], nbytes: float, numel: int) -> float:
    """Seconds for the executor's sum over ``devices`` of a tensor of ``numel`` elements
    (``nbytes`` per member): an all-gather (``allgather_time``) when ``numel * n <= SMALL_SUM``,
    else a ring all-reduce (``allreduce_time``)."""
    if numel * len(devices) <= SMALL_SUM:
        return allgather_time(topology, devices, nbytes)
    return allreduce_time(topology, devices, nbytes)


def ring_resources(topology: Topology, devices: Sequence[int]) -> tuple[int, ...]:
    """The task graph's resources of the ring over ``devices`` (``ring_links``, link l being
    resource ``num_devices`` + l), made once per group: a data-parallel bucket's ring over 8,192
    devices crosses some 30,000 links, and every bucket of the group runs on it."""
    return _ring_resources(topology, tuple(devices))


@functools.lru_cache(maxsize=1 << 12)
def _ring_resources(topology: Topology, devices: tuple[int, ...]) -> tuple[int, ...]:
    n = topology.num_devices
    return tuple([n + l for l in ring_links(topology, devices)])


def ring_links(topology: Topology, devices: Sequence[int]) -> tuple[int, ...]:
    """Indices of the links the ring over ``devices`` uses, ascending, each once (the simulator
    occupies them for the all-reduce); () for fewer than two devices."""
    if len(devices) <= 1:
        return ()
    return _ring(topology, tuple(devices))[2]
