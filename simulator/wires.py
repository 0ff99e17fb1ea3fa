"""What a piece of some size costs sent from one device to another and its gradient sent back
(``Wire``), kept per (source, target, bytes): the transfers' tasks of a built block
(``simulator.tasks``) and of a copied one (``simulator.twins``) read them."""

from __future__ import annotations

from typing import NamedTuple

from simulator.comm import transfer_time
from simulator.topology import Topology

__all__ = ["Wire", "wire_of"]


class Wire(NamedTuple):
    """What a piece of some size costs sent from one device to another, and its gradient sent
    back: kept per (source, target, bytes) in ``TaskCache.wires``."""

    seconds: float
    """``transfer_time`` of the piece."""
    links: tuple[int, ...]
    """The resources it holds: its route's links (link l is resource num_devices + l)."""
    grad_seconds: float
    """``transfer_time`` of its gradient, on the route back."""
    grad_links: tuple[int, ...]
    """The resources the gradient holds."""
    send_hold: float
    """Seconds the piece holds its sender's host (``Link.send_time`` of the route's first link; 0: not held)."""
    grad_send_hold: float
    """Seconds the gradient holds its sender's host (0: not held)."""


def wire_of(topology: Topology, wires: dict, key: tuple[int, int, int]) -> Wire:
    """The ``Wire`` of (source, target, bytes) ``key``, kept in ``wires`` (``TaskCache.wires``)."""
    wire = wires.get(key)
    if wire is None:
        wire = wires[key] = _wire(topology, *key)
    return wire


def _wire(topology: Topology, src: int, dst: int, nbytes: int) -> Wire:
    """The ``Wire`` of ``nbytes`` sent ``src`` -> ``dst``."""
    n = topology.num_devices
    there, back = topology.route(src, dst), topology.route(dst, src)
    return Wire(transfer_time(topology, src, dst, nbytes), tuple(n + l for l in there),
                transfer_time(topology, dst, src, nbytes), tuple(n + l for l in back),
                topology.links[there[0]].send_time(nbytes) if there else 0.0,
                topology.links[back[0]].send_time(nbytes) if back else 0.0)
