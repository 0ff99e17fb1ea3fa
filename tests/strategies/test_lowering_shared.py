"""Ops of one shape lowered once (``strategies.lowering_shared``): the lowering that shares
equals the plain one (``lower_reference``) and the simulation equals the one that lowers every
op on its own (iteration time, busy time per device, peak memory, bytes per link kind), on gpt,
llama and resnet101 under data parallel, megatron (sequence parallel, recompute, bf16), fsdp and
pipeline plans at 8 and 64 devices; a search's change to one layer's op leaves the others'
pieces as they were (delta = full); and names that would clash are not shared."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import strategies.lowering_cache as lowering_cache
from simulator.simulate import simulate_plan
from simulator.symmetry import CrossCopy, find_copies
from simulator.taskgraph import label
import simulator.tasks as tasks
from simulator.tasks import TaskCache, build_tasks
from simulator.twins import twin_block
from strategies.baselines import baseline, megatron_lm, recomputed
from strategies.lowering import lower, lower_reference
from strategies.lowering_shared import names_of, renamed, shapes_of
from strategies.megatron import megatron
from strategies.repeats import repeated_blocks
from soapsearch import trace
from soapsearch._models import GPT, GPTConfig
from tests.conftest import traced
from tests.search.delta_check import assert_same_result
from tests.strategies.test_lowering_reference import _assert_equal


def _plans(graph, n, name):
    plans = {"dp": baseline("data_parallel", graph, n), "fsdp": baseline("fsdp", graph, n),
             "pipeline": baseline("pipeline", graph, n, microbatches=2)}
    if name != "resnet101":
        mega = megatron(graph, n, tp=2, pp=2, microbatches=2, sequence_parallel=True)
        plans["megatron"] = recomputed(mega.with_microbatches(2, "1f1b"), graph).with_precision("bf16")
    return plans


@pytest.fixture
def lowered_ops(monkeypatch):
    """The ops ``lower_op`` ran on, in call order."""
    seen = []
    inner = lowering_cache.lower_op

    def counting(graph, strategy, node, m, keep=None):
        seen.append(node.name)
        return inner(graph, strategy, node, m, keep)

    monkeypatch.setattr(lowering_cache, "lower_op", counting)
    return seen


def _gpt(layers: int):
    cfg = GPTConfig(n_layer=layers, n_head=2, n_embd=16, seq_len=8, vocab_size=50)
    return trace(GPT(cfg), (torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))))


def test_the_middle_layers_of_a_transformer_share_their_shapes():
    # a tiny GPT of 4 layers: layers 1 and 2 (their producers and consumers are layers too)
    # have, op by op, the same shapes; layer 0 reads the embedding, layer 3 feeds the final
    # norm
    graph = _gpt(4)
    shapes = shapes_of(graph)
    [block] = [b for b in repeated_blocks(graph) if b.length > 10]
    assert len(block) == 4
    ids = [[shapes[op] for op in layer] for layer in block.instances]
    assert ids[1] == ids[2] and ids[0] != ids[1] and ids[3] != ids[2]
    assert (len(ids[1]), len(set(ids[1]))) == (22, 15)  # the attention's q, k, v ops alike
    assert (len(graph.nodes), len(set(shapes.values()))) == (99, 29)  # 6 layers: 143 ops, 29 shapes


@pytest.mark.parametrize("name", ["gpt", "llama", pytest.param("resnet101", marks=pytest.mark.slow)])
def test_sharing_lowers_as_the_reference_and_lowers_fewer_ops(name, lowered_ops):
    graph = traced(name, batch_size=16)
    counts = {}
    for kind, plan in _plans(graph, 8, name).items():
        lowered_ops.clear()
        _assert_equal(lower(graph, plan), lower_reference(graph, plan))
        counts[kind] = len(lowered_ops)
    assert all(c < len(graph.nodes) for c in counts.values()), counts


def _no_sharing(monkeypatch):
    """Every op lowered, every weight's shards found and every task block built on its own."""
    monkeypatch.setattr(lowering_cache, "renamed", lambda pieces, old, new, delta=0: None)
    monkeypatch.setattr(lowering_cache, "name_map", lambda old, new: None)


@pytest.mark.parametrize("name,n", [("gpt", 8), ("llama", 8), ("resnet101", 8), ("gpt", 64)])
def test_the_simulation_with_sharing_equals_the_one_without(name, n, monkeypatch):
    graph = traced(name, batch_size=2 * n)
    topology = f"a100-{max(1, n // 8)}x8"
    plans = _plans(graph, n, name)
    shared = {k: simulate_plan(graph, p, topology, optimizer="adam") for k, p in plans.items()}
    _no_sharing(monkeypatch)
    for kind, plan in plans.items():
        assert_same_result(shared[kind], simulate_plan(graph, plan, topology, optimizer="adam"))


@pytest.mark.parametrize("name,n,fold", [("gpt", 8, False), ("llama", 8, False), ("gpt", 64, True)])
def test_blocks_copied_from_a_twin_are_the_blocks_built(name, n, fold, monkeypatch):
    # the task graph built with the twins' blocks copied (simulator.twins) is the one built op
    # by op, task for task: labels, durations, resources, edges (folded on copy 0 at 64)
    graph = traced(name, batch_size=2 * n)
    topology, cost = _topology_and_cost(f"a100-{max(1, n // 8)}x8")
    copied = []

    def counting(*args):
        b = twin_block(*args)
        copied[-1] += b is not None
        return b

    monkeypatch.setattr(tasks, "twin_block", counting)
    graphs = []
    for share in (True, False):
        if not share:
            _no_sharing(monkeypatch)
        for plan in _plans(graph, n, name).values():
            copies = find_copies(graph, plan) if fold else None
            try:
                low = lower(graph, plan, None, copies)
            except CrossCopy:  # fsdp: its weights' uses pair up per device
                copies, low = None, lower(graph, plan)
            copied.append(0)
            graphs.append(build_tasks(low, topology, cost, "adam", copies=copies))
    half = len(graphs) // 2
    for got, want in zip(graphs[:half], graphs[half:]):
        _assert_same_tasks(got, want)
    assert copied[half:] == [0] * half and min(copied[:half]) > 0, copied


def _assert_same_tasks(got, want):
    """Two task graphs task for task: labels, durations, resources (listed and flat), devices,
    bytes, edges."""
    assert [label(x) for x in got.name] == [label(x) for x in want.name]
    assert got.duration == want.duration and got.resources == want.resources
    assert got.device == want.device and got.nbytes == want.nbytes and got.category == want.category
    for a, b in zip(got.arrays(), want.arrays()):
        np.testing.assert_array_equal(a, b)
    assert sorted(zip(*map(np.ndarray.tolist, got.edge_arrays()))) == \
        sorted(zip(*map(np.ndarray.tolist, want.edge_arrays())))


def test_a_change_to_one_layer_leaves_the_others_shared_and_delta_equals_full(monkeypatch):
    # data parallel on gpt × 8, then the first layer's attention projection cut on its
    # output features: through one lowering cache and one TaskCache (a search's proposal and
    # its revert), each lowering equals the reference, the other layers keep their pieces,
    # and the delta simulation equals a full one without sharing
    graph = traced("gpt", batch_size=16)
    n, topology = 8, "a100-1x8"
    plan = baseline("data_parallel", graph, n)
    [block] = [b for b in repeated_blocks(graph) if len(b) >= 2 and b.length > 10]
    op = next(o for o in block.instances[0] if graph[o].kind == "linear")
    other = block.instances[1][block.instances[0].index(op)]
    proposal = plan.replace(op, megatron(graph, n, tp=2, pp=1)[op])
    assert proposal[op] != plan[op] and proposal[other] == plan[other]
    cache, tasks = {}, TaskCache(*_topology_and_cost(topology))
    results, others = [], []
    for p in (plan, proposal, plan):
        low = lower(graph, p, cache)
        _assert_equal(low, lower_reference(graph, p))
        results.append(simulate_plan(graph, low, tasks.topology, tasks.cost, optimizer="adam", cache=tasks))
        others.append(low.pieces[other])
    assert others[0] is others[1] is others[2]  # the other layer's op: its pieces never looked at again
    _no_sharing(monkeypatch)
    for p, got in zip((plan, proposal, plan), results):
        assert_same_result(got, simulate_plan(graph, p, topology, optimizer="adam"))
    assert results[0].iteration_time != results[1].iteration_time


def _topology_and_cost(topology):
    from simulator.cost import get_cost_model
    from simulator.presets import get_topology
    return get_topology(topology), get_cost_model("analytical")


def test_names_that_would_clash_are_not_shared():
    graph = traced("gpt")
    low = lower(graph, baseline("data_parallel", graph, 2))
    op = next(node for node in graph if node.kind == "linear")
    names = names_of(graph, op)
    pieces = low.pieces[op.name]
    # one old name standing for two new ones: refused; the same names: the same object
    assert renamed(pieces, (names[0], names[0]), ("a", "b")) is None
    assert renamed(pieces, names, names) is pieces
    moved = renamed(pieces, names, ("x", *names[1:]))
    assert {p.op for mb in moved.partitions for p in mb} == {"x"}
    assert {t.dst_op for t in moved.transfers} <= {"x"} and {r.op for r in moved.weight_reads} == {"x"}
    assert [p.box for mb in moved.partitions for p in mb] == [p.box for mb in pieces.partitions for p in mb]


@functools.lru_cache(maxsize=1)
def _megatron_lm_gpt():
    """A tiny GPT of 8 layers under the plan Megatron-LM runs (``megatron_lm``) on 16 devices:
    T = 2, P = 4 (two layers a stage), d = 2, one sequence a micro-batch (m = 4)."""
    cfg = GPTConfig(n_layer=8, n_head=2, n_embd=16, seq_len=8, vocab_size=50)
    graph = trace(GPT(cfg), (torch.randint(0, 50, (8, 8)), torch.randint(0, 50, (8, 8))))
    return graph, megatron_lm(graph, 16, 2, 4)


def _stage_of(plan, op):
    return min(plan[op].devices) // 4  # stage s runs on devices [4s, 4s + 4)


@pytest.mark.parametrize("fold", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_layer_is_lowered_once_for_every_pipeline_stage(fold, lowered_ops, monkeypatch):
    # stages 1-3 run stage 0's cuts on devices 4s on: their layers' ops take stage 0's pieces
    # renamed and moved (lowering_shared.relative_key); the lowering equals the one that lowers
    # every op (per device: and the reference), and fewer ops are lowered than with renaming alone
    graph, plan = _megatron_lm_gpt()
    assert plan.microbatches == 4
    copies = find_copies(graph, plan) if fold else None
    assert not fold or copies.count == 2
    shared = lower(graph, plan, None, copies)
    moved = list(lowered_ops)
    lowered_ops.clear()
    monkeypatch.setattr(lowering_cache, "relative_key", lambda config, producers, keep: ((object(),), 0))
    renamed_only = lower(graph, plan, None, copies)
    _assert_equal(shared, renamed_only)
    if not fold:
        _assert_equal(shared, lower_reference(graph, plan))
    later = [op for op in lowered_ops if _stage_of(plan, op) > 0]
    assert len(later) > 0 and len(moved) < len(lowered_ops)
    # layers 3-6 (stage 1's second, stages 2 and 3 but the last layer) lower nothing; with
    # renaming alone the first layer of stages 2 and 3 is lowered again
    [block] = [b for b in repeated_blocks(graph) if b.length > 10]
    inner = {op for layer in block.instances[3:7] for op in layer}
    assert not inner & set(moved)
    assert {2, 3} <= {_stage_of(plan, op) for op in inner & set(lowered_ops)}


def test_the_simulation_with_stages_moved_equals_the_one_without(monkeypatch):
    graph, plan = _megatron_lm_gpt()
    got = simulate_plan(graph, plan, "a100-2x8", optimizer="adam")
    _no_sharing(monkeypatch)
    assert_same_result(got, simulate_plan(graph, plan, "a100-2x8", optimizer="adam"))


def test_pieces_moved_there_and_back_are_the_same_and_not_past_the_last_device():
    graph, plan = _megatron_lm_gpt()
    low = lower(graph, plan)
    node = next(node for node in graph if node.kind == "linear" and _stage_of(plan, node.name) == 0)
    names, pieces = names_of(graph, node), low.pieces[node.name]
    there = renamed(pieces, names, names, 12)  # stage 0's devices 0-3 to stage 3's 12-15
    assert {p.device for mb in there.partitions for p in mb} == {12, 13, 14, 15}
    assert renamed(there, names, names, -12) == pieces
    assert renamed(pieces, names, names, 13) is None  # device 3's bytes would move to device 16 of 16


@pytest.mark.parametrize("fold", [False, True])
def test_blocks_of_a_layer_in_another_stage_are_copied_moved_and_equal_the_blocks_built(fold, monkeypatch):
    # megatron_lm on 16 devices of a100-2x8: stages 1-3's layers take stage 0's blocks with
    # every device moved 4, 8 or 12 on and each route's links mapped to the moved route's
    # (simulator.twins); the task graph equals the one built with no block copied, task for task
    graph, plan = _megatron_lm_gpt()
    topology, cost = _topology_and_cost("a100-2x8")
    copies = find_copies(graph, plan) if fold else None
    low = lower(graph, plan, None, copies)
    deltas = sorted({twin[2] for twin in low.twins.values()})
    assert deltas == [0, 4, 8, 12], deltas
    copied = []

    def counting(*args):
        b = twin_block(*args)
        copied.append(b is not None and args[0].twins[args[1].name][2])
        return b

    monkeypatch.setattr(tasks, "twin_block", counting)
    got = build_tasks(low, topology, cost, "adam", copies=copies)
    assert sorted(set(copied) - {False}) == [4, 8, 12], copied
    monkeypatch.setattr(tasks, "twin_block", lambda *args: None)
    _assert_same_tasks(got, build_tasks(low, topology, cost, "adam", copies=copies))


def test_a_block_is_not_moved_onto_devices_unlike_its_own():
    # a topology whose second node's devices have another host overhead: a stage's layer there
    # is built, not copied, and its tasks carry that node's overhead
    import dataclasses
    graph, plan = _megatron_lm_gpt()
    topology, cost = _topology_and_cost("a100-2x8")
    slow = [d if d.node == 0 else dataclasses.replace(d, task_overhead=d.task_overhead + 1e-3)
            for d in topology.devices]
    other = dataclasses.replace(topology, devices=slow)
    low = lower(graph, plan)
    got = build_tasks(low, other, cost, "adam")
    op = next(op for op, twin in low.twins.items() if twin[2] == 8)  # stage 2, node 1
    src = low.twins[op][0]
    [f_got] = [got.duration[t] for t, x in enumerate(got.name) if x[:3] == ("fwd", op, 0) and x[3] == 0]
    [f_src] = [got.duration[t] for t, x in enumerate(got.name) if x[:3] == ("fwd", src, 0) and x[3] == 0]
    assert f_got == pytest.approx(f_src + 1e-3)
