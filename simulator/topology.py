"""The machine a plan runs on: devices, one-direction links, and the route between any two devices.

JSON (format ``soapsearch.topology``, version 1), explicit form — what ``to_json`` writes::

    {"format": "soapsearch.topology", "version": 1, "name": "two-p100",
     "devices": [{"kind": "P100", "memory_bytes": 17179869184, "peak_flops": {"float32": 1.06e13},
                  "memory_bandwidth": 7.32e11, "node": 0}, ...],
     (optional per device: "task_overhead", "message_overhead", "exchange_overhead", "collective_overhead", seconds,
      default 0; "contention", the slowdown when its node's devices compute at once, default 1;
      "gemm_half", the smallest matrix-product dimension (or, with "sms", the reduction length K)
      at half the peak, default 0: not modelled;
      "gemm_rate", the fraction of the peak large products reach, default 1; "overlap_rate", the
      fraction of its rate compute keeps beside the device's collectives, default 1; "sms", a GPU's
      streaming multiprocessors, default 0: products by their smallest dimension, not their shape)
     "links": [{"name": "nvlink:0->1", "kind": "nvlink", "latency": 2e-06, "bandwidth": 2e10}, ...],
     (optional per link: "collective_bandwidth", bytes/s inside a ring collective, default bandwidth;
      "send_bandwidth" and "send_latency": a message holds the sender's host send_latency + bytes /
      send_bandwidth seconds (gloo on CPU), default: not held)
     "routes": [{"src": 0, "dst": 1, "links": [0]}, {"src": 1, "dst": 0, "links": [1]}]}

Compact form, for hand-written homogeneous clusters: ``"cluster"`` in place of devices, links and
routes, expanded by :func:`simulator.cluster.cluster_parts` (``inter`` may be left out when ``nodes`` is
1; ``intra`` is unused when ``per_node`` is 1)::

    {"format": "soapsearch.topology", "version": 1, "name": "my-a100s",
     "cluster": {"nodes": 2, "per_node": 8, "device": {<a device as above, without "node">},
                 "intra": {"shape": "switch", "kind": "nvswitch", "latency": 2e-06, "bandwidth": 3e11},
                 "inter": {"shape": "device-nic", "kind": "ib", "latency": 5e-06, "bandwidth": 2.5e10}}}

A key not named here is an error, not ignored: a typo in an optional field (``"contension"``) would
otherwise leave its default in place unseen. ``peak_flops`` keys are the dtypes of
``strategies.graph.DTYPE_BYTES`` and ``tfloat32`` (a datasheet figure; no tensor has that dtype).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from simulator.cluster import ClusterRoutes
from simulator.devices import OVERHEAD_FIELDS, DeviceSpec, Link
from simulator.errors import field_error
from simulator.topology_json import FORMAT, VERSION, read_topology
from strategies.serialize import atomic_write_text

__all__ = ["FORMAT", "VERSION", "Topology"]


@dataclass(frozen=True, repr=False)
class Topology:
    """Devices, links, and for every ordered pair of distinct devices the links a transfer
    crosses. Immutable; per-route latency sums and bottleneck bandwidths are precomputed."""

    name: str
    """Preset name (``p100-4x4``) or the file's ``name``; recorded in plans."""
    devices: tuple[DeviceSpec, ...]
    """Device ``d`` is ``devices[d]``; ``devices[d].node`` is its machine."""
    links: tuple[Link, ...]
    """One direction of one physical link each; routes refer to them by index."""
    routes: Mapping[tuple[int, int], tuple[int, ...]]
    """``(src, dst)`` -> link indices crossed in order, for every ordered pair ``src != dst``: a
    table, or a cluster's rule (``simulator.cluster.ClusterRoutes``: nothing stored per pair)."""
    _route: tuple[tuple[int, ...], ...] = field(init=False, compare=False)
    _lat: tuple[float, ...] = field(init=False, compare=False)
    _bw: tuple[float, ...] = field(init=False, compare=False)
    _ring_bw: tuple[float, ...] = field(init=False, compare=False)
    _nodes: tuple[tuple[int, ...], ...] = field(init=False, compare=False)
    _hash: int = field(init=False, compare=False)
    _memo: dict | None = field(init=False, compare=False, default=None)

    def __post_init__(self) -> None:
        where, devices, links = f"topology {self.name!r}", tuple(self.devices), tuple(self.links)
        if not devices:
            raise field_error(where, "devices", [], "a topology needs at least one device")
        for d, dev in enumerate(devices):
            if not isinstance(dev, DeviceSpec) or dev.node < 0:
                raise field_error(where, f"devices[{d}]", dev, "must be a DeviceSpec with node >= 0")
        slowed = [next((d for d, dev in enumerate(devices) if getattr(dev, f) != 1.0), None)
                  for f in ("contention", "overlap_rate")]
        if None not in slowed:
            c, o = slowed
            raise field_error(where, f"devices[{o}].overlap_rate", devices[o].overlap_rate,
                              f"devices[{c}] has contention {devices[c].contention}: a topology slows compute by "
                              "contention or beside its collectives, not both")
        seen: dict[str, int] = {}
        for j, link in enumerate(links):
            if not isinstance(link, Link):
                raise field_error(where, f"links[{j}]", link, "must be a Link")
            if link.name in seen:
                raise field_error(where, f"links[{j}].name", link.name, f"link names are unique; links[{seen[link.name]}] has it too")
            seen[link.name] = j
        n = len(devices)
        if isinstance(self.routes, ClusterRoutes):
            self._init_rule(devices, links)
            return
        table: list[tuple[int, ...]] = [()] * (n * n)
        for key, hops in self.routes.items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) and 0 <= k < n for k in key)):
                raise field_error(where, "routes key", key, f"must be a pair (src, dst) of device indices 0..{n - 1}")
            src, dst = key
            hops = tuple(hops)
            what = f"route {src}->{dst}"
            for j in hops:
                if not isinstance(j, int) or not 0 <= j < len(links):
                    raise field_error(where, what, list(hops), f"link index {j!r} does not exist ({len(links)} links: 0..{len(links) - 1})")
            if src == dst and hops:
                raise field_error(where, what, list(hops), "a device reaches itself over no link")
            if src != dst and not hops:
                raise field_error(where, what, [], "a route between distinct devices crosses at least one link")
            if len(set(hops)) != len(hops):
                raise field_error(where, what, list(hops), "a route crosses each link at most once")
            table[src * n + dst] = hops
        missing = [(s, d) for s in range(n) for d in range(n) if s != d and not table[s * n + d]]
        if missing:
            (s, d), more = missing[0], f" (and {len(missing) - 1} more pairs)" if len(missing) > 1 else ""
            raise ValueError(f"{where}: routes: no route from device {s} to device {d}{more}: "
                             "every ordered pair of distinct devices needs one")
        inf = math.inf
        self._set_common(devices, links)
        set_ = object.__setattr__
        set_(self, "routes", MappingProxyType({(s, d): table[s * n + d] for s in range(n) for d in range(n) if s != d}))
        set_(self, "_route", tuple(table))
        set_(self, "_lat", tuple(sum(links[j].latency for j in r) for r in table))
        set_(self, "_bw", tuple(min((links[j].bandwidth for j in r), default=inf) for r in table))
        set_(self, "_ring_bw", tuple(min((links[j].ring_bandwidth for j in r), default=inf) for r in table))

    def _set_common(self, devices: tuple[DeviceSpec, ...], links: tuple[Link, ...]) -> None:
        """Devices, links, nodes and the hash: what a table and a rule set alike."""
        by_node: dict[int, list[int]] = {}
        for d, dev in enumerate(devices):
            by_node.setdefault(dev.node, []).append(d)
        set_ = object.__setattr__
        set_(self, "devices", devices)
        set_(self, "links", links)
        set_(self, "_nodes", tuple(tuple(by_node[k]) for k in sorted(by_node)))
        set_(self, "_hash", hash((self.name, len(devices), tuple(link.name for link in links))))

    def _init_rule(self, devices: tuple[DeviceSpec, ...], links: tuple[Link, ...]) -> None:
        """A cluster's routes: no per-pair table; ``route*`` compute each pair's on call."""
        where, routes = f"topology {self.name!r}", self.routes
        if routes.n != len(devices):
            raise field_error(where, "routes", f"a rule for {routes.n} devices", f"the topology has {len(devices)}")
        self._set_common(devices, links)
        for name in ("_route", "_lat", "_bw", "_ring_bw"):
            object.__setattr__(self, name, None)
        object.__setattr__(self, "_memo", {})

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Topology({self.name!r}: {self.num_devices} devices, {len(self._nodes)} nodes, {len(self.links)} links)"

    def __reduce__(self):  # pickle through JSON: DeviceSpec's read-only mapping does not pickle
        if isinstance(self.routes, ClusterRoutes):  # devices and links as JSON, the rule as itself
            return (_with_rule, ({**self.to_json(routes=False), "routes": []}, self.routes))
        return (Topology.from_json, (self.to_json(),))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Device indices of each node, nodes in ascending node id."""
        return self._nodes

    @property
    def node_size(self) -> int | None:
        """Devices per node when every node has as many, else None."""
        sizes = {len(members) for members in self._nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def node_of(self, device: int) -> int:
        return self.devices[device].node

    def _index(self, src: int, dst: int) -> int:
        n = len(self.devices)
        if not (0 <= src < n and 0 <= dst < n):
            raise IndexError(f"topology {self.name!r}: device pair ({src}, {dst}) out of range 0..{n - 1}")
        return src * n + dst

    def _ruled(self, i: int) -> tuple[tuple[int, ...], float, float, float]:
        """A cluster rule's route ``i`` (= src * n + dst) with its latency, bandwidth and ring
        bandwidth, computed as the table's are, on first use (kept for the pairs used)."""
        got = self._memo.get(i)
        if got is None:
            src, dst = divmod(i, len(self.devices))
            r = self.routes[src, dst] if src != dst else ()
            links, inf = self.links, math.inf
            got = self._memo[i] = (r, sum(links[j].latency for j in r), min((links[j].bandwidth for j in r), default=inf),
                                   min((links[j].ring_bandwidth for j in r), default=inf))
        return got

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """Indices into ``links`` a transfer from ``src`` to ``dst`` crosses, in order."""
        i = self._index(src, dst)
        return self._ruled(i)[0] if self._route is None else self._route[i]

    def route_links(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """``route(src[i], dst[i])`` for every i at once, as rows of link indices padded with -1
        (every pair distinct): a cluster's rule computes them with numpy, a table is read."""
        if (same := np.flatnonzero(np.asarray(src) == np.asarray(dst))).size:
            raise ValueError(f"topology {self.name!r}: route_links: pair ({src[same[0]]}, {dst[same[0]]}) is not "
                             "distinct: a device reaches itself over no link")
        if isinstance(self.routes, ClusterRoutes):
            n = len(self.devices)
            for what, x in (("src", src), ("dst", dst)):
                if len(x) and not (0 <= np.min(x) and np.max(x) < n):
                    raise IndexError(f"topology {self.name!r}: {what} devices {np.min(x)}..{np.max(x)} "
                                     f"out of range 0..{n - 1}")
            return self.routes.links_array(src, dst)
        rows = [self.route(int(a), int(b)) for a, b in zip(src, dst)]
        out = np.full((len(rows), max(map(len, rows), default=0)), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out

    def route_latency(self, src: int, dst: int) -> float:
        """Sum of the route's link latencies (0 when src == dst); precomputed."""
        i = self._index(src, dst)
        return self._ruled(i)[1] if self._lat is None else self._lat[i]

    def route_bandwidth(self, src: int, dst: int) -> float:
        """The route's slowest link bandwidth (inf when src == dst); precomputed."""
        i = self._index(src, dst)
        return self._ruled(i)[2] if self._bw is None else self._bw[i]

    def route_ring_bandwidth(self, src: int, dst: int) -> float:
        """The route's slowest ``Link.ring_bandwidth``: what a ring collective's step between
        the two gets (inf when src == dst); precomputed."""
        i = self._index(src, dst)
        return self._ruled(i)[3] if self._ring_bw is None else self._ring_bw[i]

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self, routes: bool = True) -> dict[str, Any]:
        """The explicit JSON form (see the module docstring); ``routes=False`` leaves routes out."""
        return {
            "format": FORMAT, "version": VERSION, "name": self.name,
            "devices": [{"kind": d.kind, "memory_bytes": d.memory_bytes, "peak_flops": dict(d.peak_flops),
                         "memory_bandwidth": d.memory_bandwidth, "node": d.node,
                         **{k: getattr(d, k) for k in OVERHEAD_FIELDS if getattr(d, k)},
                         **({"contention": d.contention} if d.contention != 1.0 else {}),
                         **({"gemm_half": d.gemm_half} if d.gemm_half else {}),
                         **({"gemm_rate": d.gemm_rate} if d.gemm_rate != 1.0 else {}),
                         **({"overlap_rate": d.overlap_rate} if d.overlap_rate != 1.0 else {}),
                         **({"sms": d.sms} if d.sms else {})} for d in self.devices],
            "links": [{"name": k.name, "kind": k.kind, "latency": k.latency, "bandwidth": k.bandwidth,
                       **({"collective_bandwidth": k.collective_bandwidth}
                          if k.collective_bandwidth is not None else {}),
                       **({"send_bandwidth": k.send_bandwidth, "send_latency": k.send_latency}
                          if k.send_bandwidth is not None else {})}
                      for k in self.links],
            **({"routes": [{"src": s, "dst": d, "links": list(r)} for (s, d), r in sorted(self.routes.items())]}
               if routes else {}),
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "topology JSON") -> Topology:
        """Build from either JSON form (``simulator.topology_json``); ValueError names the
        field, the value and the rule."""
        fields = read_topology(obj, where)
        try:
            return cls(*fields)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the explicit JSON form atomically (a temp file beside ``path``, then os.replace)."""
        obj = self.to_json()
        body = [f" {json.dumps(k)}: " + ("[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
                                         if isinstance(v, list) else json.dumps(v)) for k, v in obj.items()]
        atomic_write_text(path, "{\n" + ",\n".join(body) + "\n}\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Topology:
        where = f"topology file {str(path)!r}"
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{where}: cannot read it: {e.strerror}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: line {e.lineno} column {e.colno}: not valid JSON: {e.msg}") from None
        return cls.from_json(obj, where)

    # ---- summary ----------------------------------------------------------------------------
    def describe(self) -> str:
        """A few lines for people: devices per node, link kinds, route classes."""
        size = self.node_size
        k = len(self._nodes)
        shape = f"{k} node{'s' * (k > 1)}" + (f" x {size}" if size else " of unequal sizes")
        lines = [f"topology {self.name!r}: {self.num_devices} devices in {shape}"]
        groups: list[tuple[list[int], str]] = []
        for members in self._nodes:
            counts = Counter(_device_text(self.devices[d]) for d in members)
            text = "; ".join(f"{c} x {t}" for t, c in counts.items())
            if groups and groups[-1][1] == text:
                groups[-1][0].append(self.devices[members[0]].node)
            else:
                groups.append(([self.devices[members[0]].node], text))
        for ids, text in groups:
            label = f"node {ids[0]}" if len(ids) == 1 else f"nodes {ids[0]}..{ids[-1]} (each)"
            lines.append(f"  {label}: {text}")
        kinds = Counter((k.kind, k.latency, k.bandwidth, k.collective_bandwidth, k.send_bandwidth, k.send_latency)
                        for k in self.links)
        lines.append(f"  links: {len(self.links)}" + ("" if kinds else " (a single device needs none)"))
        for (kind, lat, bw, ring, send_bw, send_lat), c in kinds.items():
            lines.append(f"    {c:4d} x {kind}: {_us(lat)}, {_gbs(bw)} per direction"
                         + (f", {_gbs(ring)} in a ring collective" if ring is not None else "")
                         + (f"; a send holds the sender {_us(send_lat)} + bytes at {_gbs(send_bw)}"
                            if send_bw is not None else ""))
        n = self.num_devices
        # a cluster's rule treats every node alike: the first node's devices as sources show every route class
        sources = self._nodes[0] if isinstance(self.routes, ClusterRoutes) else range(n)
        for label, same in (("inside a node", True), ("between nodes", False)):
            pairs = [(s, d) for s in sources for d in range(n)
                     if s != d and (self.devices[s].node == self.devices[d].node) == same]
            if pairs:
                hops = sorted({len(self.route(s, d)) for s, d in pairs})
                lat = sorted({self.route_latency(s, d) for s, d in pairs})
                bw = sorted({self.route_bandwidth(s, d) for s, d in pairs})
                hop_text = str(hops[0]) if len(hops) == 1 else f"{hops[0]}-{hops[-1]}"
                lines.append(f"  route {label}: {hop_text} link(s), {_us(lat[-1])} latency, {_gbs(bw[0])} bottleneck"
                             + (" (worst pair)" if len(lat) > 1 or len(bw) > 1 else ""))
        return "\n".join(lines)


def _device_text(d: DeviceSpec) -> str:
    flops = ", ".join(f"{v / 1e12:.3g} TFLOP/s {k}" for k, v in d.peak_flops.items())
    shared = f", {d.contention:.3g}x slower when its node's devices compute at once" if d.contention != 1.0 else ""
    rate = f"{d.gemm_rate:.3g} of " if d.gemm_rate != 1.0 else ""
    if d.gemm_half:
        shared += (f", {d.sms} SMs, half {rate}its peak at products {d.gemm_half:.3g} deep" if d.sms
                   else f", half {rate}its peak at products of {d.gemm_half:.3g} rows")
    return f"{d.kind} ({d.memory_bytes / 2**30:.3g} GiB, {flops}, {_gbs(d.memory_bandwidth)} memory{shared})"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs"


def _gbs(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:.4g} GB/s"


def _with_rule(obj: dict[str, Any], routes: ClusterRoutes) -> Topology:
    """A pickled cluster topology: ``obj``'s devices and links (explicit JSON, no routes) and its rule."""
    name, devices, links, _ = read_topology(obj, "pickled topology")
    return Topology(name, devices, links, routes)


# Pickles whose reduce names ``simulator.topology._from_json`` load through this alias.
def _from_json(obj: Any, where: str = "topology JSON") -> Topology:
    """``Topology.from_json`` under the name some pickles of a Topology refer to."""
    return Topology.from_json(obj, where)
