import dataclasses
import time

import pytest

from simulator.comm import allgather_time, allreduce_time, group_sum_time, ring_links, transfer_time
from simulator.devices import DeviceSpec, Link
from simulator.presets import A100_NCCL_BUS_BANDWIDTH, get_topology
from simulator.topology import Topology

MB = 1e6


@pytest.fixture(scope="module")
def line():
    """Three devices in a line 0 - 1 - 2; 0 <-> 2 goes through both links of the line."""
    dev = DeviceSpec("x", 1 << 30, {"float32": 1e12}, 1e11)
    links = (Link("a:0->1", "nvlink", 1e-6, 10e9), Link("a:1->0", "nvlink", 1e-6, 10e9),
             Link("b:1->2", "pcie", 3e-6, 4e9), Link("b:2->1", "pcie", 3e-6, 5e9))
    routes = {(0, 1): (0,), (1, 0): (1,), (1, 2): (2,), (2, 1): (3,), (0, 2): (0, 2), (2, 0): (3, 1)}
    return Topology("line", (dev, dev, dev), links, routes)


def test_transfer_time_is_alpha_beta_over_the_route(line):
    assert transfer_time(line, 0, 1, 8 * MB) == pytest.approx(1e-6 + 8e6 / 10e9)  # 0.801 ms
    assert transfer_time(line, 0, 2, 8 * MB) == pytest.approx(4e-6 + 8e6 / 4e9)   # 2.004 ms: slowest link b
    assert transfer_time(line, 2, 0, 8 * MB) == pytest.approx(4e-6 + 8e6 / 5e9)   # 1.604 ms: other direction
    assert transfer_time(line, 1, 1, 8 * MB) == 0.0
    assert transfer_time(line, 0, 2, 0) == 0.0
    with pytest.raises(ValueError, match="nbytes = -1"):
        transfer_time(line, 0, 1, -1)


def test_transfer_on_presets_by_hand_and_inter_node_is_slower():
    p100 = get_topology("p100-4x4")
    assert transfer_time(p100, 0, 1, 100 * MB) == pytest.approx(2e-6 + 100e6 / 20e9)     # 5.002 ms NVLink
    assert transfer_time(p100, 0, 4, 100 * MB) == pytest.approx(5e-6 + 100e6 / 12.5e9)   # 8.005 ms EDR
    for name in ("k80-2x4", "a100-2x8", "h100-2x8"):
        t = get_topology(name)
        far = t.nodes[1][0]
        assert transfer_time(t, 0, far, MB) > transfer_time(t, 0, 1, MB) > 0
    h100 = get_topology("h100-2x8")
    assert transfer_time(h100, 0, 8, 50 * MB) == pytest.approx(5e-6 + 50e6 / 50e9)       # 1.005 ms NDR


def test_allreduce_matches_the_ring_formula_by_hand(line):
    # ring 0 -> 1 -> 2 -> 0: neighbour routes (0,1) a, (1,2) b, (2,0) b+a; B = 4 GB/s, alpha = 4 µs
    n, nbytes = 3, 12 * MB
    expected = 2 * (n - 1) / n * nbytes / 4e9 + 2 * (n - 1) * 4e-6   # 4 ms + 16 µs
    assert allreduce_time(line, [0, 1, 2], nbytes) == pytest.approx(expected)
    assert allreduce_time(line, (0, 1, 2), nbytes) == pytest.approx(4.016e-3)
    # two devices: ring 0 -> 1 -> 0 uses both directions of a
    assert allreduce_time(line, (0, 1), 10 * MB) == pytest.approx(10e6 / 10e9 + 2 * 1e-6)
    assert ring_links(line, (0, 1)) == (0, 1)
    assert ring_links(line, (0, 1, 2)) == (0, 1, 2, 3)
    assert ring_links(line, (1, 2)) == (2, 3)


def test_allreduce_of_one_device_or_no_bytes_is_free(line):
    assert allreduce_time(line, [2], 100 * MB) == 0.0
    assert allreduce_time(line, [], 100 * MB) == 0.0
    assert allreduce_time(line, [0, 1, 2], 0) == 0.0
    assert ring_links(line, [2]) == ()
    with pytest.raises(ValueError, match="a device appears twice"):
        allreduce_time(line, [0, 1, 0], MB)


def test_allreduce_on_presets_by_hand_and_across_nodes_is_slower():
    a100 = get_topology("a100-2x8")
    inside = allreduce_time(a100, range(8), 1e9)
    # NCCL's measured bus bandwidth among 8 A100s (200 GB/s), not the NVSwitch links' 300
    assert A100_NCCL_BUS_BANDWIDTH == 200e9
    assert inside == pytest.approx(2 * 7 / 8 * 1e9 / 200e9 + 2 * 7 * 2e-6)      # 8.78 ms
    across = allreduce_time(a100, [0, 1, 2, 3, 8, 9, 10, 11], 1e9)
    # NCCL's 4 channels leave each node on 4 rails (25 GB/s each: 100 GB/s, under NVSwitch's
    # 200); steps 3 -> 8 and 11 -> 0 change rails: NVSwitch (2 µs) then the rail (5 µs)
    assert across == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + 2 * 7 * 7e-6)      # 17.60 ms
    assert across > 2 * inside
    # one device a node: one channel, one rail (25 GB/s)
    assert allreduce_time(a100, [0, 8], 1e9) == pytest.approx(1e9 / 25e9 + 2 * 5e-6)
    # a node's one NIC shared by its channels (k80: node-nic): the single ring's bandwidth
    k80 = get_topology("k80-2x4")
    nic = k80.links[k80.route(0, 4)[-1]].bandwidth
    assert allreduce_time(k80, range(8), 1e9) == pytest.approx(2 * 7 / 8 * 1e9 / nic + 2 * 7 * k80.route_latency(3, 4))
    p100 = get_topology("p100-4x4")
    assert allreduce_time(p100, range(16), 1e9) > allreduce_time(p100, range(4), 1e9)
    assert {a100.links[j].kind for j in ring_links(a100, range(8))} == {"nvswitch"}
    names = {a100.links[j].name for j in ring_links(a100, [0, 1, 8, 9])}
    # 1 -> 8 and 9 -> 0 change rails: over NVSwitch to the GPU on rail 0, then rail 0
    # and NCCL's second channel crosses rail 1 (1 -> 9 -> 1)
    assert names == {"nvswitch-up:0", "nvswitch-down:1", "nvswitch-up:1", "nvswitch-down:0", "nic-out:dev0",
                     "nic-in:dev8", "nvswitch-up:8", "nvswitch-down:9", "nvswitch-up:9", "nvswitch-down:8",
                     "nic-out:dev8", "nic-in:dev0", "nic-out:dev1", "nic-in:dev9", "nic-out:dev9", "nic-in:dev1"}
    # the order is the caller's: interleaving nodes crosses the NICs of every device
    # (8 -> 1 and 9 -> 0 change rails: through NVSwitch first)
    ib = [j for j in ring_links(a100, [0, 8, 1, 9]) if a100.links[j].kind == "ib"]
    assert len(ring_links(a100, [0, 8, 1, 9])) == 12 and len(ib) == 8


def test_calls_are_cheap():
    t = get_topology("k80-16x4")
    groups = [tuple(range(k, k + 8)) for k in range(0, 56, 4)]
    start = time.perf_counter()
    for i in range(20000):
        transfer_time(t, i % 64, (i * 7) % 64, 1e6)
        allreduce_time(t, groups[i % len(groups)], 1e6)
    assert time.perf_counter() - start < 2.0  # 40,000 calls: tens of thousands a second at least


def test_allgather_is_the_ring_by_hand_and_a_small_sum_gathers(line):
    # ring 0 -> 1 -> 2 -> 0: alpha = 4 µs, B = 4 GB/s; 2 steps of one member's 12 MB each
    assert allgather_time(line, (0, 1, 2), 12 * MB) == pytest.approx(2 * 4e-6 + 2 * 12e6 / 4e9)   # 6.008 ms
    assert allgather_time(line, (0, 1), 10 * MB) == pytest.approx(1e-6 + 10e6 / 10e9)            # 1.001 ms
    assert allgather_time(line, [2], MB) == 0.0 and allgather_time(line, (0, 1), 0) == 0.0
    # the executor gathers while elements × members <= 2^16, else all-reduces
    assert group_sum_time(line, (0, 1, 2), 4 * 21845, 21845) == allgather_time(line, (0, 1, 2), 4 * 21845)
    assert group_sum_time(line, (0, 1, 2), 4 * 21846, 21846) == allreduce_time(line, (0, 1, 2), 4 * 21846)
    with pytest.raises(ValueError, match="nbytes = -1"):
        allgather_time(line, (0, 1), -1)


def test_ring_collectives_take_the_links_collective_bandwidth(line):
    # link a carries 10 GB/s one way, 4 GB/s inside a ring; b keeps its bandwidth in a ring
    links = tuple(dataclasses.replace(k, collective_bandwidth=4e9) if k.name.startswith("a:") else k
                  for k in line.links)
    slow = Topology("line-ring", line.devices, links, line.routes)
    assert transfer_time(slow, 0, 1, 8 * MB) == transfer_time(line, 0, 1, 8 * MB)  # one-way pieces unchanged
    assert allreduce_time(slow, (0, 1), 10 * MB) == pytest.approx(10e6 / 4e9 + 2 * 1e-6)       # 2.502 ms, not 1.002
    assert allgather_time(slow, (0, 1), 10 * MB) == pytest.approx(1e-6 + 10e6 / 4e9)
    assert allreduce_time(slow, (1, 2), 10 * MB) == allreduce_time(line, (1, 2), 10 * MB)      # b: no figure
    # ring 0 -> 1 -> 2 -> 0: the slowest ring bandwidth is b's 4 GB/s (and a's collective_bandwidth)
    assert allreduce_time(slow, (0, 1, 2), 12 * MB) == pytest.approx(4.016e-3)
    assert slow.route_ring_bandwidth(1, 0) == 4e9 and slow.route_bandwidth(1, 0) == 10e9
    assert slow.route_ring_bandwidth(2, 0) == 4e9 and slow.route_bandwidth(2, 0) == 5e9  # a's ring figure binds
    with pytest.raises(ValueError, match=r"link 'a:0->1': collective_bandwidth 0.0 must be finite and > 0"):
        dataclasses.replace(line.links[0], collective_bandwidth=0.0)
