"""Cost models: the roofline by hand, memoization, and real measurements with their disk cache."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from simulator import cost as cost_mod
from simulator import profiled as profiled_mod
from simulator.cost import (
    CPU_LAUNCH_OVERHEAD,
    GPU_LAUNCH_OVERHEAD,
    AnalyticalCostModel,
    CostModel,
    get_cost_model,
)
from simulator.devices import DeviceSpec
from simulator.profiled import ProfiledCostModel
from soapsearch.trace import trace
from strategies.graph import Dim, OpNode, TensorSpec, Weight
from strategies.region import full_box, partition_box
from strategies.rules import get_rule

GPU = DeviceSpec("A100", 80 << 30, {"float32": 100e12}, 1e12)
CPU = DeviceSpec("cpu", 64 << 30, {"float32": 1e12}, 50e9)
ZOO = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt")


def linear(batch: int, fin: int, fout: int, name: str = "fc") -> OpNode:
    return OpNode(name, "linear", ("x",), TensorSpec((batch, fout)),
                  (Dim("sample", batch, "sample"), Dim("out_features", fout, "parameter"),
                   Dim("in_features", fin, "reduction")),
                  weights=(Weight("weight", f"{name}.weight", TensorSpec((fout, fin))),
                           Weight("bias", f"{name}.bias", TensorSpec((fout,)))),
                  input_specs=(TensorSpec((batch, fin)),), flops=2 * batch * fin * fout)


def relu(shape: tuple[int, ...]) -> OpNode:
    return OpNode("relu", "elementwise", ("x",), TensorSpec(shape),
                  tuple(Dim("sample" if i == 0 else f"d{i}", s, "sample" if i == 0 else "attribute")
                        for i, s in enumerate(shape)),
                  attrs={"fn": "torch.relu", "args": [{"input": 0}], "kwargs": {}},
                  input_specs=(TensorSpec(shape),))


@pytest.fixture(scope="module")
def conv_graph():
    torch.manual_seed(0)
    return trace(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)), (torch.randn(2, 3, 16, 16),))


def conv_node(graph) -> OpNode:
    return next(n for n in graph if n.kind == "conv2d")


# --- analytical ---------------------------------------------------------------------------
def test_roofline_by_hand_compute_bound():
    node = linear(4096, 4096, 4096)
    box = ((0, 4096), (0, 2048), (0, 4096))  # half the out features: half the FLOPs and half the weight
    fwd, bwd = AnalyticalCostModel().op_time(node, box, GPU)
    flops = 2 * 4096 * 4096 * 2048
    nbytes = 4 * (4096 * 4096 + 2048 * 4096 + 2048 + 4096 * 2048)
    compute, memory = flops / (100e12 * 0.6), nbytes / (1e12 * 0.8)
    assert compute > memory
    assert fwd == pytest.approx(compute + GPU_LAUNCH_OVERHEAD, rel=1e-12)
    assert fwd == pytest.approx(1.1503e-3, rel=1e-4)  # 68.7 GFLOP at 60 TFLOP/s + 5 µs
    assert bwd == pytest.approx(2 * compute + 2 * GPU_LAUNCH_OVERHEAD, rel=1e-12)


def test_roofline_by_hand_memory_bound():
    node = linear(1, 4096, 4096)  # a matrix-vector product: the weight read dominates
    fwd, bwd = AnalyticalCostModel().op_time(node, full_box(node.shape), GPU)
    nbytes = 4 * (4096 + 4096 * 4096 + 4096 + 4096)
    compute, memory = 2 * 4096 * 4096 / (100e12 * 0.6), nbytes / (1e12 * 0.8)
    assert memory > 100 * compute
    assert fwd == pytest.approx(memory + GPU_LAUNCH_OVERHEAD, rel=1e-12)
    assert bwd == pytest.approx(2 * memory + 2 * GPU_LAUNCH_OVERHEAD, rel=1e-12)


def test_efficiency_and_launch_arguments():
    node = linear(1, 4096, 4096)
    model = AnalyticalCostModel(efficiency=0.5, launch_overhead=0.0)
    nbytes = 4 * (4096 + 4096 * 4096 + 4096 + 4096)
    assert model.op_time(node, full_box(node.shape), GPU)[0] == pytest.approx(nbytes / 0.5e12)
    assert AnalyticalCostModel().launch(CPU) == CPU_LAUNCH_OVERHEAD
    with pytest.raises(ValueError, match="efficiency"):
        AnalyticalCostModel(efficiency=(0.0, 0.8))


def test_four_way_split_is_a_quarter_when_compute_bound():
    node = linear(8192, 4096, 4096)
    model = AnalyticalCostModel()
    whole = model.op_time(node, full_box(node.shape), GPU)
    for degrees in ((4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 1, 4), (2, 1, 2)):  # R: a quarter of the sums
        part = model.op_time(node, partition_box(node.shape, degrees, 3), GPU)
        assert part[0] == pytest.approx(whole[0] / 4, rel=0.01)
        assert part[1] == pytest.approx(whole[1] / 4, rel=0.01)


def test_backward_twice_forward_for_a_weighted_op_and_unweighted_memory_bound():
    model = AnalyticalCostModel()
    node = linear(512, 1024, 1024)
    fwd, bwd = model.op_time(node, full_box(node.shape), GPU)
    assert bwd == pytest.approx(2 * fwd, rel=1e-12)
    act = relu((64, 1024, 1024))  # 0 FLOPs: memory-bound, one kernel each way, 2x the bytes
    fwd, bwd = model.op_time(act, full_box(act.shape), GPU)
    assert fwd == pytest.approx(2 * 4 * 64 * 1024 * 1024 / 0.8e12 + GPU_LAUNCH_OVERHEAD, rel=1e-12)
    assert bwd - GPU_LAUNCH_OVERHEAD == pytest.approx(2 * (fwd - GPU_LAUNCH_OVERHEAD), rel=1e-12)


def test_leaf_and_view_ops_cost_nothing(graphs):
    graph = graphs("mlp")
    model = AnalyticalCostModel()
    for node in graph:
        if node.kind in ("input", "parameter", "flatten", "reshape"):
            assert model.op_time(node, full_box(node.shape), GPU) == (0.0, 0.0)


class Counting(AnalyticalCostModel):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def _op_time(self, *args):
        self.calls += 1
        return super()._op_time(*args)


def test_memo_by_shape_and_halo(conv_graph):
    node, model = conv_node(conv_graph), Counting()
    boxes = [partition_box(node.shape, (1, 1, 4, 1, 1), k) for k in range(4)]
    times = [model.op_time(node, b, GPU) for b in boxes]
    # edges read 5 input rows (4 + one halo row), inner partitions 6: two distinct costs
    assert model.calls == 2
    assert times[0] == times[3] and times[1] == times[2] and times[0] != times[1]
    assert times[0][0] < times[1][0]
    again = model.op_time(node, boxes[1], GPU)
    assert again is times[1] and model.calls == 2
    model.op_time(node, boxes[1], CPU)  # another device kind is another entry
    assert model.calls == 3


def test_get_cost_model(tmp_path):
    assert isinstance(get_cost_model("analytical"), AnalyticalCostModel)
    assert get_cost_model("analytical") is get_cost_model("analytical")
    assert isinstance(get_cost_model("profiled", cache_path=tmp_path / "p.json"), ProfiledCostModel)
    with pytest.raises(ValueError, match="'analytical', 'profiled'"):
        get_cost_model("roofline")
    assert issubclass(AnalyticalCostModel, CostModel)


# --- profiled -----------------------------------------------------------------------------
def test_profiled_measures_linear_and_conv_on_cpu_then_caches(tmp_path, conv_graph, monkeypatch):
    path = tmp_path / "profile.json"
    model = ProfiledCostModel(cache_path=path, repeats=3, warmup=1)
    node = linear(32, 64, 128)
    cases = [(node, partition_box(node.shape, (1, 2, 1), 1)),
             (conv_node(conv_graph), partition_box(conv_node(conv_graph).shape, (1, 2, 2, 1, 1), 1))]
    measured = [model.op_time(n, b, CPU) for n, b in cases]
    for fwd, bwd in measured:
        assert 0 < fwd < 1 and 0 < bwd < 1 and math.isfinite(fwd + bwd)
    model.flush()
    data = json.loads(path.read_text())
    assert data["format"] == "soapsearch.profile" and len(data["entries"]) == 3  # + the harness's
    assert all(k.startswith(f"cpu|torch {torch.__version__}|") for k in data["entries"])

    def refuse(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(profiled_mod, "measure_partition", refuse)
    second = ProfiledCostModel(cache_path=path)
    assert [second.op_time(n, b, CPU) for n, b in cases] == measured


def test_profiled_tolerates_a_corrupt_cache(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        model = ProfiledCostModel(cache_path=path, repeats=1, warmup=0)
    assert len(model) == 0
    node = linear(8, 16, 16)
    assert model.op_time(node, full_box(node.shape), CPU)[0] >= 0
    model.flush()
    assert len(json.loads(path.read_text())["entries"]) == 2  # the partition and the harness


def test_profiled_subtracts_the_harness_once_per_device_kind(tmp_path, monkeypatch):
    raw = {(8, 16, 16): (50e-6, 120e-6), (8, 32, 16): (5e-6, 30e-6), (8, 64, 16): (40e-6, 0.0)}
    monkeypatch.setattr(profiled_mod, "measure_partition", lambda node, box, **kw: raw[node.shape])
    harness = []
    monkeypatch.setattr(profiled_mod, "harness_overhead", lambda **kw: harness.append(1) or (10e-6, 50e-6))
    model = ProfiledCostModel(cache_path=tmp_path / "p.json")
    got = [model.op_time(n, full_box(n.shape), CPU) for n in (linear(8, 16, 16), linear(8, 16, 32), linear(8, 16, 64))]
    assert got == [(pytest.approx(40e-6), pytest.approx(70e-6)), (0.0, 0.0), (pytest.approx(30e-6), 0.0)]
    assert len(harness) == 1 and len(model) == 4  # measured once, cached with the raw figures


def test_harness_overhead_times_a_call_that_computes_nothing():
    fwd, bwd = profiled_mod.harness_overhead(repeats=3, warmup=1)  # the real harness, no stub
    assert 0 < fwd < 0.01 and 0 < bwd < 0.01


def test_profiled_env_cache_dir_and_fallbacks(tmp_path, monkeypatch):
    monkeypatch.setenv("SOAPSEARCH_CACHE_DIR", str(tmp_path))
    model = ProfiledCostModel(repeats=1, warmup=0)
    assert model.cache_path == tmp_path / "profile.json"
    opaque = OpNode("mystery", "some_opaque_kind", ("x",), TensorSpec((4, 4)),
                    (Dim("sample", 4, "sample"), Dim("d1", 4, "attribute")),
                    input_specs=(TensorSpec((4, 4)),), flops=128)
    box = full_box(opaque.shape)
    assert model.op_time(opaque, box, CPU) == AnalyticalCostModel().op_time(opaque, box, CPU)
    if not torch.cuda.is_available():  # a GPU kind cannot be measured without CUDA: analytical
        node = linear(8, 16, 16)
        assert model.op_time(node, full_box(node.shape), GPU) == \
            AnalyticalCostModel().op_time(node, full_box(node.shape), GPU)
    assert len(model) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to profile a GPU kind")
def test_profiled_on_cuda(tmp_path):
    node = linear(256, 512, 512)
    fwd, bwd = ProfiledCostModel(cache_path=tmp_path / "p.json", repeats=3, warmup=2).op_time(
        node, full_box(node.shape), GPU)
    assert 0 < fwd < 0.1 and 0 < bwd < 0.1


class Recording(AnalyticalCostModel):
    def __init__(self):
        super().__init__()
        self.kinds: set[str] = set()

    def _op_time(self, node, *args):
        self.kinds.add(node.kind)
        return super()._op_time(node, *args)


def split_box(node: OpNode):
    """The last partition of a 2-way split of the first splittable even dim, or None."""
    rule = get_rule(node.kind)
    for i, ok in enumerate(rule.splittable(node)):
        degrees = tuple(2 if j == i else 1 for j in range(len(node.shape)))
        if ok and node.shape[i] % 2 == 0 and rule.check_degrees(node, degrees) is None:
            return partition_box(node.shape, degrees, 1)
    return None


@pytest.mark.parametrize("name", ZOO)
def test_every_op_of_the_tiny_zoo(name, graphs, tmp_path):
    fallback = Recording()
    profiled = ProfiledCostModel(cache_path=tmp_path / "p.json", repeats=1, warmup=0,
                                 fallback=fallback)
    analytical = AnalyticalCostModel()
    splits = 0
    for node in graphs(name):
        boxes = [full_box(node.shape)] + ([b] if (b := split_box(node)) is not None else [])
        splits += len(boxes) - 1
        for box in boxes:
            for model in (profiled, analytical):
                fwd, bwd = model.op_time(node, box, CPU)
                assert math.isfinite(fwd) and math.isfinite(bwd) and fwd >= 0 and bwd >= 0, \
                    (node.name, node.kind, box)
            if node.kind not in cost_mod.LEAF_KINDS | cost_mod.VIEW_KINDS:
                assert analytical.op_time(node, box, CPU)[0] > 0, node.name
    assert splits > 0
    assert fallback.kinds <= {"input", "parameter", "constant"}, \
        f"ops of these kinds were not measured: {fallback.kinds}"
    assert len(profiled) > 0


def traced_gpt():
    from tests.conftest import traced

    return traced("gpt")


def test_gemm_size_is_the_smallest_product_dimension(conv_graph, graphs):
    from strategies.rules import get_rule

    fc = linear(8, 1024, 512)
    assert get_rule("linear").gemm_size(fc, full_box(fc.shape)) == 8
    assert get_rule("linear").gemm_size(fc, partition_box(fc.shape, (1, 128, 1), 0)) == 4  # 512 / 128 columns
    conv = conv_node(conv_graph)  # [2, 8, 16, 16] from 3 channels, 3x3: min(2*16*16, 8, 3*9)
    assert get_rule("conv2d").gemm_size(conv, full_box(conv.shape)) == 8
    assert get_rule("conv2d").gemm_size(conv, partition_box(conv.shape, (2, 4, 2, 2, 1), 0)) == 2  # 2 channels
    assert get_rule("conv2d").gemm_size(conv, partition_box(conv.shape, (2, 1, 8, 8, 1), 0)) == 1 * 2 * 2  # pixels
    lstm = next(n for n in graphs("rnntc") if n.kind == "lstm")  # [batch 4, seq 8, hidden 16]
    assert get_rule("lstm").gemm_size(lstm, full_box(lstm.shape)) == 4
    assert get_rule("lstm").gemm_size(lstm, partition_box(lstm.shape, (2, 1, 1), 1)) == 2
    assert get_rule("elementwise").gemm_size(relu((4, 4)), full_box((4, 4))) is None


def test_a_half_performance_length_slows_thin_products_only():
    # [8, 1024] x [1024, 1024] on 1 TFLOP/s, 500 GB/s, n_half = 24: the compute side at 8 / 32
    # of the peak, 16.8 MFLOP / 0.25 TFLOP/s = 67.1 us, over the memory side (4.3 MB / 400 GB/s)
    half = DeviceSpec("cpu-half", 64 << 30, {"float32": 1e12}, 500e9, gemm_half=24.0)
    fast = DeviceSpec("cpu-fast", 64 << 30, {"float32": 1e12}, 500e9)
    model = AnalyticalCostModel()
    thin, wide = linear(8, 1024, 1024), linear(4096, 1024, 1024)
    flops = 2 * 8 * 1024 * 1024
    fwd, bwd = model.op_time(thin, full_box(thin.shape), half)
    assert fwd == pytest.approx(flops / (1e12 * 8 / 32) + model.launch(half), rel=1e-12)
    assert bwd == pytest.approx(2 * flops / (1e12 * 8 / 32) + 2 * model.launch(half), rel=1e-12)
    assert model.op_time(thin, full_box(thin.shape), fast)[0] == pytest.approx(  # e_c = 0.6 without n_half
        flops / (1e12 * 0.6) + model.launch(fast), rel=1e-12)
    w_fwd, _ = model.op_time(wide, full_box(wide.shape), half)
    assert w_fwd == pytest.approx(2 * 4096 * 1024 ** 2 / (1e12 * 1024 / 1048) + model.launch(half), rel=1e-12)  # m = 1024
    r = relu((64, 64))  # no product: the constant efficiency either way
    assert model.op_time(r, full_box(r.shape), half) == model.op_time(r, full_box(r.shape), fast)
    # one kind, other figures: the memo keeps them apart (a preset and a calibration, both "cpu")
    same_kind = dataclasses.replace(fast, kind="cpu-half")
    assert model.op_time(thin, full_box(thin.shape), same_kind)[0] < fwd / 2


def test_depthwise_convs_are_not_products_and_attention_is():
    from strategies.rules import get_rule

    g = trace(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8)), (torch.randn(2, 8, 6, 6),))
    dw = next(n for n in g if n.kind == "conv2d")
    assert get_rule("conv2d").gemm_size(dw, full_box(dw.shape)) is None
    att = next(n for n in traced_gpt() if n.kind == "attention")
    q, k = att.input_specs[0].shape, att.input_specs[1].shape
    assert get_rule("attention").gemm_size(att, full_box(att.shape)) == min(q[-2], k[-2], att.shape[-1])


def test_gpu_products_run_at_hockneys_rate_of_their_size_the_rest_at_the_constant():
    """The a100 preset without its SMs: a linear of smallest dimension m runs at 312 TFLOP/s · r∞ · m / (m + n½)
    (r∞ = 267.9 / 312, n½ = ``A100_GEMM_HALF``); attention and ops without a product keep the
    constant 0.6; the CPU presets model no n½."""
    from simulator.cost import gemm_efficiency
    from simulator.presets import A100_GEMM_HALF, get_topology

    a100 = dataclasses.replace(get_topology("a100-1x8").devices[0], sms=0)  # no tiles: Hockney's form
    assert (a100.gemm_rate, a100.gemm_half) == (267.9 / 312, A100_GEMM_HALF)
    model = AnalyticalCostModel()
    for m in (256, 1024, 8192):
        node = dataclasses.replace(linear(16384, 16384, m), output=TensorSpec((16384, m), "bfloat16"))
        e, d_a, d_b = gemm_efficiency(node, full_box(node.shape), a100)
        assert e == d_a == d_b == pytest.approx(267.9 / 312 * m / (m + A100_GEMM_HALF), rel=1e-12)
        fwd, _ = model.op_time(node, full_box(node.shape), a100)
        assert fwd == pytest.approx(node.flops / (312e12 * e) + model.launch(a100), rel=1e-12)
    att = next(n for n in traced_gpt() if n.kind == "attention")
    assert gemm_efficiency(att, full_box(att.shape), a100) is None  # its own kernel: the constant
    assert gemm_efficiency(relu((64, 64)), full_box((64, 64)), a100) is None
    cpu = get_topology("local-cpu-2").devices[0]
    assert gemm_efficiency(linear(8, 1024, 1024), full_box((8, 1024)), cpu) is None


def test_gemm_rate_round_trips_and_is_checked(tmp_path):
    from simulator.presets import get_topology
    from simulator.topology import Topology

    t = get_topology("h100-1x8")
    assert t.devices[0].gemm_rate == pytest.approx(792.1 / 989.4)
    t.save(tmp_path / "h100.json")
    back = Topology.load(tmp_path / "h100.json")
    assert back.devices[0] == t.devices[0] and back.devices[0].cost_key == t.devices[0].cost_key
    assert "gemm_rate" not in get_topology("local-cpu-2").to_json()["devices"][0]  # the default, 1
    with pytest.raises(ValueError, match=r"gemm_rate = 1.5: must be in \(0, 1\]"):
        dataclasses.replace(t.devices[0], gemm_rate=1.5)


def test_profiled_on_a_topology_json_reads_the_cache_calibrated_beside_it(tmp_path):
    from simulator.presets import get_topology

    path = tmp_path / "cal2.json"
    get_topology("local-cpu-2").save(path)
    model = profiled_mod.cost_model_for("profiled", str(path))
    assert isinstance(model, ProfiledCostModel) and model.cache_path == tmp_path / "cal2.profile.json"
    assert profiled_mod.cache_beside(path) == tmp_path / "cal2.profile.json"
    assert profiled_mod.cost_model_for("profiled", "local-cpu-2") is get_cost_model("profiled")
    assert profiled_mod.cost_model_for("analytical", str(path)) is get_cost_model("analytical")
