"""Calibration arithmetic, no processes: the alpha–beta fit, the topology it builds, ranks."""

import math

import numpy as np
import pytest

from simulator.comm import allreduce_time, transfer_time
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from soapsearch.calibrate.fit import (build_topology, device_kind, fit_alpha_beta, ring_allreduce_seconds,
                                      spearman)
from strategies import baseline

SIZES = [1 << k for k in range(10, 25)]


@pytest.mark.parametrize("alpha,bandwidth", [(20e-6, 2e9), (500e-6, 1.2e9), (2e-6, 2e10)])
def test_fit_recovers_alpha_and_bandwidth_from_noisy_times(alpha, bandwidth):
    rng = np.random.default_rng(0)
    clean = np.array([alpha + s / bandwidth for s in SIZES])
    times = clean * (1 + rng.normal(0, 0.03, len(SIZES)))  # 3 % multiplicative noise
    a, b, r2 = fit_alpha_beta(SIZES, times)
    assert a == pytest.approx(alpha, rel=0.1)
    assert b == pytest.approx(bandwidth, rel=0.05)
    assert r2 > 0.99


def test_fit_exact_and_rejects_bad_input():
    a, b, r2 = fit_alpha_beta([1e3, 1e6], [1e-5 + 1e3 / 1e9, 1e-5 + 1e6 / 1e9])
    assert (a, b, r2) == pytest.approx((1e-5, 1e9, 1.0), rel=1e-9)
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([1e3, 1e3], [1e-5, 1e-5])
    with pytest.raises(ValueError, match="not > 0"):
        fit_alpha_beta([1e3, 1e6], [1e-3, 1e-6])


def test_ring_formula_matches_simulator():
    topo = build_topology(4, 30e-6, 1.5e9, 5e10, 8e9)
    for nbytes in (1e3, 1e6, 1.6e7):
        assert ring_allreduce_seconds(4, nbytes, 30e-6, 1.5e9) == pytest.approx(allreduce_time(topo, [0, 1, 2, 3], nbytes))


def test_device_kind_says_when_cores_are_shared():
    assert device_kind(2, 1, cores=2) == "cpu"
    assert device_kind(4, 1, cores=2) == "cpu-shared-4on2"


def test_written_topology_round_trips_and_simulates(tmp_path, graphs):
    topo = build_topology(2, 400e-6, 1.2e9, 3e10, 7e9, kind="cpu-shared-4on2")
    path = tmp_path / "topology.json"
    topo.save(path)
    back = Topology.load(path)
    assert back == topo and back.name == "calibrated-cpu-2"
    assert back.devices[0].kind == "cpu-shared-4on2" and back.devices[1].peak_flops["float32"] == 3e10
    assert transfer_time(back, 0, 1, 1.2e6) == pytest.approx(400e-6 + 1e-3)
    graph = graphs("mlp")
    r = simulate_plan(graph, baseline("data_parallel", graph, 2), back, "analytical")
    assert math.isfinite(r.iteration_ms) and r.iteration_ms > 0


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)
