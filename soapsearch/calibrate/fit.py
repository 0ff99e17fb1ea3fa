"""Pure arithmetic of calibration: the alpha–beta fit, the ring all-reduce check, the
calibrated Topology, rank correlation. No processes here (tests run it on synthetic data)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from simulator.devices import DeviceSpec
from simulator.presets import Fabric, cluster
from simulator.topology import Topology

__all__ = ["fit_alpha_beta", "ring_allreduce_seconds", "device_kind", "build_topology", "spearman"]


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
                   kind: str = "cpu", memory_bytes: int | None = None) -> Topology:
    """``calibrated-cpu-N``: ``local-cpu-N``'s shape (one node, a shared-memory mesh link per
    ordered process pair) with the measured alpha, bandwidth, per-process float32 FLOP/s and
    memory bandwidth."""
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // nproc
        except (AttributeError, ValueError, OSError):
            memory_bytes = 16 << 30
    device = DeviceSpec(kind, max(int(memory_bytes), 1), {"float32": float(flops)}, float(memory_bandwidth))
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
