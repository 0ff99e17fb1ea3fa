"""Mixed precision in the simulator (docs/design.md, "Mixed precision"): the compute dtype's
peak, 2-byte activations, transfers and gradient buckets, and ZeRO's bytes per parameter
(Rajbhandari et al. 2020: 2 + 2 + 12 with Adam, 2 + 2 + 4 + 4 with SGD's momentum); the
cached lowering equals the reference and delta simulation equals full simulation."""

import dataclasses
import random

import pytest

from simulator.cost import AnalyticalCostModel, get_cost_model, partition_flops
from simulator.memory import memory_breakdown, peak_memory
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import PlanError, Strategy, baseline, data_parallel
from strategies.lowering import lower, lower_reference
from strategies.precision import compute_graph
from tests.conftest import traced
from tests.strategies.test_lowering_reference import _assert_equal


@pytest.fixture(scope="module")
def mlp():
    return traced("mlp")


def test_a_linear_in_bf16_on_a100_runs_at_312_tflops(mlp):
    a100 = dataclasses.replace(get_topology("a100-1x8").devices[0], gemm_half=0.0)  # the peak, no GEMM curve
    cost = AnalyticalCostModel(efficiency=(1.0, 1.0), launch_overhead=0.0)
    node = next(n for n in mlp if n.kind == "linear")
    box = tuple((0, s) for s in node.shape)
    bf16 = compute_graph(mlp, "bfloat16")[node.name]
    f32, _ = cost.op_time(node, box, a100)
    f16, _ = cost.op_time(bf16, box, a100)
    flops = partition_flops(node, box)
    # roofline: max(FLOPs / peak, bytes / bandwidth); the tiny mlp is memory bound, so compare both terms
    from simulator.cost import partition_bytes
    assert f32 == max(flops / 19.5e12, partition_bytes(node, box) / a100.memory_bandwidth)
    assert f16 == max(flops / 312e12, partition_bytes(bf16, box) / a100.memory_bandwidth)
    assert partition_bytes(bf16, box) * 2 == partition_bytes(node, box)  # every operand in 2 bytes
    big = traced("mlp", batch_size=4096)  # a compute-bound linear: exactly FLOPs / 312e12
    node = max((n for n in big if n.kind == "linear"), key=lambda n: n.flops)
    box = tuple((0, s) for s in node.shape)
    fwd, _ = cost.op_time(compute_graph(big, "bfloat16")[node.name], box, a100)
    if partition_flops(node, box) / 312e12 > partition_bytes(compute_graph(big, "bfloat16")[node.name], box) / a100.memory_bandwidth:
        assert fwd == partition_flops(node, box) / 312e12


@pytest.mark.parametrize("optimizer,per_param", [("adam", 16), ("sgd", 12)])
def test_memory_by_hand_mlp_data_parallel(mlp, optimizer, per_param):
    """mlp tiny (batch 4: 16 -> 32 -> 32 -> 10, two ReLUs) data parallel on 2 devices in bf16."""
    low = lower(mlp, data_parallel(mlp, 2).with_precision("bf16"))
    params = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    for d in range(2):
        mem = memory_breakdown(low, optimizer)[d]
        assert mem.weights + mem.gradients + mem.master_weights + mem.optimizer_state == per_param * params
        assert (mem.weights, mem.gradients, mem.master_weights) == (2 * params, 2 * params, 4 * params)
        assert mem.optimizer_state == (8 if optimizer == "adam" else 4) * params
        # 2 samples a device, 2 bytes an element: kept, the input, the two ReLUs' outputs (a ReLU's
        # backward reads its output, a linear's its input: the linears' outputs are read by none),
        # the logits, the int64 targets and the loss's float32 value (autocast keeps losses in
        # float32); the peak at the second ReLU's forward, its linear's output still alive, before
        # the logits and the loss
        assert low.device_bytes.kept[d] == 2 * (16 + 32 * 2 + 10) * 2 + 2 * 8 + 8 == 384
        assert mem.activations == 2 * (16 + 32 * 3) * 2 + 2 * 8 == 464
        assert (mem.receive_buffers, mem.collective_buffers) == (0, 0)
        # the one bucket's flat bf16 gradients (2 bytes a parameter) are held from the first linear's
        # backward to the sync, beside the input and targets (80 B): the peak is there
        assert mem.gradient_buckets == 2 * params + 64 + 16 - 464
        assert peak_memory(low, optimizer)[d] == mem.total == per_param * params + 2 * params + 80


def test_gradient_buckets_and_transfers_move_half_the_bytes(mlp):
    topo = get_topology("a100-1x8")
    cost = get_cost_model("analytical")
    for name in ("data_parallel", "owt", "pipeline"):
        plan = baseline(name, mlp, 2)
        r32 = simulate_plan(mlp, plan, topo, cost)
        r16 = simulate_plan(mlp, plan.with_precision("bf16"), topo, cost)
        l32, l16 = lower(mlp, plan), lower(mlp, plan.with_precision("bf16"))
        assert {k: v // 2 for k, v in l32.gradient_sync.buckets.items()} == \
            {k._replace(dtype="float32"): v for k, v in l16.gradient_sync.buckets.items()} or name != "data_parallel"
        assert len(l16.transfers) == len(l32.transfers)
        for t16, t32 in zip(l16.transfers, l32.transfers):  # the same pieces; a float32 one in half the bytes
            assert t16.nbytes * (2 if mlp[t32.src_op].output.dtype == "float32" else 1) == t32.nbytes
        assert sum(r16.bytes_moved.values()) < sum(r32.bytes_moved.values()) or not r32.bytes_moved
        assert r16.iteration_time < r32.iteration_time


def test_a_model_not_in_float32_is_refused_in_one_line(mlp):
    from dataclasses import replace
    from strategies.graph import OpGraph, TensorSpec, Weight
    g = OpGraph([replace(n, weights=tuple(Weight(w.role, w.name, TensorSpec(w.spec.shape, "float64"), w.trainable)
                                          for w in n.weights)) for n in mlp], mlp.outputs, mlp.name)
    with pytest.raises(PlanError, match=r"precision.*float32 master weights.*float64"):
        lower(g, data_parallel(g, 2).with_precision("bf16"))


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_cached_lowering_equals_the_reference_in_bf16(name):
    from strategies import enumerate_configs
    graph = traced(name)
    rng = random.Random(f"bf16-{name}")
    configs = {node.name: list(enumerate_configs(node, 4, 2)) for node in graph}
    ops = [op for op, cfgs in configs.items() if len(cfgs) > 1]
    cache: dict = {}
    plan = Strategy.of({op: rng.choice(c) for op, c in configs.items()}, 4, 2, "1f1b", "bf16")
    lower(graph, plan.with_precision("model"), cache)  # a model-precision plan shares the cache
    for _ in range(15):
        op = rng.choice(ops)
        proposal = plan.replace(op, rng.choice(configs[op]))
        _assert_equal(lower(graph, proposal, cache), lower_reference(graph, proposal))
        if rng.random() < 0.5:
            plan = proposal


@pytest.mark.parametrize("name,topology,microbatches", [("gpt", "a100-1x8", 2), ("mlp", "p100-2x2", 4)])
def test_delta_equals_full_in_bf16(name, topology, microbatches):
    graph = traced(name, batch_size=16)
    topo = get_topology(topology)
    n = topo.num_devices
    cost = get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost, "adam", "bf16")
    candidates = candidate_configs(graph, n, microbatches, topo.node_size)
    ops = [op for op, cfgs in candidates.items() if len(cfgs) > 1]
    rng = random.Random(f"{name}-{topology}")
    current = evaluate.planned(data_parallel(graph, n).with_microbatches(microbatches, "1f1b"))
    for _ in range(120):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]))
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(graph, proposal, topo, cost, optimizer="adam", summary=True)
        assert (delta.iteration_time, delta.peak_memory_bytes, delta.memory, delta.busy_time,
                delta.bytes_moved, delta.num_tasks) == (full.iteration_time, full.peak_memory_bytes, full.memory,
                                                        full.busy_time, full.bytes_moved, full.num_tasks)
        if rng.random() < 0.5:
            current = proposal
