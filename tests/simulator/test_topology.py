import dataclasses
import json
import pickle

import pytest

from simulator.devices import DeviceSpec, Link
from simulator.presets import (
    A100_NVSWITCH,
    HDR_DEVICE_NIC,
    MAX_DEVICES,
    PATTERNS,
    PRESETS,
    Fabric,
    cluster,
    get_topology,
)
from simulator.topology import Topology

GiB = 1 << 30


def _names(topology, route):
    return [topology.links[j].name for j in route]


@pytest.mark.parametrize("name, devices, node_size, nodes, links", [
    ("p100-4x4", 16, 4, 4, 4 * 12 + 2 * 4),   # 12 NVLink directions per node + NIC out/in per node
    ("k80-16x4", 64, 4, 16, 2 * 64 + 2 * 16),  # PCIe up/down per die + NIC out/in per node
    ("a100-1x8", 8, 8, 1, 2 * 8),             # NVSwitch up/down per GPU, no NIC
    ("a100-2x8", 16, 8, 2, 2 * 16 + 2 * 16),  # + NIC out/in per GPU
    ("h100-4x8", 32, 8, 4, 2 * 32 + 2 * 32),
    ("a100-3x8", 24, 8, 3, 2 * 24 + 2 * 24),
    ("p100-1x2", 2, 2, 1, 2),
    ("local-cpu-1", 1, 1, 1, 0),
    ("local-cpu-4", 4, 4, 1, 12),
])
def test_presets_build_with_their_shape(name, devices, node_size, nodes, links):
    t = get_topology(name)
    assert t.name == name
    assert t.num_devices == devices and t.node_size == node_size and len(t.nodes) == nodes
    assert len(t.links) == links
    assert [t.node_of(d) for d in range(devices)] == [d // node_size for d in range(devices)]
    assert t.nodes[-1] == tuple(range(devices - node_size, devices))
    assert len(t.routes) == devices * (devices - 1)


def test_every_listed_preset_builds():
    for name in PRESETS:
        assert get_topology(name).num_devices >= 1


def test_preset_figures():
    p100 = get_topology("p100-4x4")
    d = p100.devices[0]
    assert (d.kind, d.memory_bytes, d.memory_bandwidth) == ("P100", 16 * GiB, 732e9)
    assert (d.flops_for("float32"), d.flops_for("float16")) == (10.6e12, 21.2e12)
    assert {(k.kind, k.bandwidth) for k in p100.links} == {("nvlink", 20e9), ("ib", 12.5e9)}
    k80 = get_topology("k80-16x4").devices[0]
    assert (k80.kind, k80.memory_bytes, k80.flops_for("float32"), k80.memory_bandwidth) == ("K80", 12 * GiB, 4.37e12, 240e9)
    assert {(k.kind, round(k.bandwidth / 1e6)) for k in get_topology("k80-2x4").links} == {("pcie", 12000), ("ib", 6818)}
    a100 = get_topology("a100-2x8")
    assert a100.devices[0].flops_for("bfloat16") == 312e12 and a100.devices[0].memory_bandwidth == 2.039e12
    assert {(k.kind, k.bandwidth) for k in a100.links} == {("nvswitch", 300e9), ("ib", 25e9)}
    h100 = get_topology("h100-2x8")
    assert h100.devices[0].flops_for("float16") == 989.4e12 and h100.devices[0].flops_for("float32") == 67e12
    assert {(k.kind, k.bandwidth) for k in h100.links} == {("nvswitch", 450e9), ("ib", 50e9)}
    cpu = get_topology("local-cpu-4")
    assert {(k.kind, k.latency, k.bandwidth) for k in cpu.links} == {("shm", 20e-6, 2e9)}
    assert cpu.devices[0].kind == "cpu" and len({dev.memory_bytes for dev in cpu.devices}) == 1
    assert cpu.devices[0].memory_bytes == get_topology("local-cpu-1").devices[0].memory_bytes // 4  # a share of RAM


def test_routes_inside_a_node_stay_inside_and_across_nodes_cross_the_nics():
    p100 = get_topology("p100-4x4")
    assert _names(p100, p100.route(0, 1)) == ["nvlink:0->1"]
    assert _names(p100, p100.route(1, 6)) == ["nic-out:node0", "nic-in:node1"]
    assert p100.route(3, 3) == ()
    a100 = get_topology("a100-2x8")
    assert _names(a100, a100.route(2, 5)) == ["nvswitch-up:2", "nvswitch-down:5"]
    assert _names(a100, a100.route(2, 10)) == ["nic-out:dev2", "nic-in:dev10"]  # rail 2 to rail 2
    # rail 2 to rail 5: over NVSwitch to node 0's GPU on rail 5 first (NCCL's PXN)
    assert _names(a100, a100.route(2, 13)) == ["nvswitch-up:2", "nvswitch-down:5", "nic-out:dev5", "nic-in:dev13"]
    for t in (p100, a100, get_topology("k80-2x4"), get_topology("h100-2x8")):
        for s in range(t.num_devices):
            for d in range(t.num_devices):
                kinds = {t.links[j].kind for j in t.route(s, d)}
                assert ("ib" in kinds) == (t.node_of(s) != t.node_of(d)) or s == d
    # all devices of a node share its one NIC on p100 / k80: routes 0->4 and 1->5 contend
    assert set(p100.route(0, 4)) & set(p100.route(1, 5))
    assert not set(a100.route(0, 8)) & set(a100.route(1, 9))  # per-GPU NICs on a100


def test_route_latency_and_bandwidth_are_precomputed_from_the_links():
    t = get_topology("a100-2x8")
    assert t.route_latency(0, 1) == pytest.approx(2e-6) and t.route_bandwidth(0, 1) == 300e9
    assert t.route_latency(0, 8) == pytest.approx(5e-6) and t.route_bandwidth(0, 8) == 25e9
    assert t.route_latency(0, 9) == pytest.approx(7e-6) and t.route_bandwidth(0, 9) == 25e9  # NVSwitch, then rail 1
    assert t.route_latency(4, 4) == 0 and t.route_bandwidth(4, 4) == float("inf")
    with pytest.raises(IndexError, match="out of range 0..15"):
        t.route(0, 16)


def test_unknown_names_list_the_presets_and_patterns():
    with pytest.raises(ValueError) as e:
        get_topology("tpu-v4")
    assert "p100-4x4" in str(e.value) and "a100-<N>x<M>" in str(e.value) and "local-cpu-<N>" in str(e.value)
    with pytest.raises(ValueError, match="at most 8 devices"):
        get_topology("a100-1x9")
    with pytest.raises(ValueError, match=f"at most {MAX_DEVICES}"):
        get_topology("h100-2049x8")
    with pytest.raises(ValueError, match="neither a preset"):
        get_topology("local-cpu-0")
    assert len(PATTERNS) == 5


DEV = DeviceSpec("x", GiB, {"float32": 1e12}, 1e11)
LINKS = (Link("a", "nvlink", 1e-6, 1e10), Link("b", "nvlink", 1e-6, 1e10))


def test_construction_checks_name_the_device_link_and_rule():
    assert Topology("t", (DEV, DEV), LINKS, {(0, 1): (0,), (1, 0): (1,)}).num_devices == 2
    with pytest.raises(ValueError, match="no route from device 1 to device 0: every ordered pair"):
        Topology("t", (DEV, DEV), LINKS, {(0, 1): (0,)})
    with pytest.raises(ValueError, match=r"route 0->1 = \[5\]: link index 5 does not exist \(2 links: 0..1\)"):
        Topology("t", (DEV, DEV), LINKS, {(0, 1): (5,), (1, 0): (1,)})
    with pytest.raises(ValueError, match="crosses at least one link"):
        Topology("t", (DEV, DEV), LINKS, {(0, 1): (), (1, 0): (1,)})
    with pytest.raises(ValueError, match="crosses each link at most once"):
        Topology("t", (DEV, DEV), LINKS, {(0, 1): (0, 0), (1, 0): (1,)})
    with pytest.raises(ValueError, match="at least one device"):
        Topology("t", (), (), {})
    with pytest.raises(ValueError, match=r"links\[1\].name = 'a': link names are unique"):
        Topology("t", (DEV, DEV), (LINKS[0], LINKS[0]), {})
    with pytest.raises(ValueError, match="device indices 0..1"):
        Topology("t", (DEV, DEV), LINKS, {(0, 2): (0,)})


def test_topology_is_immutable_hashable_and_picklable():
    t = get_topology("p100-4x4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "other"
    with pytest.raises(TypeError):
        t.routes[0, 1] = (3,)
    copy = pickle.loads(pickle.dumps(t))
    assert copy == t and hash(copy) == hash(t) and copy is not t
    assert t != get_topology("p100-2x4")


@pytest.mark.parametrize("name", ["p100-4x4", "k80-2x4", "a100-2x8", "local-cpu-3", "local-cpu-1"])
def test_json_round_trip(name, tmp_path):
    t = get_topology(name)
    obj = t.to_json()
    assert obj["format"] == "soapsearch.topology" and obj["version"] == 1
    assert obj["routes"][:1] == ([{"src": 0, "dst": 1, "links": list(t.route(0, 1))}] if t.num_devices > 1 else [])
    assert Topology.from_json(json.loads(json.dumps(obj))) == t
    path = tmp_path / "sub" / "topo.json"
    t.save(path)
    assert Topology.load(path) == t and get_topology(str(path)) == t and get_topology(path) == t
    assert [p.name for p in path.parent.iterdir()] == ["topo.json"]  # no temp file left behind


def test_compact_cluster_json_expands_like_the_preset(tmp_path):
    dev = get_topology("a100-2x8").devices[0]
    fabric = lambda f: {"shape": f.shape, "kind": f.kind, "latency": f.latency, "bandwidth": f.bandwidth,  # noqa: E731
                        **({} if f.collective_bandwidth is None else {"collective_bandwidth": f.collective_bandwidth})}
    obj = {"format": "soapsearch.topology", "version": 1, "name": "a100-2x8",
           "cluster": {"nodes": 2, "per_node": 8, "intra": fabric(A100_NVSWITCH), "inter": fabric(dataclasses.replace(HDR_DEVICE_NIC, shape="rail")),
                       "device": {"kind": dev.kind, "memory_bytes": dev.memory_bytes,
                                  "peak_flops": dict(dev.peak_flops), "memory_bandwidth": dev.memory_bandwidth,
                                  "gemm_half": dev.gemm_half, "gemm_rate": dev.gemm_rate, "sms": dev.sms}}}
    assert Topology.from_json(obj) == get_topology("a100-2x8")
    (tmp_path / "c.json").write_text(json.dumps(obj))
    assert get_topology(str(tmp_path / "c.json")) == get_topology("a100-2x8")
    obj["cluster"]["intra"]["shape"] = "ring"
    with pytest.raises(ValueError, match=r"cluster.intra.shape = 'ring': must be one of \('mesh', 'switch'\)"):
        Topology.from_json(obj)
    with pytest.raises(ValueError, match="inter = None: several nodes need"):
        cluster("c", dev, 2, 2, Fabric("mesh", "nvlink", 0, 1))


def _broken(edit):
    obj = get_topology("p100-1x2").to_json()
    edit(obj)
    return obj


@pytest.mark.parametrize("edit, message", [
    (lambda o: o.pop("devices"), r"devices: missing: this field is required"),
    (lambda o: o["devices"][1].update(memory_bytes=-1), r"devices\[1\].memory_bytes = -1: must be an integer > 0"),
    (lambda o: o["devices"][0]["peak_flops"].update(float32="fast"),
     r"devices\[0\].peak_flops.float32 = 'fast': must be a finite number > 0"),
    (lambda o: o["links"][0].update(bandwidth=0), r"links\[0\].bandwidth = 0: must be a finite number > 0"),
    (lambda o: o["links"][1].pop("latency"), r"links\[1\].latency: missing"),
    (lambda o: o["routes"][0].update(links=[9]), r"route 0->1 = \[9\]: link index 9 does not exist"),
    (lambda o: o["routes"].pop(), r"no route from device 1 to device 0"),
    (lambda o: o["routes"].append(dict(o["routes"][0])), r"routes\[2\] = .*a second route from device 0 to device 1"),
    (lambda o: o.update(version=2), r"version = 2: this soapsearch reads version 1 only"),
    (lambda o: o.update(format="soapsearch.strategy"), r"format = 'soapsearch.strategy': must be"),
    (lambda o: o.update(name=""), r"name = '': must be a non-empty string"),
])
def test_bad_json_names_field_value_and_rule(edit, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_json(_broken(edit))


def test_bad_file_names_the_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json.*line 1 column 2: not valid JSON"):
        Topology.load(bad)
    with pytest.raises(ValueError, match="neither a preset nor a file"):
        get_topology(str(tmp_path / "missing.json"))


def test_describe_summarises_devices_links_and_routes():
    text = get_topology("p100-4x4").describe()
    assert "16 devices in 4 nodes x 4" in text
    assert "nodes 0..3 (each): 4 x P100 (16 GiB, 10.6 TFLOP/s float32, 21.2 TFLOP/s float16" in text
    assert "732 GB/s memory" in text
    assert "48 x nvlink: 2 µs, 20 GB/s per direction" in text and "8 x ib: 2.5 µs, 12.5 GB/s" in text
    assert "route inside a node: 1 link(s), 2 µs latency, 20 GB/s bottleneck" in text
    assert "route between nodes: 2 link(s), 5 µs latency, 12.5 GB/s bottleneck" in text
    assert "links: 0" in get_topology("local-cpu-1").describe()


def test_device_overheads_round_trip_default_to_zero_and_are_checked(tmp_path):
    base = get_topology("local-cpu-2")
    figures = {"task_overhead": 1.5e-4, "message_overhead": 3e-5, "exchange_overhead": 7e-5,
               "collective_overhead": 9e-4}  # distinct: a field read into another's place shows
    devices = tuple(dataclasses.replace(d, **figures) for d in base.devices)
    t = dataclasses.replace(base, devices=devices)
    obj = t.to_json()
    assert [{k: d[k] for k in figures} for d in obj["devices"]] == [figures] * 2
    back = Topology.from_json(json.loads(json.dumps(obj)))
    assert back == t and {k: getattr(back.devices[1], k) for k in figures} == figures
    assert pickle.loads(pickle.dumps(t)) == t  # DeviceSpec.__reduce__ passes every field in order
    t.save(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == t
    assert "task_overhead" not in base.to_json()["devices"][0]  # a preset's JSON stays as it was
    del obj["devices"][0]["message_overhead"]
    assert Topology.from_json(obj).devices[0].message_overhead == 0.0
    obj["devices"][1]["task_overhead"] = -1e-6
    with pytest.raises(ValueError, match=r"devices\[1\].task_overhead = -1e-06: must be a finite number >= 0"):
        Topology.from_json(obj)
    with pytest.raises(ValueError, match=r"message_overhead = -1.0: must be >= 0"):
        dataclasses.replace(DEV, message_overhead=-1.0)


def test_collective_overhead_round_trips_defaults_to_zero_and_is_checked(tmp_path):
    base = get_topology("local-cpu-2")
    t = dataclasses.replace(base, devices=(dataclasses.replace(base.devices[0], collective_overhead=7e-4),
                                           base.devices[1]))
    obj = t.to_json()
    assert obj["devices"][0]["collective_overhead"] == 7e-4
    assert "collective_overhead" not in obj["devices"][1] and "task_overhead" not in obj["devices"][0]
    back = Topology.from_json(json.loads(json.dumps(obj)))
    assert back == t and [d.collective_overhead for d in back.devices] == [7e-4, 0.0]
    assert pickle.loads(pickle.dumps(t)).devices[0].collective_overhead == 7e-4
    t.save(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == t
    obj["devices"][1]["collective_overhead"] = -2e-4
    with pytest.raises(ValueError, match=r"devices\[1\].collective_overhead = -0.0002: must be a finite number >= 0"):
        Topology.from_json(obj)
    with pytest.raises(ValueError, match=r"device 'cpu': collective_overhead = -1.0: must be >= 0"):
        dataclasses.replace(base.devices[0], collective_overhead=-1.0)


@pytest.mark.parametrize("fields,text", [
    ({"collective_bandwidth": 1e9}, "1 GB/s in a ring collective"),
    ({"send_bandwidth": 2e9, "send_latency": 1e-4}, "a send holds the sender 100 µs + bytes at 2 GB/s")])
def test_optional_link_fields_round_trip_and_are_checked(fields, text, tmp_path):
    base = get_topology("local-cpu-2")
    t = dataclasses.replace(base, links=(dataclasses.replace(base.links[0], **fields), base.links[1]))
    obj = t.to_json()
    assert {k: obj["links"][0][k] for k in fields} == fields and not set(fields) & set(obj["links"][1])
    assert Topology.from_json(json.loads(json.dumps(obj))) == t and pickle.loads(pickle.dumps(t)) == t
    t.save(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == t
    assert text in t.describe()
    field = next(iter(fields))
    obj["links"][1][field] = -5
    with pytest.raises(ValueError, match=rf"links\[1\].{field} = -5: must be a finite number > 0"):
        Topology.from_json(obj)


def test_collective_bandwidth_is_the_rings_in_both_forms():
    base = get_topology("local-cpu-2")
    t = dataclasses.replace(base, links=(dataclasses.replace(base.links[0], collective_bandwidth=1e9),
                                         base.links[1]))
    assert t.route_ring_bandwidth(0, 1) == 1e9
    assert t.route_ring_bandwidth(1, 0) == t.route_bandwidth(1, 0) == base.links[1].bandwidth
    compact = {"format": "soapsearch.topology", "version": 1, "name": "c",
               "cluster": {"nodes": 1, "per_node": 2,
                           "device": {"kind": "cpu", "memory_bytes": 1 << 30, "peak_flops": {"float32": 1e10},
                                      "memory_bandwidth": 1e10},
                           "intra": {"shape": "mesh", "kind": "shm", "latency": 1e-4, "bandwidth": 2e9,
                                     "collective_bandwidth": 8e8, "send_bandwidth": 3e9, "send_latency": 5e-5}}}
    c = Topology.from_json(compact)
    assert [k.collective_bandwidth for k in c.links] == [8e8, 8e8] and c.route_bandwidth(0, 1) == 2e9
    assert [(k.send_bandwidth, k.send_latency) for k in c.links] == [(3e9, 5e-5)] * 2  # test_send_hold.py
    compact["cluster"]["intra"]["collective_bandwidth"] = 0
    with pytest.raises(ValueError, match=r"cluster.intra.collective_bandwidth = 0: must be a finite number > 0"):
        Topology.from_json(compact)
    compact["cluster"]["intra"].update(collective_bandwidth=8e8, send_latency="x")
    with pytest.raises(ValueError, match=r"cluster.intra.send_latency = 'x': must be a finite number >= 0"):
        Topology.from_json(compact)


def test_gemm_half_round_trips_defaults_to_zero_and_is_checked(tmp_path):
    base = get_topology("local-cpu-2")
    t = dataclasses.replace(base, devices=(dataclasses.replace(base.devices[0], gemm_half=11.5), base.devices[1]))
    obj = t.to_json()
    assert obj["devices"][0]["gemm_half"] == 11.5 and "gemm_half" not in obj["devices"][1]
    back = Topology.from_json(json.loads(json.dumps(obj)))
    assert back == t and [d.gemm_half for d in back.devices] == [11.5, 0.0]
    assert pickle.loads(pickle.dumps(t)).devices[0].gemm_half == 11.5
    dev = pickle.loads(pickle.dumps(t.devices[0]))  # DeviceSpec.__reduce__
    assert dev == t.devices[0] and dev.gemm_half == 11.5 and dev.cost_key == t.devices[0].cost_key
    assert "half its peak at products of 11.5 rows" in t.describe()
    obj["devices"][1]["gemm_half"] = float("inf")
    with pytest.raises(ValueError, match=r"devices\[1\].gemm_half = inf: must be a finite number >= 0"):
        Topology.from_json(obj)
    with pytest.raises(ValueError, match=r"device 'cpu': gemm_half = -1.0: must be finite and >= 0"):
        dataclasses.replace(base.devices[0], gemm_half=-1.0)


def test_a_pickle_naming_the_older_reader_loads():
    import simulator.topology as topology_mod

    t = get_topology("p100-1x2")

    class Older:  # reduces as pickles that name simulator.topology._from_json do
        def __reduce__(self):
            return (topology_mod._from_json, (t.to_json(),))

    data = pickle.dumps(Older())
    assert b"_from_json" in data and pickle.loads(data) == t


def test_cluster_routes_are_a_rule_equal_to_the_explicit_table():
    t = get_topology("a100-3x8")
    table = {(s, d): t.route(s, d) for s in range(24) for d in range(24) if s != d}
    explicit = Topology(t.name, t.devices, t.links, table)
    assert explicit == t and t == explicit and hash(explicit) == hash(t)
    for s, d in table:
        assert explicit.route_latency(s, d) == t.route_latency(s, d)
        assert explicit.route_bandwidth(s, d) == t.route_bandwidth(s, d)
        assert explicit.route_ring_bandwidth(s, d) == t.route_ring_bandwidth(s, d)
    assert explicit.describe() == t.describe()
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.routes == t.routes and back.route(3, 20) == t.route(3, 20)


def test_presets_of_a_thousand_nodes_hold_nothing_per_device_pair():
    t = get_topology("h100-1024x8")
    assert t.num_devices == 8192 and len(t.links) == 4 * 8192 and len(t.routes) == 8192 * 8191
    assert t._route is None  # no per-pair table
    assert [t.links[j].name for j in t.route(8191, 3)] == ["nvswitch-up:8191", "nvswitch-down:8187",
                                                           "nic-out:dev8187", "nic-in:dev3"]
    assert t.route_bandwidth(0, 8) == 50e9 and t.route_latency(0, 8) == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="cluster.nodes \\* cluster.per_node|at most"):
        get_topology("local-cpu-513")
