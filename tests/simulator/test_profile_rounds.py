"""ProfiledCostModel.profile: partitions timed ahead in interleaved rounds, the median kept."""

from __future__ import annotations

import pytest

from simulator import profiled as profiled_mod
from simulator.devices import DeviceSpec
from simulator.presets import get_topology
from simulator.profiled import ProfiledCostModel, plan_partitions
from soapsearch.executor import build_model
from strategies import baseline
from strategies.graph import Dim, OpNode, TensorSpec, Weight
from strategies.lowering import lower
from strategies.region import full_box

CPU = DeviceSpec("cpu", 64 << 30, {"float32": 1e12}, 50e9)


def linear(batch: int, fout: int, name: str) -> OpNode:
    return OpNode(name, "linear", ("x",), TensorSpec((batch, fout)),
                  (Dim("sample", batch, "sample"), Dim("out_features", fout, "parameter"),
                   Dim("in_features", 8, "reduction")),
                  weights=(Weight("weight", f"{name}.weight", TensorSpec((fout, 8))),),
                  input_specs=(TensorSpec((batch, 8)),), flops=2 * batch * 8 * fout)


def test_profile_interleaves_rounds_and_keeps_each_partitions_median(tmp_path, monkeypatch):
    # a host that drifts: every call is slower than the last, so one partition timed in one
    # burst would get other figures than its neighbours timed later
    calls: list[str] = []

    def fake(node, box, **kw):
        calls.append(node.name)
        t = len(calls) * 1e-3
        return (t, 2 * t) if node.name != "bad" else 1 / 0

    monkeypatch.setattr(profiled_mod, "measure_partition", fake)
    monkeypatch.setattr(profiled_mod, "harness_overhead", lambda **kw: (0.0, 0.0))
    a, b, bad = linear(4, 16, "a"), linear(4, 32, "b"), linear(4, 64, "bad")
    model = ProfiledCostModel(cache_path=tmp_path / "p.json")
    parts = [(a, full_box(a.shape), CPU), (b, full_box(b.shape), CPU), (a, full_box(a.shape), CPU),
             (bad, full_box(bad.shape), CPU)]
    assert model.profile(parts, rounds=3) == 2
    # round 1: a, b, bad (fails, dropped); rounds 2 and 3: a, b
    assert calls == ["a", "b", "bad", "a", "b", "a", "b"]
    # a's rounds ran at calls 1, 4, 6 -> median 4 ms; b's at 2, 5, 7 -> 5 ms (backward 2x)
    assert model.op_time(a, full_box(a.shape), CPU) == pytest.approx((4e-3, 8e-3))
    assert model.op_time(b, full_box(b.shape), CPU) == pytest.approx((5e-3, 10e-3))
    assert len(ProfiledCostModel(cache_path=tmp_path / "p.json")) == 3  # a, b and the harness, on disk
    calls.clear()
    assert model.profile(parts[:2]) == 0 and calls == []  # cached: nothing timed again
    with pytest.raises(ValueError, match=r"rounds \(0\) must be >= 1"):
        model.profile(parts, rounds=0)


def test_plan_partitions_lists_every_partition_of_every_microbatch():
    graph = build_model("mlp", "tiny").graph
    topo = get_topology("local-cpu-2")
    low = lower(graph, baseline("pipeline", graph, 2, microbatches=2))
    parts = list(plan_partitions(graph, low, topo))
    assert len(parts) == sum(len(ps) for per_mb in low.partitions.values() for ps in per_mb)
    assert {node.name for node, _, _ in parts} == {n.name for n in graph}
    assert all(device is topo.devices[0] or device is topo.devices[1] for _, _, device in parts)
