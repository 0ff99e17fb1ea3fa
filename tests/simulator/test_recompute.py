"""Activation recomputation in the simulator (docs/design.md, "Recompute"): the lowering's kept
bytes drop exactly the dropped outputs, the memory timeline counted by hand, the extra forward
charged to the recompute op's backward, the cached lowering equal to the reference and delta
simulation equal to full simulation on walks that toggle recompute, and the bad inputs."""

from __future__ import annotations

import random

import pytest

from simulator.cost import get_cost_model
from simulator.memory import memory_breakdown, peak_memory
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import build_tasks
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import Strategy, data_parallel, pipeline
from strategies.errors import PlanError
from strategies.lowering import WEIGHT_KINDS, lower, lower_reference
from strategies.drops import DropPoints, drop_points
from tests.conftest import traced
from tests.simulator.test_simulate import mesh


def recompute(plan: Strategy, ops) -> Strategy:
    """``plan`` with recompute set on ``ops``."""
    for op in ops:
        plan = plan.replace(op, plan[op].with_memory(recompute=True))
    return plan


def recomputable(graph) -> list[str]:
    """The ops recompute may be set on: every op with a backward that computes something."""
    return [n.name for n in graph if graph.needs_grad[n.name] and n.kind not in (*WEIGHT_KINDS, "input")]


MID = ("layers_1", "layers_2", "layers_3")
"""The tiny mlp's middle ops (relu, linear, relu): layers_1 and layers_2 drop their outputs
(their consumers recompute), layers_3 keeps its (layers_4 reads it and does not recompute)."""


def test_the_mlp_keeps_exactly_the_outputs_its_consumers_save():
    g = traced("mlp")
    plain, low = lower(g, data_parallel(g, 2)), lower(g, recompute(data_parallel(g, 2), MID))
    half = 512 // 2  # a (4, 32) float32 output cut on the samples 2 ways
    assert [low.pieces[op].dropped for op in MID] == [(half, half), (half, half), ()]
    assert low.pieces["layers_3"].activations == (half, half)
    # without recompute the linears' outputs are transient (a ReLU's backward reads its output, a
    # linear's its input: ``strategies.saved``), so the plan keeps as many bytes: layers_0 for
    # layers_3 instead of layers_1
    assert low.device_bytes.kept == plain.device_bytes.kept == (744, 744)
    assert [plain.pieces[op].dropped for op in ("layers_0", "layers_2")] == [(half, half)] * 2
    assert drop_points(g, low.strategy) == {("layers_1", d): DropPoints("layers_2", "layers_3") for d in (0, 1)} | {
        ("layers_2", d): DropPoints("layers_3", "layers_3") for d in (0, 1)}
    assert drop_points(g, plain.strategy) == {("layers_0", d): DropPoints("layers_1", "layers_0") for d in (0, 1)} | {
        ("layers_2", d): DropPoints("layers_3", "layers_2") for d in (0, 1)}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_activation_timeline_by_hand(microbatches):
    """Device 0 of data parallel (per micro-batch halves: inputs 128/m, targets 16/m, each
    (4, 32) output 256/m, the logits 80/m, the loss 8). Forward: inputs, targets, layers_0, then
    layers_1 and layers_2 both alive (dropped ones live until their consumer's forward), layers_1
    freed, layers_3 added (layers_2 alive) — the pass's highest point, K + 2·256/m above its start
    less what is still to come (logits, loss). Backward: after the loss and layers_4, layers_3's
    backward recomputes the chain layers_1, layers_2 (2·256/m back). Peak max((w−1)·K + r_f, w·K + r_b)."""
    g = traced("mlp")
    plan = recompute(data_parallel(g, 2).with_microbatches(microbatches, "gpipe"), MID)
    m = microbatches
    out, logits, loss = 256 // m, 80 // m, 8
    kept = (128 + 16) // m + 2 * out + logits + loss  # inputs, targets, layers_0, layers_3, logits, loss
    rise_f = (128 + 16) // m + 4 * out  # up to layers_3 with layers_2 still alive
    rise_b = -loss - logits + 2 * out
    want = max((m - 1) * kept + rise_f, m * kept + rise_b)
    low = lower(g, plan)
    assert low.device_bytes.kept[0] == kept
    got = memory_breakdown(low, "sgd")[0]
    assert got.activations == want == {1: 1168, 2: 960}[m]
    assert peak_memory(low, "sgd")[0] == got.total
    plain = memory_breakdown(lower(g, data_parallel(g, 2).with_microbatches(m, "gpipe")), "sgd")[0]
    # no recompute: the same K (layers_1 for layers_0), the linears' outputs transient: at layers_3's
    # forward inputs, targets, layers_1, layers_2 and layers_3
    assert plain.activations == max((m - 1) * kept + (128 + 16) // m + 3 * out, m * kept)
    assert got.activations > plain.activations  # recomputing a ReLU chain keeps its input instead


def test_1f1b_pipeline_timeline_by_hand():
    """Two 1F1B stages, 4 micro-batches: stage 0 (inputs, targets, layers_0, layers_1; recompute
    on layers_0 and layers_1: layers_0 dropped, layers_1 kept — layers_2 on stage 1 does not
    recompute) warms up 2 micro-batches. Per micro-batch it keeps inputs 64, targets 8 and
    layers_1's 128 (K = 200); its forward pass rises to 64 + 8 + 128 + 128 (layers_0 alive until
    layers_1's forward), its backward pass recomputes layers_0 at layers_1's backward (+128):
    peak max(K + 328, 2·K + 128) = 528; without recompute layers_0's output is read by no
    backward (a ReLU's reads its output: ``strategies.saved``), so K is the same and the peak
    max(K + 328, 2·K) = 528 too."""
    g = traced("mlp")
    base = pipeline(g, 2, microbatches=4, schedule="1f1b")
    low = lower(g, recompute(base, ("layers_0", "layers_1")))
    assert [p.device for p in low.partitions["layers_1"][0]] == [0]
    assert low.pieces["layers_0"].dropped == (128, 0) and low.pieces["layers_1"].dropped == ()
    assert low.device_bytes.kept[0] == 200
    assert memory_breakdown(low, "sgd")[0].activations == max(200 + 328, 2 * 200 + 128) == 528
    assert memory_breakdown(lower(g, base), "sgd")[0].activations == max(200 + 328, 2 * 200) == 528


def test_the_backward_is_charged_the_forward_again():
    """Each recompute partition's backward task lasts its forward task's duration longer."""
    g = traced("gpt")
    topo, cost = mesh(2), get_cost_model("analytical")
    base = data_parallel(g, 2)
    ops = ["blocks_0_mlp_fc", "blocks_0_mlp_gelu", "scaled_dot_product_attention"]
    plain, redo = (build_tasks(lower(g, p), topo, cost) for p in (base, recompute(base, ops)))

    def durations(tg):
        return {tg.name[t]: tg.duration[t] for t in range(len(tg)) if isinstance(tg.name[t], tuple)}

    a, b = durations(plain), durations(redo)
    assert a.keys() == b.keys()
    for key, t in a.items():
        if key[0] == "bwd" and key[1] in ops:
            assert b[key] == pytest.approx(t + a[("fwd",) + key[1:]], rel=1e-12), key
        else:
            assert b[key] == t, key
    busy = [simulate_plan(g, p, topo, cost).busy_time for p in (base, recompute(base, ops))]
    assert all(r > p for p, r in zip(*busy))


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("microbatches,schedule", [(1, "gpipe"), (2, "1f1b")])
def test_the_cached_lowering_equals_the_reference_with_recompute(name, microbatches, schedule):
    """Walks of one-op changes through one cache, recompute toggled on random ops (a producer's
    dropped bytes follow its consumers' flags)."""
    from strategies import enumerate_configs
    from tests.strategies.test_lowering_reference import _assert_equal
    g = traced(name)
    rng = random.Random(f"{name}-{microbatches}")
    configs = {node.name: list(enumerate_configs(node, 4, microbatches)) for node in g}
    flips = recomputable(g)
    plan = Strategy.of({op: rng.choice(cfgs) for op, cfgs in configs.items()}, 4, microbatches, schedule)
    plan = recompute(plan, rng.sample(flips, len(flips) // 2))
    cache: dict = {}
    _assert_equal(lower(g, plan, cache), lower_reference(g, plan))
    for _ in range(30):
        op = rng.choice(flips)
        if rng.random() < 0.6:
            proposal = plan.replace(op, plan[op].with_memory(recompute=not plan[op].recompute))
        else:
            proposal = plan.replace(op, rng.choice(configs[op]).with_memory(recompute=plan[op].recompute))
        low = lower(g, proposal, cache)
        _assert_equal(low, lower_reference(g, proposal))
        if rng.random() < 0.5:
            plan = proposal
    assert any(p.dropped for p in low.pieces.values())


@pytest.mark.parametrize("name,topology,microbatches,schedule", [
    ("gpt", "p100-2x2", 2, "1f1b"), ("mlp", "local-cpu-4", 4, "1f1b"), ("gpt", "p100-1x4", 1, "gpipe")])
def test_delta_equals_full_with_recompute(name, topology, microbatches, schedule):
    """test_delta's walk with recompute toggled: every figure equals a from-scratch simulation."""
    graph = traced(name, batch_size=16)
    topo, cost = get_topology(topology), get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    candidates = candidate_configs(graph, topo.num_devices, microbatches, topo.node_size)
    flips = recomputable(graph)
    rng = random.Random(name)
    current = data_parallel(graph, topo.num_devices).with_microbatches(microbatches, schedule)
    dropped = 0
    for _ in range(120):
        op = rng.choice(flips)
        if rng.random() < 0.6:
            proposal = current.replace(op, current[op].with_memory(recompute=not current[op].recompute))
        else:
            proposal = current.replace(op, rng.choice(candidates[op]).with_memory(recompute=current[op].recompute))
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(graph, proposal, topo, cost, summary=True)
        assert delta.iteration_time == full.iteration_time, (name, op)
        assert delta.peak_memory_bytes == full.peak_memory_bytes and delta.memory == full.memory
        assert delta.busy_time == full.busy_time and delta.num_tasks == full.num_tasks
        if rng.random() < 0.6:
            current = proposal
            dropped += any(p.dropped for p in lower(graph, current).pieces.values())
    assert dropped > 10  # the walk held dropped outputs often


@pytest.mark.parametrize("op,rule", [
    ("wpe", "op 'wpe': recompute = True: a 'parameter' op is a weight read in place"),
    ("view_9", "op 'view_9': recompute = True: nothing it computes needs a gradient"),
])
def test_recompute_of_an_op_that_keeps_nothing_is_refused(op, rule):
    g = traced("gpt")
    with pytest.raises(PlanError, match="^" + rule.replace("(", r"\(").replace(")", r"\)")):
        lower(g, recompute(data_parallel(g, 2), [op]))
