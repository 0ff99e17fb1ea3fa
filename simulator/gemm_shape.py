"""The rate of a GPU matrix product by its shape: tile and wave quantization over the SMs and a
per-tile rate that rises with the reduction length.

NVIDIA, "Matrix Multiplication Background User's Guide" (cuBLAS on tensor cores), §Dimension
Quantization Effects: a product C[M, N] = A[M, K]·B[K, N] is cut into output tiles of a×b, each
tile one thread block on one SM; ⌈M/a⌉·⌈N/b⌉ tiles run in ⌈tiles / SMs⌉ waves, so the GPU does
the work of whole tiles in whole waves ("tile quantization", "wave quantization"). The kept
share of a shape is M·N over waves·SMs·a·b for the library's 128×128 tile (``GEMM_TILES``).
Each tile loops over K in steps; its fixed cost (the pipeline's fill, the epilogue's writes) is
amortized over the loop, so a tile runs at Hockney's r∞·K/(K + k½)
(Hockney & Jesshope 1988: half the rate at K = k½, ``DeviceSpec.gemm_half`` on a device with
``DeviceSpec.sms``). The product runs at peak · r∞ · quantization(M, N) · K/(K + k½)
(``gemm_efficiency``: an op's forward and backward products by ``OpRule.gemm_shape``).
"""

from __future__ import annotations

import math

from simulator.devices import DeviceSpec
from strategies.graph import OpNode
from strategies.region import Box
from strategies.rules import get_rule

__all__ = ["GEMM_TILES", "backward_shapes", "gemm_efficiency", "shape_efficiency", "tile_wave_efficiency"]

GEMM_TILES = ((128, 128),)
"""Output tiles (rows × cols) of cuBLAS's tensor-core kernels (NVIDIA, "Matrix Multiplication
Background User's Guide", §Dimension Quantization Effects). Only 128×128: by quantization alone a
larger tile never wins (it pads at least as much, and 2·⌈T/S⌉ >= ⌈2T/S⌉ waves of half the area)."""


def tile_wave_efficiency(m: int, n: int, sms: int, batch: int = 1) -> float:
    """Share of the tile-perfect rate ``batch`` products of an m × n output keep after tile and
    wave quantization: batch·m·n over ⌈tiles / sms⌉·sms·a·b, tiles = batch·⌈m/a⌉·⌈n/b⌉, for the
    best a × b of ``GEMM_TILES``."""
    best = 0.0
    for a, b in GEMM_TILES:
        tiles = batch * math.ceil(m / a) * math.ceil(n / b)
        best = max(best, batch * m * n / (math.ceil(tiles / sms) * sms * a * b))
    return best


def shape_efficiency(batch: int, m: int, n: int, k: int, device: DeviceSpec) -> float:
    """Fraction of ``device``'s dtype peak that ``batch`` products [m, k] × [k, n] reach:
    r∞ · ``tile_wave_efficiency`` · k/(k + k½) (module docstring; r∞ ``gemm_rate``, k½
    ``gemm_half``, the SMs ``sms``)."""
    return (device.gemm_rate * tile_wave_efficiency(m, n, device.sms, batch)
            * k / (k + device.gemm_half))


def backward_shapes(batch: int, m: int, n: int, k: int) -> tuple[tuple[int, int, int, int], ...]:
    """The two backward products of C[m, n] = A[m, k]·B[k, n], as (batch, rows, cols, depth):
    dA = dC·Bᵀ (m × k over n) and dB = Aᵀ·dC (k × n over m)."""
    return (batch, m, k, n), (batch, k, n, m)


def gemm_efficiency(node: OpNode, box: Box, device: DeviceSpec) -> tuple[float, float, float] | None:
    """(forward, dA, dB) fraction of the peak the partition's library matrix products reach on
    ``device``, or None: the op runs no library GEMM (no product, an ``attention`` kernel, whose
    tiles span queries × keys over the head dim: Dao et al. 2022), or the device models none
    (n½ = 0): the cost model's constant compute efficiency applies.

    On a GPU with SMs (``DeviceSpec.sms``) and a product whose shape the rule gives
    (``OpRule.gemm_shape``): ``shape_efficiency`` of the forward product, and of the two backward
    products (dA = dC·Bᵀ, dB = Aᵀ·dC, each the forward's FLOPs). Else Hockney's r∞·m/(m + n½)
    (Hockney & Jesshope 1988; r∞ ``gemm_rate``, n½ ``gemm_half``, m ``OpRule.gemm_size``) all three."""
    if not device.gemm_half or node.kind == "attention":
        return None
    rule = get_rule(node.kind)
    shape = rule.gemm_shape(node, box) if device.sms else None
    if shape is not None and min(shape) > 0:
        d_a, d_b = (shape_efficiency(*s, device) for s in backward_shapes(*shape))
        return shape_efficiency(*shape, device), d_a, d_b
    m = rule.gemm_size(node, box)
    return (e := device.gemm_rate * m / (m + device.gemm_half), e, e) if m else None
