"""``Topology.route_links`` and ``fold.link_maps`` (numpy) against the per-pair rule as loops:
the same routes link for link, the same maps or the same refusal, on every cluster shape."""

from __future__ import annotations

import random

import numpy as np
import pytest

from simulator.cluster import Fabric
from simulator.fold import link_maps
from simulator.fold_members import member_maps
from simulator.presets import cluster, get_topology
from simulator.topology import Topology
from strategies.symmetry import Copies

DEVICE = get_topology("a100-1x8").devices[0]
INTRA = {"mesh": Fabric("mesh", "nvlink", 2e-6, 2e10), "switch": Fabric("switch", "nvswitch", 2e-6, 3e11)}
INTER = {shape: Fabric(shape, "ib", 5e-6, 2.5e10) for shape in ("node-nic", "device-nic", "rail")}
SHAPES = [(intra, inter, nodes, per_node)
          for intra in INTRA for inter in INTER for nodes, per_node in ((4, 4), (3, 2), (2, 1))]


def _topology(intra: str, inter: str, nodes: int, per_node: int) -> Topology:
    return cluster(f"{intra}-{inter}", DEVICE, nodes, per_node, INTRA[intra], INTER[inter])


def reference_link_maps(topology: Topology, copies: Copies):
    """``link_maps``' rule as a per-pair loop (the reference): (owner, base) or None."""
    first = copies.copies[0]
    pairs = [(i, k) for i in range(len(first)) for k in range(len(first)) if i != k]
    routes = [topology.route(first[i], first[k]) for i, k in pairs]
    domain = {l: j for j, l in enumerate(sorted({l for r in routes for l in r}))}
    owner = np.full(len(topology.links), -1, dtype=np.int64)
    base = np.full(len(topology.links), -1, dtype=np.int64)
    for r, copy in enumerate(copies.copies):
        image = [-1] * len(domain)
        for (i, k), links in zip(pairs, routes):
            mapped = topology.route(copy[i], copy[k])
            if len(mapped) != len(links):
                return None
            for l0, l in zip(links, mapped):
                j = domain[l0]
                if image[j] not in (-1, l) or owner[l] not in (-1, r) or base[l] not in (-1, l0):
                    return None
                image[j], owner[l], base[l] = l, r, l0
    return owner, base


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_route_links_are_the_rules_routes(shape):
    topo = _topology(*shape)
    n = topo.num_devices
    src, dst = np.nonzero(~np.eye(n, dtype=bool))
    got = topo.route_links(src, dst)
    want = [topo.route(int(s), int(d)) for s, d in zip(src, dst)]
    assert [tuple(int(l) for l in row if l >= 0) for row in got] == want
    assert all((row[len(w):] == -1).all() for row, w in zip(got, want))
    table = Topology.from_json(topo.to_json())  # the same routes as a table
    read = table.route_links(src, dst)
    assert np.array_equal(read, got[:, :read.shape[1]]) and (got[:, read.shape[1]:] == -1).all()


def test_route_links_refuse_devices_out_of_range():
    topo = get_topology("a100-2x8")
    with pytest.raises(IndexError, match=r"dst devices 3..16 out of range 0..15"):
        topo.route_links(np.array([0, 1]), np.array([3, 16]))


@pytest.mark.parametrize("read_back", [False, True], ids=["rule", "table"])
def test_route_links_refuse_a_device_paired_with_itself(read_back):
    topo = get_topology("a100-1x4")
    topo = Topology.from_json(topo.to_json()) if read_back else topo
    with pytest.raises(ValueError, match=r"pair \(1, 1\) is not distinct: a device reaches itself over no link"):
        topo.route_links(np.array([0, 1]), np.array([2, 1]))


def _copies_cases(n: int, rng: random.Random):
    """Copies of several sizes: contiguous blocks, strided rows, and shuffled ones (most refused)."""
    for size in (d for d in (1, 2, 4, n // 2) if d and n % d == 0 and d < n):
        count = n // size
        yield Copies(tuple(tuple(range(r * size, (r + 1) * size)) for r in range(count)))  # blocks
        yield Copies(tuple(tuple(range(r, n, count)) for r in range(count)))  # strided
        perm = list(range(n))
        rng.shuffle(perm)
        yield Copies(tuple(tuple(perm[r * size:(r + 1) * size]) for r in range(count)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_link_maps_equal_the_per_pair_loop(shape):
    topo = _topology(*shape)
    rng = random.Random(hash(shape) & 0xFFFF)
    found = refused = 0
    for copies in _copies_cases(topo.num_devices, rng):
        link_maps.cache_clear()
        got, want = link_maps(topo, copies), reference_link_maps(topo, copies)
        assert (got is None) == (want is None), copies
        if got is not None:
            assert np.array_equal(got.owner, want[0]) and np.array_equal(got.base, want[1])
            found += 1
        else:
            refused += 1
    assert found and (refused or topo.num_devices < 4)


def test_preset_copies_map_as_the_per_pair_loop():
    """a100-4x8 (rail): 4 copies of 8 (one node each) map, and so do 8 copies strided over the
    nodes, with the per-pair loop's owners and bases (members: ``test_member_maps_refuse_...``)."""
    topo = get_topology("a100-4x8")
    for copies in (Copies(tuple(tuple(range(8 * r, 8 * r + 8)) for r in range(4))),
                   Copies(tuple(tuple(range(r, 32, 8)) for r in range(8)))):
        link_maps.cache_clear()
        got, want = link_maps(topo, copies), reference_link_maps(topo, copies)
        assert got is not None and np.array_equal(got.owner, want[0]) and np.array_equal(got.base, want[1])


class _Fold:
    """What ``member_maps`` reads of a ``MemberFold``: its member rows."""

    def __init__(self, rows):
        self.member_rows = rows


@pytest.mark.parametrize("inter, rows, crosses", [
    ("rail", tuple(tuple(range(m, 16, 4)) for m in range(4)), False),  # member m: each node's device m
    ("node-nic", tuple(tuple(range(m, 16, 4)) for m in range(2)), True),  # member 0 through member 1's node NICs
])
def test_member_maps_refuse_as_the_per_pair_check(inter, rows, crosses):
    topo = _topology("switch", inter, 4, 4)
    link_maps.cache_clear()
    member_maps.cache_clear()
    got = member_maps(topo, _Fold(rows))
    owner = reference_link_maps(topo, Copies(rows[1:]))
    assert owner is not None
    first = next(((a, b) for a in rows[0] for b in rows[0]
                  if a != b and any(owner[0][l] >= 0 for l in topo.route(a, b))), None)
    assert (first is not None) == crosses
    if crosses:
        assert got == f"member 0's route {first[0]} -> {first[1]} crosses a link of members 1..{len(rows) - 1}"
    else:
        assert np.array_equal(got.owner, owner[0])
