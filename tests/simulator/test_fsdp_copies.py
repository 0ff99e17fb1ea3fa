"""FSDP2's copies on the compute stream (``CostModel.fsdp_copies``, ``simulator.zero3``): after
each level-3 all-gather every member copies the gathered bytes out of the flat buffer (read +
write), before each level-2/3 reduce-scatter it copies its gradients into the flat input in the
reduce dtype and divides it in place, (1 + 3·wide) times the gradients' bytes. Charged by hand on
an MLP and a LLaMA whose recomputed layers gather once for their recomputation and backward;
delta simulation equals full; the folded simulation equals the per-device one."""

import math

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import Lowerings, simulate_plan, timed_graph
from simulator.step import COPY_TRAFFIC
from simulator.zero3 import fsdp_copy_in_traffic
from strategies import baseline
from strategies.megatron_layers import layer_ops, layer_recomputed
from strategies.zero import gather_groups
from tests.conftest import traced
from tests.simulator.delta_walk import delta_walk, fold_equals_full

COPIES = get_cost_model("analytical", fsdp_copies=True)
PLAIN = get_cost_model("analytical")


def _copy_seconds(graph, plan, topology: str, cost=COPIES, device: int = 0) -> dict[str, float]:
    """Seconds of device ``device``'s copy tasks in one simulation, by kind ("copy-out", "copy-in")."""
    topo = get_topology(topology)
    lowerings = Lowerings(graph, plan)
    tg, *_ = timed_graph(lowerings.first(topo, True), topo, cost, "adam", None, True, relower=lowerings)
    out = {"copy-out": 0.0, "copy-in": 0.0}
    for t in range(len(tg)):
        kind = tg.label(t).split(" ", 1)[0]
        if kind in out and tg.device[t] == device:
            assert tg.resources[t] == (device,)  # on the device, as the compute stream runs it
            out[kind] += float(tg.duration[t])
    return out


def _weight_bytes(graph, n: int = 8, itemsize: int = 2) -> int:
    """Every trainable weight's bytes (each name once) at ``itemsize`` bytes an element (bf16:
    2), its elements padded to a multiple of the ``n`` members (FSDP's dim-0 padding)."""
    shapes = {w.name: w.spec.shape for node in graph for w in node.weights if w.trainable}
    return sum(-(-math.prod(shape) // n) * n * itemsize for shape in shapes.values())


def test_fsdp_copies_by_hand():
    """FSDP over 8 devices, bf16 reducing in float32, one micro-batch: each weight gathered for
    its forward and its backward, copied out both times (2 · 2 bytes an element), its gradient
    copied in and pre-divided ((1 + 3·2) · 2 bytes an element): 22 bytes per parameter over HBM;
    the device's busy time grows by exactly that, and without the flag nothing is charged."""
    graph = traced("mlp", batch_size=16)
    plan = baseline("fsdp", graph, 8).with_precision("bf16", "float32")
    weights = _weight_bytes(graph)
    bandwidth = get_topology("a100-1x8").devices[0].memory_bandwidth
    got = _copy_seconds(graph, plan, "a100-1x8")
    assert got["copy-out"] == pytest.approx(2 * COPY_TRAFFIC * weights / bandwidth, rel=1e-12)
    assert got["copy-in"] == pytest.approx((1 + 3 * 2) * weights / bandwidth, rel=1e-12)
    assert fsdp_copy_in_traffic(weights, 2) == 7 * weights and fsdp_copy_in_traffic(weights, 1) == 4 * weights
    assert _copy_seconds(graph, plan, "a100-1x8", PLAIN) == {"copy-out": 0.0, "copy-in": 0.0}
    topo = get_topology("a100-1x8")
    with_copies = simulate_plan(graph, plan, topo, COPIES, optimizer="adam")
    without = simulate_plan(graph, plan, topo, PLAIN, optimizer="adam")
    assert with_copies.busy_time[0] - without.busy_time[0] == pytest.approx(22 * weights / 2 / bandwidth, rel=1e-9)
    assert with_copies.iteration_time >= without.iteration_time  # here they fit in waits on the collectives
    assert with_copies.peak_memory_bytes == without.peak_memory_bytes


def test_recomputed_layers_copy_their_weights_once_a_pass():
    """LLaMA under FSDP2's per-layer units with every second layer recomputed: the backward's one
    call gathers a recomputed layer for its recomputation and its backward, and copies its
    weights out once, so the copies are those of the plan without recompute (22 bytes a
    parameter in all)."""
    graph = traced("llama", batch_size=8)
    plan = baseline("fsdp", graph, 8).with_precision("bf16", "float32")
    assert plan.fsdp_unit == "block"
    layers = layer_ops(graph)
    recomputed = layer_recomputed(plan, graph, layers[1::2])
    assert any(recomputed[op].recompute for op in layers[1])
    plain, again = _copy_seconds(graph, plan, "a100-1x8"), _copy_seconds(graph, recomputed, "a100-1x8")
    assert again["copy-out"] == pytest.approx(plain["copy-out"], rel=1e-12)
    assert again["copy-in"] == pytest.approx(plain["copy-in"], rel=1e-12)
    bandwidth = get_topology("a100-1x8").devices[0].memory_bandwidth
    assert again["copy-out"] == pytest.approx(2 * COPY_TRAFFIC * _weight_bytes(graph) / bandwidth, rel=1e-12)


def test_delta_equals_full_with_copies():
    """30 one-op proposals from FSDP, each op's level drawn (0-3): the search's Evaluator under
    the copies' cost model equals a full simulation on each (``delta_walk``)."""
    graph = traced("mlp", batch_size=16)
    walked = delta_walk(graph, "a100-1x8", lambda n: baseline("fsdp", graph, n), (0, 1, 2, 3), seed=11, cost=COPIES)
    assert len(walked) >= 15
    assert any(u.zero == 3 for low in walked for u in gather_groups(low))


def test_folded_equals_per_device_with_copies():
    """FSDP over two a100 nodes' 16 devices with the copies: the folded simulation (fewer tasks)
    equals the per-device one in iteration time, peaks and busy time."""
    graph = traced("mlp", batch_size=32)
    fold_equals_full(graph, baseline("fsdp", graph, 16).with_precision("bf16", "float32"), "a100-2x8", COPIES)


def test_published_rows_charge_them_on_fsdp2_rows_only():
    """``published_runs.row_cost``: torchtitan's FSDP2 rows run with the copies, Megatron-LM's
    rows (DDP buckets, no level-3 weights) without."""
    from benchmarks.published_data import ROWS
    from benchmarks.published_runs import row_cost

    assert {r.plan: row_cost(r).fsdp_copies for r in ROWS} == {"fsdp": True, "megatron": False}
