"""The flash attention kernel's rate on a GPU by sequence length, head dim and causal mask, read
from FlashAttention-2's published benchmark (Dao 2023, "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning", arXiv 2307.08691, §4.1 Figure 4: "Attention forward +
backward speed (A100 80GB SXM4)"; the same benchmark on "H100 80GB SXM5" in the FlashAttention-2
release's README, Dao-AILab/flash-attention ``assets/flash2_a100_fwd_bwd_benchmark.png`` and
``assets/flash2_h100_fwd_bwd_benchmark.png``). torch's ``scaled_dot_product_attention`` runs
this kernel (its flash backend) on both GPUs for fp16 and bf16 without a mask.

The benchmark (``benchmarks/benchmark_flash_attention.py`` there; the README: "Batch size set
to 16k / seqlen", "hidden dimension 2048 (i.e. either 32 or 16 heads)", FP16/BF16) counts
4·batch·heads·seqlen²·head_dim FLOPs forward, half that with the causal mask (its kernel skips
the key blocks past the diagonal), and 2.5 times the forward's backward (the backward recomputes
the scores: five products to the forward's two), and prints their 3.5 times the forward's over
the forward + backward time. ``flash_rate`` interpolates the figure's bars linearly in log2(seqlen) and in
head dim between the published points and holds the end values past them (below 512 and above
16k keys, head dims outside 64-128): one curve per GPU class, keyed by ``DeviceSpec.kind`` like
the profiled model's cache (what was measured on one device of a kind holds for all).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["FLASH_BACKWARD", "FLASH_DTYPES", "FLASH_RATES", "FLASH_SEQS", "FlashRates", "causal_fraction",
           "flash_rate"]

FLASH_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
"""Sequence lengths of the benchmark's bars (queries = keys)."""
FLASH_HEAD_DIMS = (64, 128)
"""Head dims of its panels."""
FLASH_BACKWARD = 2.5
"""The backward's FLOPs over the forward's as the benchmark counts them: dV = Pᵀ·dO, dP = dO·Vᵀ,
dQ = dS·K, dK = dSᵀ·Q plus S = Q·Kᵀ recomputed (Dao 2023, Algorithm 2), five products to two."""
FLASH_DTYPES = frozenset({"float16", "bfloat16"})
"""What the kernel computes in (torch's flash backend refuses float32)."""


@dataclass(frozen=True)
class FlashRates:
    """One GPU class's forward + backward TFLOP/s of the FlashAttention-2 kernel, as published:
    ``rates[(causal, head_dim)]`` at each of ``FLASH_SEQS``."""

    kind: str
    """``DeviceSpec.kind`` the figures are for."""
    source: str
    """Where they are printed."""
    rates: Mapping[tuple[bool, int], tuple[float, ...]]

    def __post_init__(self) -> None:
        want = {(c, d) for c in (False, True) for d in FLASH_HEAD_DIMS}
        if set(self.rates) != want or any(len(r) != len(FLASH_SEQS) or min(r) <= 0 for r in self.rates.values()):
            raise ValueError(f"FlashRates {self.kind!r}: rates need the panels {sorted(want)}, each "
                             f"{len(FLASH_SEQS)} figures > 0 (one a sequence length of {FLASH_SEQS})")
        object.__setattr__(self, "rates", MappingProxyType(dict(self.rates)))


A100_FLASH = FlashRates(
    "A100-SXM4-80GB",
    "Dao 2023 (arXiv 2307.08691) Figure 4, FlashAttention-2 bars; without the causal mask the "
    "labels of 1k (head dim 64) and 512 and 1k (head dim 128) lie under the legend: 153 and 173 "
    "are read through it, 151 from the bar's height on the axis",
    {  # (causal, head dim): TFLOP/s at 512, 1k, 2k, 4k, 8k, 16k
        (False, 64): (132, 153, 162, 171, 175, 176),   # (a) without causal mask, head dim 64
        (False, 128): (151, 173, 187, 196, 201, 203),  # (b) without causal mask, head dim 128
        (True, 64): (88, 119, 140, 156, 165, 171),     # (c) with causal mask, head dim 64
        (True, 128): (99, 133, 155, 173, 182, 189),    # (d) with causal mask, head dim 128
    })
H100_FLASH = FlashRates(
    "H100-SXM5-80GB",
    "Dao-AILab/flash-attention README of the FlashAttention-2 release, \"FlashAttention speedup on "
    "H100 SXM5 with FP16/BF16\" (assets/flash2_h100_fwd_bwd_benchmark.png), FlashAttention-2 bars",
    {
        (False, 64): (215, 254, 274, 288, 294, 296),
        (False, 128): (248, 294, 320, 326, 335, 338),
        (True, 64): (141, 192, 232, 257, 273, 284),
        (True, 128): (163, 221, 265, 294, 308, 328),
    })
FLASH_RATES: Mapping[str, FlashRates] = MappingProxyType({r.kind: r for r in (A100_FLASH, H100_FLASH)})
"""The curves by ``DeviceSpec.kind`` (the a100 and h100 presets' devices)."""


def _between(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """ys at x, linear between the points of xs (ascending), the end values past them."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


_LOG_SEQS = tuple(math.log2(s) for s in FLASH_SEQS)


def flash_rate(kind: str, dtype: str, keys: int, head_dim: int, causal: bool) -> float | None:
    """FLOP/s (forward + backward, the benchmark's count) of the flash kernel on a device of
    ``kind`` over ``keys`` keys at ``head_dim``, or None: no published curve for the kind, or a
    dtype the kernel does not run in."""
    curve = FLASH_RATES.get(kind)
    if curve is None or dtype not in FLASH_DTYPES or keys <= 0:
        return None
    at = [_between(_LOG_SEQS, curve.rates[(causal, d)], math.log2(keys)) for d in FLASH_HEAD_DIMS]
    return 1e12 * _between(FLASH_HEAD_DIMS, tuple(at), head_dim)


def _clamped_sum(n: int, k: int) -> int:
    """Σ_{u=1..n} min(u, k) for n >= 0."""
    return n * (n + 1) // 2 if n <= k else k * (k + 1) // 2 + (n - k) * k


def causal_fraction(rows: tuple[int, int], keys: tuple[int, int], all_keys: int) -> float:
    """The share of query rows [t0, t1) × ``all_keys`` keys that a top-left causal mask leaves
    (query i sees keys j <= i), counting only the keys [k0, k1) the partition reads: the work
    the flash kernel does of what the op's FLOPs count (every query row against every key)."""
    (t0, t1), (k0, k1) = rows, keys
    if t1 <= t0 or all_keys <= 0:
        return 0.0
    width = k1 - k0
    seen = _clamped_sum(max(t1 - k0, 0), width) - _clamped_sum(max(t0 - k0, 0), width)
    return seen / ((t1 - t0) * all_keys)
