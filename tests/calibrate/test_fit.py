"""Calibration arithmetic, no processes: the alpha–beta fit, the topology it builds, ranks."""

import math
import statistics

import numpy as np
import pytest

from simulator.comm import allreduce_time, transfer_time
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from soapsearch.calibrate.fit import (UNIT_OVERHEADS, build_topology, device_kind, fit_alpha_beta, fit_gemm_half,
                                      fit_collective_bandwidth, fit_overheads, ring_allreduce_seconds, spearman,
                                      trimmed_mean)
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


@pytest.mark.parametrize("r_inf, n_half", [(80e9, 11.0), (2e13, 64.0)])
def test_fit_gemm_half_recovers_hockneys_n_half_from_product_times(r_inf, n_half):
    # [m, 1024] x [1024, 1024] at r_inf * m / (m + n_half): t = 2 * 1024^2 * (m + n_half) / r_inf
    rows = [4, 8, 16, 32, 64]
    exact = [2 * 1024 ** 2 * (m + n_half) / r_inf for m in rows]
    assert fit_gemm_half(rows, exact, r_inf, 1024, 1024) == pytest.approx(n_half, rel=1e-9)
    rng = np.random.default_rng(1)
    noisy = [t * (1 + 0.01 * rng.standard_normal()) for t in exact]
    assert fit_gemm_half(rows, noisy, r_inf, 1024, 1024) == pytest.approx(n_half, abs=0.02 * (64 + n_half))
    # against a peak 10 % above the products' own r_inf, the same times need a longer n_half
    assert fit_gemm_half(rows, exact, 1.1 * r_inf, 1024, 1024) > n_half
    assert fit_gemm_half(rows, [2 * 1024 ** 2 * m / (2 * r_inf) for m in rows], r_inf, 1024, 1024) == 0.0  # clamped
    with pytest.raises(ValueError, match="one time per row count"):
        fit_gemm_half([8, 16], [1e-4], r_inf, 1024, 1024)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        fit_gemm_half([8], [-1e-4], r_inf, 1024, 1024)


def test_ring_formula_matches_simulator():
    topo = build_topology(4, 30e-6, 1.5e9, 5e10, 8e9)
    for nbytes in (1e3, 1e6, 1.6e7):
        assert ring_allreduce_seconds(4, nbytes, 30e-6, 1.5e9) == pytest.approx(allreduce_time(topo, [0, 1, 2, 3], nbytes))


@pytest.mark.parametrize("n", [2, 4])
def test_collective_bandwidth_is_fitted_from_the_all_reduce_and_reaches_the_ring(n, tmp_path):
    rng = np.random.default_rng(1)
    alpha, bandwidth, ring = 250e-6, 1.8e9, 0.9e9  # gloo's ring at half the one-way bandwidth
    times = [ring_allreduce_seconds(n, s, alpha, ring) * (1 + rng.normal(0, 0.03)) for s in SIZES]
    fitted, r2 = fit_collective_bandwidth(n, SIZES, times)
    assert fitted == pytest.approx(ring, rel=0.05) and r2 > 0.99
    exact, _ = fit_collective_bandwidth(n, SIZES, [ring_allreduce_seconds(n, s, alpha, ring) for s in SIZES])
    assert exact == pytest.approx(ring, rel=1e-9)
    topo = build_topology(n, alpha, bandwidth, 5e10, 8e9, collective_bandwidth=exact)
    everyone = list(range(n))
    for s in (1e4, 1.6e7):  # the simulator's all-reduce is the measured one; a one-way piece is not
        assert allreduce_time(topo, everyone, s) == pytest.approx(ring_allreduce_seconds(n, s, alpha, ring))
        assert transfer_time(topo, 0, 1, s) == pytest.approx(alpha + s / bandwidth)
    topo.save(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == topo
    with pytest.raises(ValueError, match="n = 1: a collective needs >= 2 members"):
        fit_collective_bandwidth(1, SIZES, times)


def test_contention_is_the_slowest_processes_solo_over_together_ratio():
    from soapsearch.calibrate.measure import Calibration

    def cal(nproc, flops, solo_flops, bw, solo_bw):
        return Calibration(nproc, 1, 2, "cpu", 2e-4, 2e9, 1.0, 1.0, 1e9, 1.0, flops, bw, solo_flops, solo_bw, 3e-6)
    # slowest together 30 GFLOP/s, alone 75: 2.5x; copy 6 against 15 GB/s: 2.5x; geometric mean 2.5
    four = cal(4, [30e9, 40e9, 35e9, 33e9], [75e9, 80e9, 78e9, 76e9], [6e9, 7e9, 6.5e9, 8e9], [15e9, 16e9, 15e9, 16e9])
    assert four.contention == pytest.approx(2.5)
    assert cal(2, [60e9, 70e9], [72e9, 70e9], [10e9, 10e9], [12e9, 13e9]).contention == pytest.approx(
        math.sqrt(70 / 60 * 12 / 10))
    assert cal(2, [80e9, 80e9], [70e9, 70e9], [10e9, 10e9], [10e9, 10e9]).contention == 1.0  # never below 1
    assert cal(1, [50e9], [60e9], [10e9], [12e9]).contention == 1.0  # one process shares nothing
    topo = four.topology()
    assert topo.devices[0].contention == pytest.approx(2.5) and topo.devices[0].peak_flops["float32"] == 75e9
    assert topo.devices[0].memory_bandwidth == 15e9 and topo.links[0].collective_bandwidth == 1e9


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


KERNEL = 12e-6  # what the cost model charges one linear + tanh unit's partitions, forward + backward
ALPHA = 200e-6
TASK_SIZES, PIECE_SIZES, MICROBATCHES = [8, 64, 128], [2, 8, 16], [1, 4, 8]


BASE = 6e-3  # the simulator's data-parallel intercept without collective overhead
COLLECTIVES = 2  # on a device's critical path per data-parallel step
# the piece chains: sizes, intercept, cost per size (unit or micro-batch), pieces per size on the
# critical path, the overhead they cost
CHAINS = {"pipeline": (MICROBATCHES, 3e-3, 150e-6, 2, "message_overhead"),
          "exchange": (PIECE_SIZES, 4e-3, 20e-6, 4, "exchange_overhead")}


def _simulate(plan, overheads):
    """A synthetic ``ProbeSimulator``: the model ``fit_overheads`` states, no noise."""
    task, collective = overheads.get("task_overhead", 0.0), overheads.get("collective_overhead", 0.0)
    if plan == "data_parallel":
        return [BASE + COLLECTIVES * collective + k * (KERNEL + UNIT_OVERHEADS * task) for k in TASK_SIZES]
    sizes, base, kernel, pieces, field = CHAINS[plan]
    return [base + collective + k * (kernel + UNIT_OVERHEADS * task + pieces * (ALPHA + overheads.get(field, 0.0)))
            for k in sizes]


def _probe_times(task, message, rounds=7, noise=0.03, seed=0, collective=0.0, exchange=None):
    """Synthetic probe times (the synthetic simulator's) with multiplicative noise, and one
    round slowed 5x throughout (a burst of load from elsewhere); exchanged pieces cost 3x the
    one-way ones unless ``exchange`` says."""
    rng = np.random.default_rng(seed)
    overheads = {"task_overhead": task, "collective_overhead": collective, "message_overhead": message,
                 "exchange_overhead": 3 * message if exchange is None else exchange}
    out = []
    for r in range(rounds):
        slow = 5.0 if r == 2 else 1.0
        jitter = lambda: 1 + rng.normal(0, noise)  # noqa: E731
        out.append({plan: [t * slow * jitter() for t in _simulate(plan, overheads)]
                    for plan in ("data_parallel", "pipeline", "exchange")})
    return {"task_sizes": TASK_SIZES, "piece_sizes": PIECE_SIZES, "microbatches": MICROBATCHES, "rounds": out}


def _fit(raw, kernel=KERNEL, simulate=_simulate):
    return fit_overheads(raw, kernel, simulate)


@pytest.mark.parametrize("task,message,exchange", [(150e-6, 60e-6, 900e-6), (20e-6, 1.2e-3, 1.2e-3),
                                                   (80e-6, 0.0, 300e-6)])
def test_fit_overheads_recovers_known_overheads_from_noisy_times(task, message, exchange):
    fit = _fit(_probe_times(task, message, exchange=exchange))
    assert fit.task_overhead == pytest.approx(task, rel=0.1)
    assert fit.message_overhead == pytest.approx(message, rel=0.1, abs=30e-6)
    assert fit.exchange_overhead == pytest.approx(exchange, rel=0.1, abs=30e-6)
    # the pipeline's level: 2 pieces per micro-batch at the mean count; the exchange's slope: 4 per unit
    assert (fit.pieces, fit.exchanged) == (pytest.approx(2 * np.mean(MICROBATCHES), rel=1e-6), pytest.approx(4, rel=1e-6))
    assert len(fit.task_per_round) == len(fit.message_per_round) == len(fit.exchange_per_round) == 7
    exact = _fit(_probe_times(task, message, noise=0.0, exchange=exchange))
    assert exact.task_overhead == pytest.approx(task, rel=1e-9)
    assert exact.message_overhead == pytest.approx(message, rel=1e-6, abs=1e-12)
    assert exact.exchange_overhead == pytest.approx(exchange, rel=1e-6, abs=1e-12)
    # every round but the one 5x slower gives the truth back by itself
    assert exact.message_per_round[0] == pytest.approx(message, rel=1e-6, abs=1e-12)
    assert exact.exchange_per_round[0] == pytest.approx(exchange, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("task,collective", [(60e-6, 2.5e-3), (150e-6, 4e-4), (80e-6, 0.0)])
def test_fit_overheads_recovers_the_collective_overhead_from_the_intercept(task, collective):
    # step(K) = BASE + 2·collective + K·(KERNEL + 6·task): the smallest chain's excess over the
    # simulator's, per collective the simulator counts on the critical path
    exact = _fit(_probe_times(task, 50e-6, noise=0.0, collective=collective))
    assert exact.task_overhead == pytest.approx(task, rel=1e-9)
    assert exact.collectives == pytest.approx(COLLECTIVES, rel=1e-6)
    assert exact.collective_overhead == pytest.approx(collective, rel=1e-6, abs=1e-9)
    assert exact.message_overhead == pytest.approx(50e-6, rel=1e-6)
    dp = _simulate("data_parallel", {"task_overhead": task, "collective_overhead": collective})[0]
    slow = (5 * dp - _simulate("data_parallel", {"task_overhead": task})[0]) / 2  # the round 5x slower
    assert exact.collective_per_round[2] == pytest.approx(slow, rel=1e-6)
    noisy = _fit(_probe_times(task, 50e-6, noise=0.03, collective=collective))
    assert noisy.collective_overhead == pytest.approx(collective, abs=3e-4)  # 3 % of a 7-12 ms step
    assert len(noisy.collective_per_round) == 7
    # no simulator (one process): only the task overhead
    alone = _fit(_probe_times(task, 50e-6, collective=collective), simulate=None)
    assert (alone.collective_overhead, alone.message_overhead, alone.exchange_overhead) == (0.0, 0.0, 0.0)
    flat = _fit(_probe_times(task, 50e-6, collective=collective),
                simulate=lambda p, o: _simulate(p, {**o, "collective_overhead": 0.0} if p == "data_parallel" else o))
    assert (flat.collective_overhead, flat.collectives, flat.collective_per_round) == (0.0, 0.0, [])
    # a measured intercept below the simulator's: clamped at 0
    assert _fit(_probe_times(task, 50e-6, noise=0.0),
                simulate=lambda p, o: [x + 1e-3 for x in _simulate(p, o)]).collective_overhead == 0.0
    with pytest.raises(ValueError, match=r"simulated data_parallel probe gave \[1.0\] for sizes \[8, 64, 128\]"):
        _fit(_probe_times(task, 50e-6), simulate=lambda p, o: [1.0])


def test_fit_overheads_inverts_the_simulator_on_the_real_probe():
    # "measured" times are the simulator's own for the three probe chains on a calibrated
    # topology with known overheads: the fit gives them back (unit_kernel_seconds is what the
    # simulator charges a unit beyond overheads; the collectives and the pieces are counted)
    from simulator.cost import get_cost_model
    from soapsearch.calibrate.overhead import probe_simulator, unit_kernel_seconds

    cost = get_cost_model("analytical")

    def topo(overheads):
        return build_topology(2, 30e-6, 1.5e9, 5e10, 8e9, **overheads)

    simulate = probe_simulator(topo, cost, [2, 4, 8], [2, 4, 8], [1, 2, 4])
    truth = {"task_overhead": 90e-6, "collective_overhead": 700e-6, "message_overhead": 150e-6,
             "exchange_overhead": 600e-6}
    raw = {"task_sizes": [2, 4, 8], "piece_sizes": [2, 4, 8], "microbatches": [1, 2, 4],
           "rounds": [{plan: simulate(plan, truth) for plan in ("data_parallel", "pipeline", "exchange")}] * 3}
    fit = fit_overheads(raw, unit_kernel_seconds(topo({}), cost), simulate)
    assert fit.task_overhead == pytest.approx(90e-6, rel=1e-6)
    # one collective per step: the loss's sum rides the gradient bucket (bucket_sums)
    assert fit.collectives == pytest.approx(1.0, rel=1e-6)
    assert fit.collective_overhead == pytest.approx(700e-6, rel=1e-6)
    # pipeline: per micro-batch, the stage boundary's activation and the targets forward, a
    # gradient back; exchange: each unit's linear and tanh read a piece and send a gradient
    # back each way
    assert fit.exchanged == pytest.approx(4.0, rel=1e-6)
    assert fit.pieces > 0  # the simulator charges the pipeline's pieces on its critical path
    assert fit.message_overhead == pytest.approx(150e-6, rel=1e-6)
    assert fit.exchange_overhead == pytest.approx(600e-6, rel=1e-6)


def test_fit_overheads_means_the_pieces_when_wakeups_come_and_go():
    # pieces cost 2 ms more in two rounds of seven (a wake-up delay of shared cores): the
    # figure is the trimmed mean's, which a plan's many pieces add up to, not the median's
    raw = _probe_times(30e-6, 100e-6, noise=0.0)
    pieces = CHAINS["exchange"][3]
    for i in (0, 3):
        r = raw["rounds"][i]
        r["exchange"] = [t + k * pieces * 2e-3 for t, k in zip(r["exchange"], PIECE_SIZES)]
    raw["rounds"][2] = {**raw["rounds"][2], "exchange": _simulate(
        "exchange", {"task_overhead": 30e-6, "message_overhead": 100e-6, "exchange_overhead": 300e-6})}
    fit = _fit(raw)
    assert fit.exchange_overhead == pytest.approx(300e-6 + 2e-3 / 5, rel=1e-6)
    assert statistics.median(fit.exchange_per_round) == pytest.approx(300e-6, rel=1e-6)


def test_fit_overheads_inverts_a_simulator_that_slows_tasks_computing_at_once():
    # every data-parallel task 1.5x slower (DeviceSpec.contention: all devices compute at once),
    # its task overhead with it: the closed form (slope - kernel) / 6 would read the slowdown of
    # the kernels as task overhead, and the simulator would slow it once more
    def shared(plan, overheads):
        if plan != "data_parallel":
            return _simulate(plan, overheads)
        task = overheads.get("task_overhead", 0.0)
        return [BASE + k * 1.5 * (KERNEL + UNIT_OVERHEADS * task) for k in TASK_SIZES]
    raw = {**_probe_times(0, 0, noise=0.0), "rounds": [
        {**r, "data_parallel": shared("data_parallel", {"task_overhead": 40e-6})}
        for r in _probe_times(0, 0, noise=0.0)["rounds"]]}
    assert _fit(raw, simulate=shared).task_overhead == pytest.approx(40e-6, rel=1e-6)
    closed = _fit(raw, simulate=None).task_overhead
    assert closed == pytest.approx((1.5 * (KERNEL + UNIT_OVERHEADS * 40e-6) - KERNEL) / UNIT_OVERHEADS, rel=1e-9)


def test_fit_overheads_clamps_and_rejects_bad_input():
    raw = _probe_times(100e-6, 50e-6)
    # a kernel dearer than the whole slope, pieces no slower than the link: no negative overhead
    assert _fit(raw, kernel=1e-2, simulate=None).task_overhead == 0.0
    assert _fit(raw, simulate=lambda p, o: [100 * x for x in _simulate(p, o)]).task_overhead == 0.0
    slow = lambda p, o: [x * (1.5 if p != "data_parallel" else 1.0) for x in _simulate(p, o)]  # noqa: E731
    fit = _fit(_probe_times(100e-6, 0.0, exchange=0.0), simulate=slow)
    assert (fit.message_overhead, fit.exchange_overhead) == (0.0, 0.0)
    # a simulator that does not charge exchanged pieces: no exchange overhead, the rest fitted
    blind = _fit(_probe_times(100e-6, 50e-6, noise=0.0),
                 simulate=lambda p, o: _simulate(p, {**o, "exchange_overhead": 0.0}))
    assert (blind.exchange_overhead, blind.exchange_per_round, blind.exchanged) == (0.0, [], 0.0)
    assert blind.message_overhead == pytest.approx(50e-6, rel=1e-6)
    with pytest.raises(ValueError, match=r"task_sizes \[4, 4, 4\]: need >= 2 distinct chain sizes"):
        _fit({**raw, "task_sizes": [4, 4, 4]})
    bad = _probe_times(100e-6, 50e-6)
    bad["rounds"][1]["data_parallel"] = [1e-3, float("nan"), 1e-3]
    with pytest.raises(ValueError, match=r"round 1 'data_parallel': \[0.001, nan, 0.001\] is not finite and > 0"):
        _fit(bad)
    bad["rounds"][1]["data_parallel"] = [1e-3, 1e-3]
    with pytest.raises(ValueError, match=r"round 1 'data_parallel': \[0.001, 0.001\] has not one time per size "
                                         r"of task_sizes \[8, 64, 128\]"):
        _fit(bad)
    bad = _probe_times(100e-6, 50e-6)
    bad["rounds"][0]["exchange"] = [1e-3]
    with pytest.raises(ValueError, match=r"round 0 'exchange': \[0.001\] has not one time per size "
                                         r"of exchange sizes \[2, 8, 16\]"):
        _fit(bad)
    with pytest.raises(ValueError, match=r"kernel = -1.0: must be a finite number >= 0"):
        _fit(raw, kernel=-1.0)


def test_trimmed_mean_drops_a_fifth_at_each_end():
    assert trimmed_mean([1, 2, 3]) == 2.0
    assert trimmed_mean([0.2, 0.2, 2.0, 0.2, 2.0, 0.2, 50.0]) == pytest.approx((0.2 * 3 + 2.0 * 2) / 5)
    with pytest.raises(ValueError, match="no values"):
        trimmed_mean([])


def test_calibrated_topology_carries_the_overheads_through_json(tmp_path):
    topo = build_topology(4, 200e-6, 1.5e9, 2e10, 7e9, kind="cpu-shared-4on2", task_overhead=2.5e-4,
                          message_overhead=8e-5, collective_overhead=1.2e-3, exchange_overhead=6e-4)
    assert all((d.task_overhead, d.message_overhead, d.collective_overhead, d.exchange_overhead)
               == (2.5e-4, 8e-5, 1.2e-3, 6e-4)
               for d in topo.devices)
    topo.save(tmp_path / "t.json")
    back = Topology.load(tmp_path / "t.json")
    assert back == topo  # DeviceSpec equality covers the overhead fields
