"""Pure arithmetic of calibration: the alpha–beta fit, the ring all-reduce check, the
calibrated Topology, rank correlation. No processes here (tests run it on synthetic data)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from simulator.devices import DeviceSpec
from simulator.presets import Fabric, cluster
from simulator.topology import Topology

__all__ = ["OverheadFit", "fit_alpha_beta", "fit_overheads", "trimmed_mean", "ring_allreduce_seconds", "device_kind",
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
    for its kernels (framework dispatch, autograd, the executor's own work)."""
    message_overhead: float
    """Seconds per point-to-point piece received, beyond the link's one-way time."""
    task_per_round: list[float]
    """Per round: (d(data-parallel step)/dK - kernel) / 4."""
    message_per_round: list[float]
    """Per round: d(round robin - one device)/d(pieces) - alpha - s/B (the report's view of the
    spread; the fit takes the trimmed mean of the slopes)."""


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


def fit_overheads(raw: Mapping[str, Any], kernel: float, alpha: float, bandwidth: float) -> OverheadFit:
    """Fit the executor's overheads to the probe chains' times (``overhead.py``).

    Task overhead: each device of the data-parallel chain of K units runs 4K tasks (forward and
    backward of a linear and a tanh partition), each costing its kernels (``kernel``: the cost
    model's forward + backward seconds of one unit's partitions) plus the overhead, and little
    else grows with K (the optimizer's per-tensor work, which the simulator does not charge
    either, lands in the overhead): step(K) = c + K·(kernel + 4·task_overhead), so
    task_overhead = (median over rounds of the least-squares slope in K - kernel) / 4.

    Message overhead: the round-robin chain differs from the one-device chain (same tasks, one
    at a time) only in its P(K) pieces, each on the critical path, each costing the link's
    alpha + s/B plus the overhead: rr(K) - one(K) = c' + P(K)·(alpha + s/B + message_overhead),
    so message_overhead = trimmed mean over rounds of the slope of rr - one in P, minus
    alpha + s/B (s the piece's bytes; alpha and B the fitted link). A mean, as for alpha: on
    cores shared with other work a piece costs ~0.2 or several ms by turns (a wake-up delay
    that comes and goes faster than a round), and a plan's many pieces cost their count times
    the mean. The executor's pieces cost more than a ping-pong's: its sends and receives are
    posted when its tasks get to them, not in lock step. 0 without pieces (one process).

    Each is clamped at 0 (a negative figure is noise on a zero overhead). ``raw`` is
    ``OverheadProbe.result``."""
    rounds = list(raw["rounds"])
    if not rounds:
        raise ValueError("fit_overheads: no rounds")
    if not (np.isfinite(kernel) and kernel >= 0):
        raise ValueError(f"fit_overheads: kernel = {kernel!r}: must be a finite number >= 0")
    task_sizes = list(raw["task_sizes"])
    _check_sizes("task_sizes", task_sizes, rounds, ["data_parallel"])
    task = [(_slope(task_sizes, r["data_parallel"]) - kernel) / 4 for r in rounds]
    pieces = list(raw.get("pieces") or [])
    message: list[float] = []
    msg = 0.0
    if pieces:
        piece_sizes = list(raw["piece_sizes"])
        _check_sizes("piece_sizes", piece_sizes, rounds, ["one_device", "round_robin"])
        if len(pieces) != len(piece_sizes) or len(set(pieces)) < 2:
            raise ValueError(f"fit_overheads: pieces {pieces}: need one count per size {piece_sizes}, "
                             ">= 2 distinct")
        if not (alpha >= 0 and bandwidth > 0):
            raise ValueError(f"fit_overheads: alpha {alpha!r} must be >= 0 and bandwidth {bandwidth!r} > 0")
        link = alpha + raw["piece_bytes"] / bandwidth
        slopes = [_slope(pieces, np.subtract(r["round_robin"], r["one_device"])) for r in rounds]
        message = [s - link for s in slopes]
        msg = max(0.0, trimmed_mean(slopes) - link)
    return OverheadFit(max(0.0, statistics.median(task)), msg, task, message)


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
                   message_overhead: float = 0.0) -> Topology:
    """``calibrated-cpu-N``: ``local-cpu-N``'s shape (one node, a shared-memory mesh link per
    ordered process pair) with the measured alpha, bandwidth, per-process float32 FLOP/s,
    memory bandwidth and the executor's task and message overheads (``fit_overheads``)."""
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // nproc
        except (AttributeError, ValueError, OSError):
            memory_bytes = 16 << 30
    device = DeviceSpec(kind, max(int(memory_bytes), 1), {"float32": float(flops)}, float(memory_bandwidth),
                        task_overhead=float(task_overhead), message_overhead=float(message_overhead))
    return cluster(f"calibrated-cpu-{nproc}", device, 1, nproc, Fabric("mesh", "shm", float(alpha), float(bandwidth)))


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
