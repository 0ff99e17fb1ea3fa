"""Topology JSON takes only the keys it documents: a typo in an optional field is an error that
names where it is, the key and the keys allowed, never a default taken unseen."""

import copy
import json

import pytest

from simulator.presets import PRESETS, get_topology
from simulator.topology import Topology
from soapsearch.calibrate.fit import build_topology
from strategies.graph import DTYPE_BYTES


def _calibrated() -> Topology:
    """What ``soapsearch calibrate`` writes, every optional device and link field set."""
    return build_topology(2, 2e-4, 1.5e9, 3e10, 7e9, kind="cpu-shared-4on2", memory_bytes=8 << 30,
                          task_overhead=2.5e-4, message_overhead=8e-5, collective_overhead=1.2e-3,
                          exchange_overhead=6e-4, collective_bandwidth=9e8, contention=1.7, gemm_half=11.5,
                          send_bandwidth=3e9, send_latency=5e-5)


def _explicit(edit):
    obj = _calibrated().to_json()
    edit(obj)
    return obj


_COMPACT = {"format": "soapsearch.topology", "version": 1, "name": "c",
            "cluster": {"nodes": 2, "per_node": 2,
                        "device": {"kind": "cpu", "memory_bytes": 1 << 30, "peak_flops": {"float32": 1e10},
                                   "memory_bandwidth": 1e10},
                        "intra": {"shape": "mesh", "kind": "shm", "latency": 1e-4, "bandwidth": 2e9},
                        "inter": {"shape": "node-nic", "kind": "ib", "latency": 5e-6, "bandwidth": 1e10}}}


def _compact(edit):
    obj = copy.deepcopy(_COMPACT)
    edit(obj)
    return obj


DEVICE_KEYS = ("kind, memory_bytes, peak_flops, memory_bandwidth, node, task_overhead, message_overhead, "
               "exchange_overhead, collective_overhead, contention, gemm_half")


@pytest.mark.parametrize("obj, message", [
    (_explicit(lambda o: o["devices"][0].update(bandwith=5)),
     r"devices\[0\].bandwith = 5: unknown key \(did you mean 'memory_bandwidth'\?\); a device takes only "
     + DEVICE_KEYS),
    (_explicit(lambda o: o["devices"][1].update(contension=2)),
     r"devices\[1\].contension = 2: unknown key \(did you mean 'contention'\?\)"),
    (_explicit(lambda o: o.update(extra={"a": 1})),
     r"topology JSON: extra = \{'a': 1\}: unknown key; a topology takes only format, version, name, devices, "
     r"links, routes, cluster$"),
    (_explicit(lambda o: o["links"][1].update(colective_bandwidth=1e9)),
     r"links\[1\].colective_bandwidth = 1000000000.0: unknown key \(did you mean 'collective_bandwidth'\?\); "
     r"a link takes only name, kind, latency, bandwidth, collective_bandwidth, send_bandwidth, send_latency$"),
    (_explicit(lambda o: o["routes"][0].update(via=[1])),
     r"routes\[0\].via = \[1\]: unknown key; a route takes only src, dst, links$"),
    (_explicit(lambda o: o["devices"][0]["peak_flops"].update(banana=1e12)),
     r"devices\[0\].peak_flops.banana = 1000000000000.0: unknown dtype; peak_flops takes only float64, "
     r"float32, float16, bfloat16, .*, tfloat32$"),
    (_explicit(lambda o: o["devices"][0]["peak_flops"].update(flaot16=1e12)),
     r"devices\[0\].peak_flops.flaot16 = .*: unknown dtype \(did you mean 'float16'\?\)"),
    (_explicit(lambda o: o.update(devicez=[{"kind": "x" * 60}])),  # a long value is cut short
     r"devicez = \[\{'kind': 'x{26}\.\.\.: unknown key \(did you mean 'devices'\?\)"),
    (_compact(lambda o: o["cluster"].update(per_nodes=2)),
     r"cluster.per_nodes = 2: unknown key \(did you mean 'per_node'\?\); a cluster takes only nodes, per_node, "
     r"device, intra, inter$"),
    (_compact(lambda o: o["cluster"]["intra"].update(send_latncy=1e-5)),
     r"cluster.intra.send_latncy = 1e-05: unknown key \(did you mean 'send_latency'\?\); a fabric takes only"),
    (_compact(lambda o: o["cluster"]["inter"].update(speed=1)), r"cluster.inter.speed = 1: unknown key"),
    (_compact(lambda o: o["cluster"]["device"].update(gemm_halve=3)),
     r"cluster.device.gemm_halve = 3: unknown key \(did you mean 'gemm_half'\?\); a cluster's device takes only "
     r"kind, memory_bytes, peak_flops, memory_bandwidth, task_overhead"),
    (_compact(lambda o: o["cluster"]["device"]["peak_flops"].update(fp8=1e12)),
     r"cluster.device.peak_flops.fp8 = .*: unknown dtype"),
    (_compact(lambda o: o["cluster"]["device"].update(node=1)),
     r"cluster.device.node = 1: a cluster's devices take their node from per_node: leave it out"),
], ids=lambda x: "" if isinstance(x, dict) else x.split(" ")[0].replace("\\", ""))
def test_an_unknown_key_names_where_it_is_the_key_and_the_keys_allowed(obj, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_json(obj)


def test_the_file_is_named_and_format_is_checked_before_the_keys(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_explicit(lambda o: o["devices"][0].update(contension=2))))
    with pytest.raises(ValueError, match=r"^topology file '.*t.json': devices\[0\].contension = 2: unknown key"):
        Topology.load(path)
    with pytest.raises(ValueError, match=r"^topology file '.*t.json': devices\[0\].contension = 2"):
        get_topology(str(path))
    with pytest.raises(ValueError, match=r"format = 'soapsearch.strategy': must be"):  # not a topology at all
        Topology.from_json({"format": "soapsearch.strategy", "version": 1, "ops": {}})


@pytest.mark.parametrize("topo", [*PRESETS, "local-cpu-3", "a100-3x8", "p100-1x2", _calibrated()],
                         ids=str)
def test_presets_and_a_calibrated_topology_round_trip_unchanged(topo, tmp_path):
    t = get_topology(topo) if isinstance(topo, str) else topo
    t.save(tmp_path / "t.json")
    back = Topology.load(tmp_path / "t.json")
    assert back == t and back.to_json() == t.to_json()
    back.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "t.json").read_text()


def test_every_optional_field_the_writer_has_is_written_and_read_back():
    t = _calibrated()
    obj = t.to_json()
    assert set(obj["devices"][0]) == set(DEVICE_KEYS.split(", "))  # none left out as a default
    assert set(obj["links"][0]) == {"name", "kind", "latency", "bandwidth", "collective_bandwidth",
                                    "send_bandwidth", "send_latency"}
    assert Topology.from_json(json.loads(json.dumps(obj))) == t


def test_every_dtype_the_cost_model_knows_and_tfloat32_are_peak_flops_keys():
    obj = _explicit(lambda o: o["devices"][0]["peak_flops"].update(
        {dtype: 1e12 for dtype in (*DTYPE_BYTES, "tfloat32")}))
    assert set(Topology.from_json(obj).devices[0].peak_flops) == {*DTYPE_BYTES, "tfloat32"}
    assert Topology.from_json(_compact(lambda o: None)).num_devices == 4
