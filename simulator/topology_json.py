"""Reading a topology's JSON (either form, ``simulator.topology``'s docstring) into the fields
``Topology`` is built from: every field checked with its place, value and rule, and a key no
object takes refused with the closest one it does take."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from simulator.cluster import INTER_SHAPES, INTRA_SHAPES, MAX_DEVICES, Fabric, cluster_parts
from simulator.devices import OVERHEAD_FIELDS, DeviceSpec, Link
from simulator.errors import field_error
from strategies.graph import DTYPE_BYTES

__all__ = ["FORMAT", "VERSION", "TopologyFields", "read_cluster", "read_topology"]

FORMAT = "soapsearch.topology"
VERSION = 1


class TopologyFields(NamedTuple):
    """What ``Topology(name, devices, links, routes)`` is built from, read from its JSON."""

    name: str
    devices: tuple[DeviceSpec, ...]
    links: tuple[Link, ...]
    routes: dict[tuple[int, int], tuple[int, ...]]

_RULES = {
    "str": (lambda v: isinstance(v, str) and v != "", "must be a non-empty string"),
    "int>=0": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "must be an integer >= 0"),
    "int>0": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "must be an integer > 0"),
    "num>=0": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
               "must be a finite number >= 0"),
    "num>0": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
              "must be a finite number > 0"),
    "num>=1": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 1,
               "must be a finite number >= 1"),
    "list": (lambda v: isinstance(v, list), "must be a JSON list"),
    "object": (lambda v: isinstance(v, dict), "must be a JSON object"),
}


_DEVICE = ("kind", "memory_bytes", "peak_flops", "memory_bandwidth", *OVERHEAD_FIELDS, "contention", "gemm_half",
           "gemm_rate", "overlap_rate", "sms")
_LINK_EXTRAS = ("collective_bandwidth", "send_bandwidth", "send_latency")
_KEYS = {  # the keys each object of the JSON may hold (the module docstring's)
    "a topology": ("format", "version", "name", "devices", "links", "routes", "cluster"),
    "a device": (*_DEVICE[:4], "node", *_DEVICE[4:]),
    "a cluster's device": _DEVICE,
    "a link": ("name", "kind", "latency", "bandwidth", *_LINK_EXTRAS),
    "a route": ("src", "dst", "links"),
    "a cluster": ("nodes", "per_node", "device", "intra", "inter"),
    "a fabric": ("shape", "kind", "latency", "bandwidth", *_LINK_EXTRAS),
    "peak_flops": (*DTYPE_BYTES, "tfloat32"),
}


def _known(obj: Mapping[str, Any], what: str, path: str, where: str) -> None:
    """ValueError naming the first key of ``obj`` that ``what`` (a ``_KEYS`` entry) does not take."""
    for key in (k for k in obj if k not in _KEYS[what]):
        near, value = difflib.get_close_matches(str(key), _KEYS[what], n=1), repr(obj[key])
        noun, hint = "dtype" if what == "peak_flops" else "key", f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{where}: {path}{key} = {value if len(value) <= 40 else value[:37] + '...'}: "
                         f"unknown {noun}{hint}; {what} takes only {', '.join(_KEYS[what])}")


def _get(obj: Any, key: str, path: str, rule: str, where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: {path}{key}: missing: this field is required")
    ok, text = _RULES[rule]
    if not ok(obj[key]):
        raise field_error(where, f"{path}{key}", obj[key], text)
    return obj[key]


def _items(obj: Any, key: str, where: str, rule: str = "object") -> list[tuple[str, Any]]:
    values = _get(obj, key, "", "list", where)
    for i, v in enumerate(values):
        if not _RULES[rule][0](v):
            raise field_error(where, f"{key}[{i}]", v, _RULES[rule][1])
    return [(f"{key}[{i}].", v) for i, v in enumerate(values)]


def _link_extras(obj: Any, path: str, where: str) -> tuple[float | None, float | None, float]:
    """A link's (or fabric's) optional collective_bandwidth, send_bandwidth and send_latency."""
    return (_get(obj, "collective_bandwidth", path, "num>0", where) if "collective_bandwidth" in obj else None,
            _get(obj, "send_bandwidth", path, "num>0", where) if "send_bandwidth" in obj else None,
            _get(obj, "send_latency", path, "num>=0", where) if "send_latency" in obj else 0.0)


def _device(obj: Any, path: str, where: str, node: bool = True) -> DeviceSpec:
    if not node and "node" in obj:
        raise field_error(where, f"{path}node", obj["node"],
                          "a cluster's devices take their node from per_node: leave it out")
    _known(obj, "a device" if node else "a cluster's device", path, where)
    flops = _get(obj, "peak_flops", path, "object", where)
    if not flops:
        raise field_error(where, f"{path}peak_flops", flops, "needs at least one dtype")
    _known(flops, "peak_flops", f"{path}peak_flops.", where)
    for dtype in flops:
        _get(flops, dtype, f"{path}peak_flops.", "num>0", where)
    return DeviceSpec(_get(obj, "kind", path, "str", where), _get(obj, "memory_bytes", path, "int>0", where),
                      dict(flops), _get(obj, "memory_bandwidth", path, "num>0", where),
                      _get(obj, "node", path, "int>=0", where) if node else 0,
                      *(_get(obj, k, path, "num>=0", where) if k in obj else 0.0
                        for k in OVERHEAD_FIELDS),
                      _get(obj, "contention", path, "num>=1", where) if "contention" in obj else 1.0,
                      _get(obj, "gemm_half", path, "num>=0", where) if "gemm_half" in obj else 0.0,
                      _get(obj, "gemm_rate", path, "num>0", where) if "gemm_rate" in obj else 1.0,
                      _get(obj, "overlap_rate", path, "num>0", where) if "overlap_rate" in obj else 1.0,
                      _get(obj, "sms", path, "int>=0", where) if "sms" in obj else 0)


def _link(obj: Any, path: str, where: str) -> Link:
    _known(obj, "a link", path, where)
    return Link(_get(obj, "name", path, "str", where), _get(obj, "kind", path, "str", where),
                _get(obj, "latency", path, "num>=0", where), _get(obj, "bandwidth", path, "num>0", where),
                *_link_extras(obj, path, where))


def _fabric(obj: Any, path: str, where: str, shapes: tuple[str, ...]) -> Fabric:
    shape = _get(obj, "shape", path, "str", where)
    if shape not in shapes:
        raise field_error(where, f"{path}shape", shape, f"must be one of {shapes}")
    return Fabric(shape, _get(obj, "kind", path, "str", where), _get(obj, "latency", path, "num>=0", where),
                  _get(obj, "bandwidth", path, "num>0", where),
                  *_link_extras(obj, path, where))


def read_cluster(name: str, obj: Mapping[str, Any], where: str = "topology JSON") -> TopologyFields:
    """The compact ``"cluster"`` object of a topology file (``simulator.topology``'s docstring),
    expanded by ``simulator.cluster.cluster_parts``."""
    _known(obj, "a cluster", "cluster.", where)
    for level in ("intra", "inter"):
        if isinstance(obj.get(level), dict):
            _known(obj[level], "a fabric", f"cluster.{level}.", where)
    nodes, per_node = _get(obj, "nodes", "cluster.", "int>0", where), _get(obj, "per_node", "cluster.", "int>0", where)
    device = _device(_get(obj, "device", "cluster.", "object", where), "cluster.device.", where, node=False)
    intra = _fabric(_get(obj, "intra", "cluster.", "object", where), "cluster.intra.", where, INTRA_SHAPES)
    inter = (_fabric(_get(obj, "inter", "cluster.", "object", where), "cluster.inter.", where, INTER_SHAPES)
             if nodes > 1 or "inter" in obj else None)
    if nodes * per_node > MAX_DEVICES:
        raise field_error(where, "cluster.nodes * cluster.per_node", nodes * per_node, f"must be <= {MAX_DEVICES}")
    return TopologyFields(name, *cluster_parts(name, device, nodes, per_node, intra, inter))


def read_topology(obj: Any, where: str = "topology JSON") -> TopologyFields:
    """The fields of a Topology from either JSON form (``simulator.topology``'s docstring);
    ValueError names the place, the field, the value and the rule."""
    if not isinstance(obj, dict):
        raise field_error(where, "json", type(obj).__name__, "a topology is a JSON object")
    if obj.get("format") != FORMAT:
        raise field_error(where, "format", obj.get("format"), f"must be {FORMAT!r}")
    if obj.get("version") != VERSION:
        raise field_error(where, "version", obj.get("version"), f"this soapsearch reads version {VERSION} only")
    _known(obj, "a topology", "", where)
    name = _get(obj, "name", "", "str", where)
    if "cluster" in obj:
        extra = [k for k in ("devices", "links", "routes") if k in obj]
        if extra:
            raise field_error(where, "cluster", "...",
                              f"give either cluster or devices/links/routes, not both ({extra})")
        return read_cluster(name, _get(obj, "cluster", "", "object", where), where)
    devices = [_device(v, p, where) for p, v in _items(obj, "devices", where)]
    links = [_link(v, p, where) for p, v in _items(obj, "links", where)]
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for p, v in _items(obj, "routes", where):
        _known(v, "a route", p, where)
        key = (_get(v, "src", p, "int>=0", where), _get(v, "dst", p, "int>=0", where))
        hops = _get(v, "links", p, "list", where)
        for j in hops:
            if not _RULES["int>=0"][0](j):
                raise field_error(where, f"{p}links", hops, f"link index {j!r} is not an integer >= 0")
        if key in routes:
            raise field_error(where, p[:-1], v, f"a second route from device {key[0]} to device {key[1]}")
        routes[key] = tuple(hops)
    return TopologyFields(name, tuple(devices), tuple(links), routes)
