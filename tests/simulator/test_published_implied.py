"""The products' rate a published iteration implies (benchmarks/published_implied.py): the
arithmetic on a breakdown by hand, and the rate the cost model charges a layer's linears, by
hand, on Korthikanti et al.'s 175B and 1T shapes (each product at its shape's rate,
``simulator.gemm_shape``: tiles and waves over the SMs, r∞·K/(K + n½) over its reduction length)."""

import pytest

from benchmarks.published_breakdown import Breakdown
from benchmarks.published_data import ROWS
from benchmarks.published_implied import implied, layer_gemm_efficiency
from simulator.cost import GPU_LAUNCH_OVERHEAD
from simulator.gemm_shape import backward_shapes, shape_efficiency
from simulator.presets import get_topology

BY_NAME = {r.name: r for r in ROWS}
LAUNCH = 12 * GPU_LAUNCH_OVERHEAD
"""Seconds of a layer's four linears' kernel launches (Megatron-LM's fused query-key-value
linear, proj, MLP up and down: one kernel forward, two backward each)."""


def test_implied_holds_the_idle_share_by_hand():
    got = Breakdown(iteration=10.0, device=0, compute={"gemm": 7.0, "attention": 1.0, "other": 0.5},
                    exposed={"nvswitch": 0.5}, idle=1.0)
    found = implied(got, 8.0)
    # 8 s · (1 - 1/10) idle share held, less 1.5 s other compute and 0.5 s exposed communication
    assert found.allowed == pytest.approx(8.0 * 0.9 - 1.5 - 0.5)
    assert found.speedup == pytest.approx(7.0 / 5.2)
    assert found.charged == 7.0
    with pytest.raises(ValueError, match="leaves the products no time"):
        implied(got, 2.0)


def _charged(products, device) -> float:
    """Share of the peak: the products' FLOPs (3 each: forward, dA, dW) over their seconds at
    their shapes' rates (forward; the backward pair's harmonic mean) plus the launches."""
    peak, flops, seconds = device.flops_for("bfloat16"), 0.0, LAUNCH
    for m, n, k in products:
        f = 2 * m * n * k
        d_a, d_w = (shape_efficiency(*s, device) for s in backward_shapes(1, m, n, k))
        flops += 3 * f
        seconds += f / (peak * shape_efficiency(1, m, n, k, device)) + 2 * f / (peak * 2 / (1 / d_a + 1 / d_w))
    return flops / (seconds * peak)


def test_charged_rate_of_a_layers_linears_by_hand():
    device = get_topology("a100-8x8").devices[0]
    # 1T, TP 8, 2048 tokens: qkv 2048 × 9600 × 25600, proj 2048 × 25600 × 3200, the MLP's
    # 2048 × 12800 × 25600 and back (rows × out × in)
    one_t = [(2048, 9600, 25600), (2048, 25600, 3200), (2048, 12800, 25600), (2048, 25600, 12800)]
    assert layer_gemm_efficiency(BY_NAME["1T full"]) == pytest.approx(_charged(one_t, device), rel=1e-9)
    # 175B, TP 8: qkv 2048 × 4608 × 12288, proj 2048 × 12288 × 1536, MLP 2048 × 6144 × 12288 and back
    big = [(2048, 4608, 12288), (2048, 12288, 1536), (2048, 6144, 12288), (2048, 12288, 6144)]
    assert layer_gemm_efficiency(BY_NAME["175B full"]) == pytest.approx(_charged(big, device), rel=1e-9)
    # the larger shapes run faster: no longer pinned at the 2,048 tokens' rate
    assert layer_gemm_efficiency(BY_NAME["1T full"]) > layer_gemm_efficiency(BY_NAME["175B full"])
