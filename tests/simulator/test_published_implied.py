"""The products' rate a published iteration implies (benchmarks/published_implied.py): the
arithmetic on a breakdown by hand, and the rate the cost model charges a layer's linears, by
hand, on Korthikanti et al.'s 175B and 1T shapes (Hockney's r∞·m/(m + n½) of each linear's
smallest dimension: pinned at the micro-batch's 2,048 tokens from 530B up)."""

import pytest

from benchmarks.published_breakdown import Breakdown
from benchmarks.published_data import ROWS
from benchmarks.published_implied import implied, layer_gemm_efficiency
from simulator.cost import GPU_LAUNCH_OVERHEAD
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


def test_charged_rate_of_a_layers_linears_by_hand():
    device = get_topology("a100-8x8").devices[0]
    r_inf, n_half, peak = device.gemm_rate, device.gemm_half, device.flops_for("bfloat16")
    at_2048 = r_inf * 2048 / (2048 + n_half)
    at_1536 = r_inf * 1536 / (1536 + n_half)
    # 1T, TP 8: qkv 2048 × 9600 × 25600 (3f) and proj 2048 × 25600 × 3200 (f = 2·2048·3200·25600
    # FLOPs), the MLP's 2048 × 12800 × 25600 and back (4f each): every smallest dimension is the
    # micro-batch's 2,048 tokens; forward and backward 3 × 12f
    f = 2 * 2048 * 3200 * 25600
    assert layer_gemm_efficiency(BY_NAME["1T full"]) == pytest.approx(
        36 * f / (peak * (36 * f / (peak * at_2048) + LAUNCH)), rel=1e-9)
    # 175B, TP 8: qkv 2048 × 4608 × 12288 (3f) at m = 2048, proj 2048 × 12288 × 1536 (f) at
    # m = 1536, the MLP's two (4f each) at m = 2048
    f = 2 * 2048 * 1536 * 12288
    assert layer_gemm_efficiency(BY_NAME["175B full"]) == pytest.approx(
        36 * f / (peak * (3 * (f / at_1536 + 11 * f / at_2048) / peak + LAUNCH)), rel=1e-9)
