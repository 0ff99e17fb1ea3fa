"""The analytical cost model against Narayanan et al. SC'21 Table 1 (benchmarks/published_runs.py):
the table is the paper's (its shapes give its parameter counts, its per-GPU TFLOP/s its
aggregate and % of the preset's peak), each reachable row's plan is the megatron baseline it
names, and the predictions stay inside the error the model reaches, so a cost-model regression
fails."""

import pytest

from benchmarks.published_runs import (ROWS, build_graph, build_plan, narayanan_flops, narayanan_params,
                                       predict, predicted_tflops, published_seconds, reachable)
from simulator.presets import get_topology

BOUND = 0.10
"""|predicted / published TFLOP/s - 1| the model reaches on the rows tested (benchmarks/README.md)."""


def test_table_is_the_papers():
    assert len(ROWS) == 10 and [r.gpus for r in ROWS] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]
    peak = get_topology("a100-1x8").devices[0].flops_for("bfloat16")
    for r in ROWS:
        # the shape's parameters (§5.1's 12lh²(1 + 13/12h + (V+s)/12lh)) are the published count
        assert narayanan_params(r) / 1e9 == pytest.approx(r.params_b, abs=0.05), r.name
        assert r.gpus * r.tflops / 1e3 == pytest.approx(r.aggregate_pflops, rel=0.005), r.name
        assert abs(100 * r.tflops * 1e12 / peak - r.percent_peak) <= 0.5, r.name
        assert r.tp * r.pp * r.dp == r.gpus and r.dp * r.microbatch * r.microbatches == r.batch, r.name
        assert published_seconds(r) * r.gpus * r.tflops * 1e12 == pytest.approx(narayanan_flops(r))
    # 1T: 96·3072·2048·128·25600²·(1 + 2048/153600 + 51200/52428800) = 5.139e19 FLOPs an iteration
    assert narayanan_flops(ROWS[-1]) == pytest.approx(5.139e19, rel=1e-3)
    assert all(reachable(r) is None for r in ROWS)  # the a100-Nx8 presets reach 3,072 devices


@pytest.fixture(scope="module")
def small():
    return build_graph(ROWS[0])


def test_plan_is_the_rows(small):
    run = ROWS[0]
    plan = build_plan(run, small)
    assert (plan.num_devices, plan.microbatches, plan.precision) == (32, 16, "bf16")
    recomputed = [n.name for n in small if plan[n.name].recompute]
    assert len(recomputed) >= 4 * run.layers  # every block's linears and what lies between them
    qkv = next(n for n in small if n.kind == "linear")
    assert plan[qkv.name].degrees[0] == 32  # data parallel over all 32 GPUs at TP 1


def test_prediction_within_bound(small):
    run = ROWS[0]
    result = predict(run, small)
    assert result.fits
    assert abs(predicted_tflops(run, result) / run.tflops - 1) <= BOUND


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2])
def test_prediction_within_bound_larger(index):
    run = ROWS[index]
    result = predict(run)
    assert result.fits
    assert abs(predicted_tflops(run, result) / run.tflops - 1) <= BOUND
