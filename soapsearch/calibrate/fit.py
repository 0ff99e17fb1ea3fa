"""Pure arithmetic of calibration: the alpha–beta fit, the ring all-reduce check, the
calibrated Topology, rank correlation. No processes here (tests run it on synthetic data)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from simulator.devices import DeviceSpec
from simulator.presets import Fabric, cluster
from simulator.topology import Topology

__all__ = ["OverheadFit", "ProbeSimulator", "UNIT_OVERHEADS", "fit_alpha_beta", "fit_collective_bandwidth", "fit_gemm_half", "fit_overheads", "trimmed_mean", "ring_allreduce_seconds", "device_kind",
           "build_topology", "spearman"]


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Fit the Hockney model t(s) = alpha + s / B (Hockney 1994) to one-way message times.

    Weighted least squares on the relative residual, min Σ ((t_i - alpha - beta·s_i) / t_i)²,
    so that the small messages that fix alpha weigh as much as the large ones that fix beta
    (plain least squares lets the 16 MB points swamp a 20 µs intercept). Returns
    ``(alpha seconds, bandwidth B = 1/beta bytes/s, r²)`` with r² = 1 - SS_res/SS_tot on the
    plain times. alpha is clamped at 0 (a negative intercept is noise on a near-zero latency)."""
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.shape != t.shape or s.size < 2 or len(np.unique(s)) < 2:
        raise ValueError(f"fit_alpha_beta: need >= 2 distinct sizes with one time each "
                         f"(got {s.size} sizes, {t.size} times)")
    if not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError(f"fit_alpha_beta: times must be finite and > 0, got {t.tolist()}")
    w = 1.0 / t
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if alpha < 0:  # refit the slope alone through the origin (same weights)
        alpha = 0.0
        beta = float(np.sum(s * t * w * w) / np.sum(s * s * w * w))
    if not beta > 0:
        raise ValueError(f"fit_alpha_beta: fitted slope beta = {beta:.3g} s/B is not > 0: "
                         "times do not grow with the message size")
    pred = alpha + beta * s
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return float(alpha), float(1.0 / beta), r2


def trimmed_mean(xs: Sequence[float]) -> float:
    """Mean of ``xs`` without its highest and lowest fifth (none of fewer than 5): the expected
    value of a time whose wake-up delays come and go (a sum of many such times is their count
    times the mean, which a median misses), without an odd stall."""
    v = sorted(float(x) for x in xs)
    if not v:
        raise ValueError("trimmed_mean: no values")
    cut = len(v) // 5
    return float(np.mean(v[cut:len(v) - cut]))


def _slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of y on x."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    dx = xs - xs.mean()
    return float(np.sum(dx * (ys - ys.mean())) / np.sum(dx * dx))


class OverheadFit(NamedTuple):
    task_overhead: float
    """Seconds per forward or backward task of a partition beyond what the cost model charges
    for its kernels (framework dispatch, autograd, the executor's own work); the simulator also
    charges it per trainable tensor in the optimizer update."""
    message_overhead: float
    """Seconds per one-way point-to-point piece received, beyond the link's one-way time, as the
    simulator charges it (a task on the receiving device after the transfer)."""
    task_per_round: list[float]
    """Per round: the data-parallel chain's task overhead (with a simulator: ``_fit_pieces`` on
    the slope in K; without: (d(step)/dK - kernel) / UNIT_OVERHEADS)."""
    message_per_round: list[float]
    """Per round: the pipeline chain's message overhead (``_fit_pieces``)."""
    collective_overhead: float
    """Seconds of host work per collective on each member device, beyond the ring formula."""
    collective_per_round: list[float]
    """Per round: (its smallest data-parallel chain's step - the simulator's) / collectives."""
    collectives: float
    """Collectives on a device's critical path in the data-parallel probe, as the simulator
    charges them: d(simulated intercept)/d(collective_overhead)."""
    pieces: float
    """Pipeline pieces on the critical path (mean over its micro-batch counts), as the simulator
    charges them."""
    exchange_overhead: float
    """``message_overhead`` of an exchanged piece (the op sends one back: ``DeviceSpec``)."""
    exchange_per_round: list[float]
    """Per round: the exchange chain's exchange overhead (``_fit_pieces``)."""
    exchanged: float
    """Exchange-chain pieces per unit on the critical path, as the simulator charges them."""


UNIT_OVERHEADS = 4 + 2
"""``task_overhead``s the simulator charges per unit of the data-parallel probe on each device:
forward and backward of a linear and a tanh partition, and the update of the linear's 2
trainable tensors (weight and bias; ``simulator.step._update_time``)."""
PROBE_COLLECTIVE_OVERHEAD = 1e-3
"""The collective overhead the fit simulates the probe with to count its collectives (the
simulated step is linear in it: each is a task on the device)."""

PROBE_MESSAGE_OVERHEAD = 1e-4
"""The per-piece overhead the fit first simulates a piece probe with to count its pieces on the
critical path (then again at the fitted figure: which path is critical may change)."""

ProbeSimulator = Callable[[str, Mapping[str, float]], Sequence[float]]
"""(plan, overheads by ``DeviceSpec`` field name, absent: 0) -> the simulated step seconds of
the probe's ``data_parallel`` chain at each of its task sizes, its ``exchange`` chain at each of
its piece sizes or its ``pipeline`` at each micro-batch count, on the calibrated topology with
those overheads."""


def _check_sizes(what: str, sizes: Sequence[int], rounds: list[Mapping[str, Any]], names: Sequence[str]) -> None:
    if len(set(sizes)) < 2:
        raise ValueError(f"fit_overheads: {what} {list(sizes)}: need >= 2 distinct chain sizes")
    for i, r in enumerate(rounds):
        for name in names:
            times = r.get(name)
            if times is None or len(times) != len(sizes):
                raise ValueError(f"fit_overheads: round {i} {name!r}: {times!r} has not one time per "
                                 f"size of {what} {list(sizes)}")
            if not all(np.isfinite(times)) or min(times) <= 0:
                raise ValueError(f"fit_overheads: round {i} {name!r}: {list(times)} is not finite and > 0")


def fit_overheads(raw: Mapping[str, Any], kernel: float, simulate: ProbeSimulator | None = None) -> OverheadFit:
    """Fit the executor's overheads to the probe chains' times (``overhead.py``).

    Task overhead: on each device the data-parallel chain of K units costs, per unit, what the
    simulator charges beyond overheads (``kernel``: its 4 partitions' kernels, its 2 tensors'
    update traffic and its share of the gradient bucket's ring all-reduce;
    ``overhead.unit_kernel_seconds``) plus ``UNIT_OVERHEADS`` = 4 + 2 task overheads (4 tasks,
    2 tensors updated): step(K) = c + K·(kernel + 6·task_overhead), so task_overhead =
    (median over rounds of the least-squares slope in K - kernel) / 6: the closed form, used
    without ``simulate`` (one process; ``kernel`` is read only then). With ``simulate`` it is
    the figure at which the simulated slope equals the measured one's trimmed mean over rounds
    (``_fit_pieces``): the closed form's arithmetic where devices do not slow each other, and
    right where they do (``contention``: the simulator slows the task overheads of devices
    computing at once with their kernels).

    With ``simulate`` (N >= 2) the others invert the simulator on the probe, each in turn with
    the figures before it, so that each is charged where the simulator charges it:

    - Collective overhead: the intercept c holds the step's fixed costs, its collectives among
      them. The simulator, given the fitted task overhead and collective overhead 0, predicts
      the same chains as c_sim + K·s; each second of collective overhead adds m seconds to its
      step, m = (sim(PROBE_COLLECTIVE_OVERHEAD) - sim(0)) / PROBE_COLLECTIVE_OVERHEAD (the
      collectives on a device's critical path). A round's intercept is read at the smallest
      chain K0 (the least-squares intercept would carry the largest chain's milliseconds of
      noise): collective_overhead = (trimmed mean over rounds of t_r(K0) - sim(K0)) / m.
    - Message overhead from the pipeline chain (the mean step over its micro-batch counts), then
      exchange overhead from the exchange chain (the slope in K; ``_fit_pieces``).

    Means, not medians: a piece's or a collective's wake-up on cores shared with other work
    costs ~0.2 or several ms by turns, and a plan's many of them cost their count times the
    mean. Each figure is clamped at 0 (a negative figure is noise on a zero overhead); without
    ``simulate`` all but the task overhead are 0. ``raw`` is ``OverheadProbe.result``."""
    rounds = list(raw["rounds"])
    if not rounds:
        raise ValueError("fit_overheads: no rounds")
    if not (np.isfinite(kernel) and kernel >= 0):
        raise ValueError(f"fit_overheads: kernel = {kernel!r}: must be a finite number >= 0")
    task_sizes = list(raw["task_sizes"])
    _check_sizes("task_sizes", task_sizes, rounds, ["data_parallel"])
    if simulate is None:
        task = [(_slope(task_sizes, r["data_parallel"]) - kernel) / UNIT_OVERHEADS for r in rounds]
        return OverheadFit(max(0.0, statistics.median(task)), 0.0, task, [], 0.0, [], 0.0, 0.0, 0.0, [], 0.0)
    # the simulator slows each task by the devices computing with it (DeviceSpec.contention):
    # the figure at which its slope in K is the measured one, as for the pieces below
    task_overhead, task, _ = _fit_pieces(simulate, "data_parallel", "task_overhead", {}, task_sizes, rounds)
    coll, per_round = 0.0, []
    k0 = task_sizes.index(min(task_sizes))
    fitted = {"task_overhead": task_overhead}
    base = _simulated(simulate, "data_parallel", fitted, task_sizes)[k0]
    probe = _simulated(simulate, "data_parallel", {**fitted, "collective_overhead": PROBE_COLLECTIVE_OVERHEAD},
                       task_sizes)[k0]
    count = (probe - base) / PROBE_COLLECTIVE_OVERHEAD
    if count > 1e-6:
        excess = [r["data_parallel"][k0] - base for r in rounds]
        per_round = [e / count for e in excess]
        coll = max(0.0, trimmed_mean(excess) / count)
    fitted["collective_overhead"] = coll
    msg, message, pieces = _fit_pieces(simulate, "pipeline", "message_overhead", fitted, list(raw["microbatches"]),
                                       rounds, level=True)
    fitted["message_overhead"] = msg
    xchg, exchange, exchanged = _fit_pieces(simulate, "exchange", "exchange_overhead", fitted,
                                            list(raw["piece_sizes"]), rounds)
    return OverheadFit(task_overhead, msg, task, message, coll, per_round, count, pieces, xchg, exchange, exchanged)


def _fit_pieces(simulate: ProbeSimulator, plan: str, field: str, fitted: Mapping[str, float],
                sizes: list[int], rounds: list[Mapping[str, Any]], level: bool = False) -> tuple[float, list[float], float]:
    """(overhead, per round, pieces) of ``field`` from ``plan``'s chains of ``sizes`` (units K,
    or micro-batches): the x at which g(x), the simulated steps' slope in K (``level``: their
    mean) with the ``fitted`` figures and ``field`` = x, equals the measured one's trimmed mean
    over rounds (g grows with x: bisection). Slopes cancel what the chain's fixed costs miss;
    a pipeline's pieces overlap the other stages' work but at its ends, so the slope in m
    hardly moves with them and its level is fitted. pieces = (g(x) - g(0)) / x, the pieces on
    the critical path (per size for a slope; at x = PROBE_MESSAGE_OVERHEAD when the fit is 0);
    a round's figure is (its statistic - g(0)) / pieces. (0, [], pieces) when the simulator does
    not charge ``field`` on this chain; 0 when even x = 0 is as slow as measured."""
    _check_sizes(f"{plan} sizes", sizes, rounds, [plan])
    stat = (lambda ts: float(np.mean(ts))) if level else (lambda ts: _slope(sizes, ts))
    seen: dict[float, float] = {}

    def g(x: float) -> float:  # the simulator is deterministic: each x once
        if x not in seen:
            seen[x] = stat(_simulated(simulate, plan, {**fitted, field: x}, sizes))
        return seen[x]

    measured = [stat(r[plan]) for r in rounds]
    target, g0 = trimmed_mean(measured), g(0.0)
    pieces = (g(PROBE_MESSAGE_OVERHEAD) - g0) / PROBE_MESSAGE_OVERHEAD
    if pieces <= 1e-9:
        return 0.0, [], pieces
    fit = 0.0
    if target > g0:
        lo, hi = 0.0, PROBE_MESSAGE_OVERHEAD
        while g(hi) < target and hi < 10.0:
            lo, hi = hi, hi * 4
        for _ in range(60):
            mid = (lo + hi) / 2
            if mid in (lo, hi):  # converged to the last bit
                break
            lo, hi = (mid, hi) if g(mid) < target else (lo, mid)
        fit, pieces = hi, (g(hi) - g0) / hi
    return fit, [(x - g0) / pieces for x in measured], pieces


def _simulated(simulate: ProbeSimulator, plan: str, overheads: Mapping[str, float], sizes: Sequence[int]) -> list[float]:
    times = [float(t) for t in simulate(plan, overheads)]
    if len(times) != len(sizes) or not all(np.isfinite(times)):
        raise ValueError(f"fit_overheads: the simulated {plan} probe gave {times} for sizes {list(sizes)}: "
                         "need one finite time per size")
    return times


def fit_collective_bandwidth(n: int, sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """The bandwidth B_c a ring all-reduce of ``n`` members gets per link, from its measured
    times: ``fit_alpha_beta`` on t(s) = a + (2(n-1)/n · s) / B_c, the bytes each member sends
    (Patarasuk & Yuan 2009). Returns (B_c bytes/s, r²). Where the links' copies and the sums
    share the cores with each other B_c is below the one-way bandwidth B; the intercept is
    left to the ring's 2(n-1)·alpha."""
    if n < 2:
        raise ValueError(f"fit_collective_bandwidth: n = {n}: a collective needs >= 2 members")
    _, bandwidth, r2 = fit_alpha_beta([2 * (n - 1) / n * s for s in sizes], times)
    return bandwidth, r2


def fit_gemm_half(rows: Sequence[float], seconds: Sequence[float], peak: float, k: int, n: int) -> float:
    """Hockney's half-performance length n½ of [m, k] × [k, n] products from their times, the
    rate r∞ held at the device's ``peak`` (the one the cost model divides by): at r∞ · m /
    (m + n½) a product takes t(m) = 2kn (m + n½) / r∞ (Hockney & Jesshope 1988), so each time
    implies n½ = t · r∞ / (2kn) − m; the median of those, >= 0."""
    if len(rows) != len(seconds) or not rows:
        raise ValueError(f"fit_gemm_half: need one time per row count (got {len(rows)} rows, {len(seconds)} times)")
    if not (peak > 0 and all(t > 0 and math.isfinite(t) for t in seconds)):
        raise ValueError(f"fit_gemm_half: peak ({peak}) and times ({list(seconds)}) must be finite and > 0")
    return max(0.0, statistics.median(t * peak / (2 * k * n) - m for m, t in zip(rows, seconds)))


def ring_allreduce_seconds(n: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    """Ring all-reduce (Patarasuk & Yuan 2009), as ``simulator.comm.allreduce_time``:
    2(n-1)/n · bytes / B + 2(n-1) · alpha."""
    if n <= 1 or nbytes == 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha


def device_kind(nproc: int, threads: int, cores: int | None = None) -> str:
    """``cpu`` when the ``nproc`` processes of ``threads`` threads each fit on the cores, else
    ``cpu-shared-<nproc*threads>on<cores>`` (e.g. ``cpu-shared-4on2``): the kind keys the
    profiled cache, so figures taken while sharing cores never mix with unshared ones."""
    cores = cores or os.cpu_count() or 1
    return "cpu" if nproc * threads <= cores else f"cpu-shared-{nproc * threads}on{cores}"


def build_topology(nproc: int, alpha: float, bandwidth: float, flops: float, memory_bandwidth: float,
                   kind: str = "cpu", memory_bytes: int | None = None, task_overhead: float = 0.0,
                   message_overhead: float = 0.0, collective_overhead: float = 0.0,
                   exchange_overhead: float = 0.0, collective_bandwidth: float | None = None,
                   contention: float = 1.0, gemm_half: float = 0.0, send_bandwidth: float | None = None,
                   send_latency: float = 0.0) -> Topology:
    """``calibrated-cpu-N``: ``local-cpu-N``'s shape (one node, a shared-memory mesh link per
    ordered process pair) with the measured alpha, bandwidth, collective bandwidth
    (``fit_collective_bandwidth``), per-process float32 FLOP/s, memory bandwidth, contention
    (the slowdown when all compute at once), the products' half-performance length
    (``fit_gemm_half``), the time a send holds the sender's host (``Link.send_bandwidth``,
    ``send_latency``: ``fit_alpha_beta`` on the send calls) and the executor's task, message,
    exchange and collective overheads (``fit_overheads``)."""
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // nproc
        except (AttributeError, ValueError, OSError):
            memory_bytes = 16 << 30
    device = DeviceSpec(kind, max(int(memory_bytes), 1), {"float32": float(flops)}, float(memory_bandwidth),
                        task_overhead=float(task_overhead), message_overhead=float(message_overhead),
                        exchange_overhead=float(exchange_overhead), collective_overhead=float(collective_overhead),
                        contention=float(contention), gemm_half=float(gemm_half))
    ring = None if collective_bandwidth is None else float(collective_bandwidth)
    return cluster(f"calibrated-cpu-{nproc}", device, 1, nproc,
                   Fabric("mesh", "shm", float(alpha), float(bandwidth), ring,
                          None if send_bandwidth is None else float(send_bandwidth), float(send_latency)))


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):
        tie = x == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the (average) ranks; nan for < 2 points."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(np.sqrt(np.sum(rx * rx) * np.sum(ry * ry)))
    return float(np.sum(rx * ry) / den) if den > 0 else float("nan")
