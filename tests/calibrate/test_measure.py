"""A small real calibration on 2 gloo processes, and one real compare."""

import json
import math
import statistics

import pytest

from simulator.devices import OVERHEAD_FIELDS
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from soapsearch.calibrate import calibrate, compare
from soapsearch.calibrate.compare import PHASES
from soapsearch.calibrate.fit import fit_alpha_beta, fit_gemm_half
from simulator.cost import get_cost_model
from soapsearch.calibrate.measure import Calibration, fit_executor_overheads, report_path
from soapsearch.executor import build_model
from strategies import baseline, save_strategy

pytestmark = pytest.mark.distributed


def test_calibrate_two_processes_gives_positive_finite_figures(tmp_path):
    out = tmp_path / "topology.json"
    topo = calibrate(2, sizes=(1 << 10, 1 << 14, 1 << 22, 1 << 24), out=out, repeats=3, overhead_rounds=2)
    assert topo.name == "calibrated-cpu-2" and topo.num_devices == 2
    report = json.loads(report_path(out).read_text())
    for key in ("alpha", "bandwidth", "op_overhead", "allreduce_ratio", "task_overhead", "message_overhead",
                "exchange_overhead"):
        assert math.isfinite(report[key]) and report[key] >= 0, key
    assert report["bandwidth"] > 1e6  # > 1 MB/s: even TCP loopback does better
    # the ring's own bandwidth, fitted on the all-reduce (4 sizes up to 16 MiB), is what the links carry
    assert report["collective_bandwidth"] > 1e6 and math.isfinite(report["collective_r2"])
    assert all(k.collective_bandwidth == report["collective_bandwidth"] for k in topo.links)
    # a send holds the sender: isend's call times up to 4 MiB, fitted to the line the links carry
    assert [s for s, _ in report["send_call"]] == [1 << 10, 1 << 14, 1 << 22]
    assert all(0 < t < 1 for _, t in report["send_call"])
    if report["send_bandwidth"] is not None:  # (None, with a warning, where a loaded host's times do not grow)
        lat, bw, _ = fit_alpha_beta([s for s, _ in report["send_call"]], [t for _, t in report["send_call"]])
        assert (report["send_latency"], report["send_bandwidth"]) == (lat, bw)
        assert report["hold_sends"] and all((k.send_latency, k.send_bandwidth) == (lat, bw) for k in topo.links)
        free = Calibration.from_json({**report, "hold_sends": False}).topology()  # figures reported only
        assert all(k.send_bandwidth is None for k in free.links)
    assert len(report["flops"]) == 2 and all(1e8 < f < 1e13 for f in report["flops"] + report["solo_flops"])
    assert all(1e8 < b < 1e12 for b in report["memory_bandwidth"] + report["solo_memory_bandwidth"])
    # the devices compute at the slowest solo speed, slowed by the measured ratio when all compute
    # (its arithmetic: test_fit.test_contention_is_the_slowest_processes_solo_over_together_ratio)
    assert report["contention"] >= 1.0 and all(d.contention == report["contention"] for d in topo.devices)
    # a [m, 1024] x [1024, 1024] product per m alone (slowest process), and n_half fitted on them
    assert [m for m, _ in report["gemm_seconds"]] == [4, 8, 16, 32, 64]
    assert all(0 < t < 1 for _, t in report["gemm_seconds"])
    assert report["gemm_half"] == fit_gemm_half([m for m, _ in report["gemm_seconds"]],  # against the solo peak
                                                [t for _, t in report["gemm_seconds"]], min(report["solo_flops"]),
                                                1024, 1024)
    assert all(d.gemm_half == report["gemm_half"] for d in topo.devices)
    assert Topology.load(out) == topo
    dev = topo.devices[0]
    assert dev.peak_flops["float32"] == min(report["solo_flops"]) and dev.kind == report["kind"]
    # the executor's host work per partition and per piece: far below a second (a fit on loaded
    # cores may clamp to 0)
    assert all(0 <= report[f] < 0.1 for f in OVERHEAD_FIELDS)
    assert all(getattr(d, f) == report[f] for d in topo.devices for f in OVERHEAD_FIELDS)
    probe = report["overheads"]
    # K linear + tanh units exchanged between 2 devices: per unit 2 pieces in and 2 gradients
    # back on the critical path; the pipeline's pieces (1, 4, 8 micro-batches) overlap its stages
    assert probe["task_sizes"] == [8, 64, 128] and probe["piece_sizes"] == [2, 8, 16]
    assert probe["microbatches"] == [1, 4, 8] and probe["exchanged"] == pytest.approx(4.0)
    # the simulator charges the pipeline's pieces on its critical path; list scheduling is not
    # monotone in a delay (Graham 1969), so on some measured figures 100 µs more per piece
    # shortens the simulated pipeline: then no message overhead is fitted (fit._fit_pieces)
    assert math.isfinite(probe["pieces"]) and len(probe["exchange_per_round"]) == 2
    if probe["pieces"] > 1e-9:
        assert len(probe["message_per_round"]) == 2
    else:
        assert report["message_overhead"] == 0 and probe["message_per_round"] == []
    # the exchange chain is linear in its overhead: the fit is the rounds' mean (2 rounds: no trim)
    assert report["exchange_overhead"] == 0 or statistics.mean(probe["exchange_per_round"]) == pytest.approx(
        report["exchange_overhead"], rel=1e-3)
    assert len(probe["rounds"]) == len(probe["task_per_round"]) == 2
    assert 0 < probe["kernel"] < 1e-3  # the roofline of a 4x16 linear and tanh, forward + backward
    # the report reads back; refitting its own probe times under the same code gives its figures
    cal = Calibration.from_json(json.loads(json.dumps(report)))
    fit_executor_overheads(cal, cal.overheads, get_cost_model("analytical"))
    assert {f: getattr(cal, f) for f in OVERHEAD_FIELDS} == pytest.approx({f: report[f] for f in OVERHEAD_FIELDS},
                                                                         rel=1e-12, abs=1e-15)
    assert cal.topology() == topo
    with pytest.raises(ValueError, match="not a soapsearch.calibration report of version 1"):
        Calibration.from_json({"format": "soapsearch.topology", "version": 1})
    with pytest.raises(ValueError, match=r"missing \['nproc'"):
        Calibration.from_json({"format": "soapsearch.calibration", "version": 1})
    with pytest.raises(ValueError, match=r"send_bandwidth = -1: must be a finite number > 0 or null"):
        Calibration.from_json({**report, "send_bandwidth": -1})


def test_calibrate_fits_the_overheads_beyond_the_cost_model_it_is_given(tmp_path):
    from simulator.cost import get_cost_model
    from simulator.profiled import ProfiledCostModel
    from soapsearch.calibrate.overhead import unit_kernel_seconds

    out = tmp_path / "cal.json"
    topo = calibrate(1, sizes=(1 << 10,), out=out, repeats=2, overhead_rounds=1, cost_model="profiled")
    report = json.loads(report_path(out).read_text())
    assert report["cost_model"] == "profiled" and report["profile_cache"] == str(tmp_path / "cal.profile.json")
    cached = ProfiledCostModel(cache_path=report["profile_cache"])
    assert len(cached) > 1  # the probe unit's partitions and the harness, timed while fitting
    kernel = report["overheads"]["kernel"]
    assert kernel == unit_kernel_seconds(topo, cached) != unit_kernel_seconds(topo, get_cost_model("analytical"))
    with pytest.raises(ValueError, match="cost_model 'roofline'"):
        calibrate(1, out=tmp_path / "x.json", cost_model="roofline")


def test_warm_profile_times_every_baseline_partition_once(tmp_path, monkeypatch):
    from simulator import profiled
    from simulator.presets import get_topology
    from soapsearch.calibrate.measure import warm_profile

    topo = get_topology("local-cpu-2")
    count = warm_profile("mlp", topo, tmp_path / "p.json", variant="tiny")
    cached = profiled.ProfiledCostModel(cache_path=tmp_path / "p.json")
    assert len(cached) == count > 0
    monkeypatch.setattr(profiled, "measure_partition", lambda *a, **k: pytest.fail("a baseline partition was not cached"))
    graph = build_model("mlp", "tiny").graph
    for name in ("data_parallel", "model_parallel", "owt", "pipeline"):
        simulate_plan(graph, baseline(name, graph, 2), topo, cached)


def test_compare_runs_a_plan_and_writes_both_timelines(tmp_path):
    graph = build_model("mlp", "tiny").graph
    plan = tmp_path / "dp.json"
    save_strategy(plan, baseline("data_parallel", graph, 2), graph, topology="local-cpu-2")
    r = compare(plan, "mlp", "local-cpu-2", steps=3, warmup=1, trace_dir=tmp_path / "tr")
    assert len(r.step_ms) == 3 and r.measured_ms > 0 and r.predicted_ms > 0
    assert len(r.measured_busy_ms) == 2 and all(b > 0 for b in r.measured_busy_ms)
    assert r.rel_error == pytest.approx((r.predicted_ms - r.measured_ms) / r.measured_ms)
    # by phase: data parallel receives nothing; the simulated phases are its compute lane's tasks
    sim = simulate_plan(graph, baseline("data_parallel", graph, 2), "local-cpu-2")
    for d in (0, 1):
        assert set(r.measured_phase_ms[d]) == set(r.predicted_phase_ms[d]) == set(PHASES)
        assert r.measured_phase_ms[d]["receives"] == r.predicted_phase_ms[d]["receives"] == 0
        assert all(r.measured_phase_ms[d][p] > 0 for p in ("forward", "backward", "sync+update"))
        assert sum(r.predicted_phase_ms[d].values()) == pytest.approx(sim.busy_time[d] * 1e3)
    assert "ms by phase" in r.table() and "measured  device 1" in r.table()
    trace = json.loads((tmp_path / "tr" / "side_by_side.json").read_text())["traceEvents"]
    pids = {e["pid"] for e in trace}
    assert {0, 1, 1000, 1001} <= pids
    for rank in (0, 1):  # the measured step end, phase by phase
        cats = [e["cat"] for e in json.loads((tmp_path / "tr" / f"measured.rank{rank}.json").read_text())["traceEvents"]]
        assert cats[-4:] == ["gradient sync", "loss", "update", "loss"] and {"forward", "backward"} <= set(cats)
    assert simulate_plan(graph, baseline("data_parallel", graph, 2), "local-cpu-2").iteration_ms == pytest.approx(r.predicted_ms)


def test_receive_waits_leave_the_phase_of_the_event_they_fell_in():
    from soapsearch.calibrate.compare import _add_phases

    events = [{"cat": "forward", "ts": 0.0, "dur": 100.0}, {"cat": "backward", "ts": 100.0, "dur": 200.0},
              {"cat": "gradient sync", "ts": 300.0, "dur": 50.0}]
    phases = dict.fromkeys(PHASES, 0.0)
    _add_phases(phases, events, [(120.0, 50e-6), (10.0, 20e-6)])  # 50 µs inside backward, 20 inside forward
    assert phases == pytest.approx({"forward": 80.0, "backward": 150.0, "receives": 70.0, "sync+update": 50.0})
    assert sum(phases.values()) == pytest.approx(350.0)  # the step, each µs counted once
