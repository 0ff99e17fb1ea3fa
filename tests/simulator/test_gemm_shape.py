"""The GPU products' rate by shape (``simulator.gemm_shape``): tile and wave quantization over
the SMs, a per-tile rate r∞·K/(K + n½) over the reduction length; CPUs keep Hockney's form."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from simulator.cost import AnalyticalCostModel, gemm_efficiency
from simulator.devices import DeviceSpec
from simulator.gemm_shape import backward_shapes, shape_efficiency, tile_wave_efficiency
from simulator.presets import A100_GEMM_HALF, get_topology
from strategies.graph import Dim, OpNode, TensorSpec, Weight
from strategies.region import full_box

A100 = get_topology("a100-1x8").devices[0]
R_INF = 267.9 / 312


def linear(rows: int, fin: int, fout: int) -> OpNode:
    return OpNode("fc", "linear", ("x",), TensorSpec((rows, fout), "bfloat16"),
                  (Dim("sample", rows, "sample"), Dim("out_features", fout, "parameter"),
                   Dim("in_features", fin, "reduction")),
                  weights=(Weight("weight", "fc.weight", TensorSpec((fout, fin), "bfloat16")),),
                  input_specs=(TensorSpec((rows, fin), "bfloat16"),), flops=2 * rows * fin * fout)


def test_a100_and_h100_presets_carry_their_sms():
    assert (A100.sms, A100.gemm_half, A100.gemm_rate) == (108, A100_GEMM_HALF, R_INF)
    assert get_topology("h100-1x8").devices[0].sms == 132
    assert get_topology("local-cpu-2").devices[0].sms == 0


def test_tile_and_wave_counts_by_hand():
    # 2048 × 9600: 128×128 tiles 16·75 = 1200 in ⌈1200/108⌉ = 12 waves:
    # 12·108·128² = 21,233,664 tile elements for 19,660,800: 25/27
    assert tile_wave_efficiency(2048, 9600, 108) == pytest.approx(25 / 27, rel=1e-12)
    # 2048 × 13824 in 128×128: 16·108 = 1728 tiles, 16 full waves: every SM busy
    assert tile_wave_efficiency(2048, 13824, 108) == 1.0
    # one more tile column, 2048 × 13952: 128×128 16·109 = 1744 tiles in 17 waves:
    # 2048·13952 / (17·108·128²)
    assert tile_wave_efficiency(2048, 13952, 108) == pytest.approx(2048 * 13952 / (17 * 108 * 128 * 128), rel=1e-12)
    # 64 rows: one 128×128 tile row of 32 tiles in one wave, half of each tile idle
    assert tile_wave_efficiency(64, 4096, 108) == pytest.approx(64 * 4096 / (108 * 128 * 128), rel=1e-12)
    # 8 batched 128 × 128 products: 8 tiles in one wave of 108 SMs; 200 of them in 2 waves
    assert tile_wave_efficiency(128, 128, 108, batch=8) == pytest.approx(8 / 108, rel=1e-12)
    assert tile_wave_efficiency(128, 128, 108, batch=200) == pytest.approx(200 / 216, rel=1e-12)
    # 128 × 27648: 216 tiles of 128×128 in two full waves
    assert tile_wave_efficiency(128, 256 * 108, 108) == 1.0
    # the H100's 132 SMs take 1728 tiles in ⌈1728/132⌉ = 14 waves
    assert tile_wave_efficiency(2048, 13824, 132) == pytest.approx(1728 / (14 * 132), rel=1e-12)


def test_a_linears_forward_and_backward_rates_by_hand():
    """1T's fused query-key-value product at TP 8: 2048 tokens × 9600 out × 25600 in."""
    node = linear(2048, 25600, 9600)
    fwd = R_INF * 25 / 27 * 25600 / (25600 + A100_GEMM_HALF)
    # dA = dC·Wᵀ: 2048 × 25600 over 9600; 128×128 16·200 = 3200 tiles in 30 waves (3240): 80/81
    d_a = R_INF * 80 / 81 * 9600 / (9600 + A100_GEMM_HALF)
    # dW = dCᵀ·X: 25600 × 9600 over 2048; 128×128 200·75 = 15000 tiles in 139 waves (15012)
    d_w = R_INF * 15000 / 15012 * 2048 / (2048 + A100_GEMM_HALF)
    got = gemm_efficiency(node, full_box(node.shape), A100)
    assert got == pytest.approx((fwd, d_a, d_w), rel=1e-12)
    model = AnalyticalCostModel()
    f, b = model.op_time(node, full_box(node.shape), A100)
    launch = model.launch(A100)
    assert f == pytest.approx(node.flops / (312e12 * fwd) + launch, rel=1e-12)
    # dA and dW, each the forward's FLOPs at its own rate
    assert b == pytest.approx(node.flops / (312e12 * d_a) + node.flops / (312e12 * d_w) + 2 * launch, rel=1e-12)


def test_backward_shapes_and_shape_efficiency_formula():
    assert backward_shapes(3, 10, 20, 30) == ((3, 10, 30, 20), (3, 30, 20, 10))
    assert shape_efficiency(1, 2048, 13824, 4096, A100) == pytest.approx(R_INF * 4096 / (4096 + A100_GEMM_HALF))


def test_rate_rises_with_the_reduction_length_and_the_rows():
    rates = [shape_efficiency(1, 2048, 13824, k, A100) for k in (256, 1024, 4096, 16384, 65536)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(R_INF * 65536 / (65536 + A100_GEMM_HALF), rel=1e-12)
    rows = [shape_efficiency(1, m, 4096, 4096, A100) for m in (16, 32, 64, 128)]
    assert rows == sorted(rows) and len(set(rows)) == 4


def test_matmul_batches_its_tiles():
    node = OpNode("mm", "matmul", ("a", "b"), TensorSpec((8, 128, 128), "bfloat16"),
                  (Dim("batch0", 8, "sample"), Dim("rows", 128, "attribute"), Dim("cols", 128, "attribute"),
                   Dim("inner", 512, "reduction")),
                  input_specs=(TensorSpec((8, 128, 512), "bfloat16"), TensorSpec((8, 512, 128), "bfloat16")),
                  flops=2 * 8 * 128 * 128 * 512)
    fwd, _, _ = gemm_efficiency(node, full_box(node.shape), A100)
    assert fwd == pytest.approx(R_INF * 8 / 108 * 512 / (512 + A100_GEMM_HALF), rel=1e-12)


def test_devices_without_sms_keep_hockneys_smallest_dimension():
    node = linear(2048, 25600, 9600)
    no_tiles = dataclasses.replace(A100, sms=0)
    e = R_INF * 2048 / (2048 + A100_GEMM_HALF)
    assert gemm_efficiency(node, full_box(node.shape), no_tiles) == pytest.approx((e, e, e), rel=1e-12)
    cpu = DeviceSpec("cpu-half", 64 << 30, {"float32": 1e12}, 500e9, gemm_half=24.0)
    small = linear(8, 1024, 1024)
    assert gemm_efficiency(small, full_box(small.shape), cpu) == (8 / 32, 8 / 32, 8 / 32)
    assert gemm_efficiency(small, full_box(small.shape), get_topology("local-cpu-2").devices[0]) is None


def test_sms_is_checked_and_round_trips(tmp_path):
    from simulator.topology import Topology

    with pytest.raises(ValueError, match=r"device 'A100-SXM4-80GB': sms = -1: must be an int >= 0"):
        dataclasses.replace(A100, sms=-1)
    with pytest.raises(ValueError, match=r"sms = True: must be an int >= 0"):
        dataclasses.replace(A100, sms=True)  # a bool is no SM count (the JSON rule refuses it too)
    t = get_topology("a100-1x8")
    t.save(tmp_path / "a100.json")
    back = Topology.load(tmp_path / "a100.json")
    assert back == t and back.devices[0].sms == 108
    assert pickle.loads(pickle.dumps(t)) == t and pickle.loads(pickle.dumps(A100)).sms == 108
    assert dataclasses.replace(A100, sms=0).cost_key != A100.cost_key
