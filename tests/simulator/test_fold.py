"""Folded simulation (``simulator.fold``) = per-device simulation: iteration time, busy time
per device, peak memory and bytes per link kind, on baseline plans and on random plans made
R-fold (a random plan of G devices for the batch / R, its sample cuts repeated on R copies),
GPipe and 1F1B, with micro-batches, ZeRO levels, recompute and bf16, on a100-Nx8, p100-4x4
and k80-16x4; and the fold is taken where it is exact (fewer tasks) and refused where it is
not (a pipeline's loss all-reduce crossing some copies' NICs only)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from simulator.cost import get_cost_model
from simulator.fold import Folded
from simulator.presets import get_topology
from simulator.simulate import FOLD_FROM, simulate_plan
from simulator.symmetry import CrossCopy, find_copies
from simulator.tasks import TaskCache
from strategies import ParallelConfig, Strategy, enumerate_configs
from strategies.baselines import baseline, recomputed
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.lowered import WEIGHT_KINDS
from strategies.megatron import megatron
from tests.conftest import traced


def replicated(small: Strategy, graph, copies: int) -> Strategy:
    """``small`` (a plan of G devices for ``graph``'s batch / ``copies``) on ``copies`` x G
    devices: each op's sample degree times ``copies``, copy r's partition on device + r·G;
    weight ops as they are."""
    g = small.num_devices
    configs = {}
    for node in graph:
        c, i = small[node.name], node.sample_dim
        if node.kind in WEIGHT_KINDS or i is None:
            configs[node.name] = c
            continue
        degrees = tuple(d * copies if k == i else d for k, d in enumerate(c.degrees))
        devices = []
        for k in range(math.prod(degrees)):  # mixed radix, last dim fastest
            coords, rest = [], k
            for d in reversed(degrees):
                coords.append(rest % d)
                rest //= d
            coords.reverse()
            s = c.degrees[i]
            r, coords[i] = divmod(coords[i], s)
            old = 0
            for d, x in zip(c.degrees, coords):
                old = old * d + x
            devices.append(c.devices[old] + r * g)
        configs[node.name] = ParallelConfig(degrees, tuple(devices), c.zero, c.recompute)
    return Strategy.of(configs, g * copies, small.microbatches, small.schedule, small.precision)


def _recomputable(graph, op: str) -> bool:
    return graph[op].kind not in (*WEIGHT_KINDS, "input") and graph.needs_grad[op]


def random_small(graph, n: int, rng: random.Random, microbatches: int, schedule: str) -> Strategy:
    """Every op a random config on ``n`` devices, some recomputed, some sharded (ZeRO 1-3)."""
    configs = {}
    for node in graph:
        c = rng.choice(list(enumerate_configs(node, n, microbatches)))
        zero = rng.choice((0, 0, 1, 2, 3)) if any(w.trainable for w in node.weights) else 0
        recompute = _recomputable(graph, node.name) and rng.random() < 0.2
        configs[node.name] = c.with_memory(zero, recompute)
    return Strategy.of(configs, n, microbatches, schedule)


def assert_same(graph, plan, topology, optimizer="sgd", cost="analytical"):
    """The folded and the per-device simulation of ``plan`` agree (iteration time, busy time,
    peaks, bytes moved); returns both."""
    full = simulate_plan(graph, plan, topology, cost, optimizer=optimizer, fold=False)
    folded = simulate_plan(graph, plan, topology, cost, optimizer=optimizer, fold=True)
    assert folded.iteration_time == pytest.approx(full.iteration_time, rel=1e-12, abs=0)
    assert folded.busy_time == pytest.approx(full.busy_time, rel=1e-12, abs=1e-18)
    assert folded.peak_memory_bytes == full.peak_memory_bytes
    assert folded.bytes_moved == full.bytes_moved
    return full, folded


TOPOLOGIES = {"a100": "a100-{n8}x8", "p100": "p100-4x4", "k80": "k80-16x4"}


def _topology(family: str, n: int) -> str:
    return TOPOLOGIES[family].format(n8=max(1, -(-n // 8)))


@pytest.mark.parametrize("family,cases", [
    ("a100", (("gpt", 8), ("mlp", 16), ("resnet101", 8))), ("p100", (("gpt", 8), ("mlp", 16), ("resnet101", 8))),
    ("k80", (("gpt", 8), ("mlp", 16), ("resnet101", 8))),
    pytest.param("a100", (("gpt", 64), ("resnet101", 64), ("mlp", 32)), marks=pytest.mark.slow)])
def test_baselines_fold_exactly(family, cases):
    """Data parallel, FSDP, ZeRO-1, hybrid (with 2 micro-batches, recompute, bf16) at 8-64
    devices fold (fewer tasks) and equal the per-device run."""
    folded_any = 0
    for name, n in cases:
        graph = traced(name, batch_size=2 * n)
        plans = [baseline(b, graph, n) for b in ("data_parallel", "fsdp", "zero1", "hybrid")]
        hybrid = baseline("hybrid", graph, n).with_microbatches(2, "1f1b")
        plans.append(Strategy.of({op: c.with_memory(recompute=_recomputable(graph, op)) for op, c in hybrid.items()},
                                 n, 2, "1f1b", "bf16"))
        for plan in plans:
            full, folded = assert_same(graph, plan, _topology(family, n), "adam")
            assert find_copies(graph, plan) is not None
            folded_any += folded.num_tasks < full.num_tasks
    assert folded_any >= 12


def test_megatron_folds_on_the_copies_whose_rings_match():
    """T = 2, P = 2, 4 data-parallel copies: inside one a100 node they fold; on two nodes too,
    though the loss value's all-reduce rings the 16 devices through devices 0 and 8's NICs only
    (copy 0's): it runs after every copy's own traffic (``Folded.holds``). On 32 devices (8
    copies of 4): folded on 8, or on 2 of 16 (copies 0-3 and 4-7) where the last stage's loss
    sums ring its 16 devices through copies 0 and 4's NICs only, inside the step (a ring's
    links: ``simulator.comm``)."""
    graph = traced("gpt", batch_size=32)
    inside = recomputed(megatron(graph, 8, tp=2, pp=2, microbatches=4).with_microbatches(4, "1f1b"), graph)
    full, folded = assert_same(graph, inside, "a100-1x8", "adam")
    assert folded.num_tasks * 2 <= full.num_tasks + 400
    across = megatron(graph, 16, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    full, folded = assert_same(graph, across, "a100-2x8")
    assert folded.num_tasks * 4 <= full.num_tasks + 400
    eight = megatron(graph, 32, tp=2, pp=2, microbatches=2)
    assert find_copies(graph, eight).count == 8
    full, folded = assert_same(graph, eight, "a100-4x8")
    assert folded.num_tasks < full.num_tasks / 1.8


def test_a_fold_that_fails_its_timeline_takes_the_copies_its_shared_tasks_allow():
    """``Folded.coarser``: the most copies R' < R under which every asymmetric shared task is
    symmetric (its held copies unchanged by a shift of R / R')."""
    def folded(count, *held):
        return Folded(count, np.ones(1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                      (np.zeros(0, dtype=np.int64),) * 2, tuple(map(frozenset, held)))

    assert folded(8, {0, 4}).coarser() == 2
    assert folded(8, {0, 2, 4, 6}).coarser() == 4
    assert folded(8, {0, 4}, {1, 3, 5, 7}).coarser() == 2
    assert folded(8, {0}).coarser() is None
    assert folded(6, {0, 3}).coarser() == 2
    assert folded(6, {0, 2, 4}).coarser() == 3


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,microbatches,schedule", [
    ("mlp", 1, "gpipe"), ("mlp", 2, "gpipe"), ("mlp", 2, "1f1b"), ("gpt", 2, "1f1b"), ("gpt", 2, "gpipe"),
    pytest.param("gpt", 1, "gpipe", marks=_SLOW), pytest.param("resnet101", 1, "gpipe", marks=_SLOW),
    pytest.param("resnet101", 2, "gpipe", marks=_SLOW), pytest.param("resnet101", 2, "1f1b", marks=_SLOW)])
def test_random_replicated_plans_fold_exactly(name, microbatches, schedule):
    rng = random.Random(f"{name}/{microbatches}/{schedule}")
    done = folds = 0
    for _ in range(40):
        if done == 4:
            break
        g, copies = rng.choice(((1, 4), (2, 2), (2, 4), (3, 2), (4, 2), (2, 8), (4, 16)))
        family = rng.choice(sorted(TOPOLOGIES)) if g * copies <= 16 else "a100"
        batch = 4 * copies * microbatches * 3
        small_graph, graph = traced(name, batch_size=batch // copies), traced(name, batch_size=batch)
        try:
            plan = replicated(random_small(small_graph, g, rng, microbatches, schedule), graph, copies)
            plan.validate(graph)
            full, folded = assert_same(graph, plan, _topology(family, g * copies), rng.choice(("sgd", "adam")))
        except PlanError:
            continue
        found = find_copies(graph, plan)
        assert found is not None and found.count % copies == 0
        done += 1
        folds += folded.num_tasks < full.num_tasks  # not where copies share a node's NIC (p100, k80)
    assert done == 4 and folds >= 2


def test_simulate_plan_folds_from_fold_from_devices():
    """By default a replicated plan folds from ``FOLD_FROM`` devices (64 here), not below."""
    for n, topology in ((8, "a100-1x8"), (FOLD_FROM, f"a100-{FOLD_FROM // 8}x8")):
        graph = traced("mlp", batch_size=n)
        plan = baseline("data_parallel", graph, n)
        default = simulate_plan(graph, plan, topology, summary=False)
        same = simulate_plan(graph, plan, topology, summary=False, fold=n >= FOLD_FROM)
        other = simulate_plan(graph, plan, topology, summary=False, fold=n < FOLD_FROM)
        assert default.num_tasks == same.num_tasks != other.num_tasks
        assert default.iteration_time == other.iteration_time


def _walk(graph, topology: str, plan: Strategy, steps: int, seed: int, recompute: float, copy0: bool,
          zero: float = 0.0) -> tuple[int, int]:
    """A walk of one-op proposals from ``plan`` (recompute toggled with probability ``recompute``,
    a weighted op's ZeRO level drawn with probability ``zero``, then the ops drawn from the
    weighted ones: still replicated; a drawn config: mostly not), each simulated with the search's caches and
    folding on (``copy0``: lowered for copy 0 where the plan has copies) and asserted equal to a
    per-device run from scratch; returns (folded runs, copy-0 lowerings)."""
    topology, cost = get_topology(topology), get_cost_model("analytical")
    n = plan.num_devices
    rng = random.Random(seed)
    lowering, tasks = {}, TaskCache(topology, cost)
    ops = [node for node in graph if node.kind not in WEIGHT_KINDS and (not zero or node.weights)]
    folds = partial = 0
    for _ in range(steps):
        node = rng.choice(ops)
        c, draw = plan[node.name], rng.random()
        if draw < recompute and _recomputable(graph, node.name):  # a replicated plan stays replicated
            proposal = plan.replace(node.name, c.with_memory(recompute=not c.recompute))
        elif draw < recompute + zero and any(w.trainable for w in node.weights):
            proposal = plan.replace(node.name, c.with_memory(zero=rng.choice([z for z in range(4) if z != c.zero])))
        else:
            proposal = plan.replace(node.name, rng.choice(list(enumerate_configs(node, n, 1, 4))))
        for p in (plan, proposal):  # the chain's current plan, then the proposal
            copies = find_copies(graph, p) if copy0 else None
            try:
                low = lower(graph, p, lowering, copies)
            except CrossCopy:
                low = lower(graph, p, lowering)
            got = simulate_plan(graph, low, topology, cost, cache=tasks, summary=False, fold=True)
            want = simulate_plan(graph, p, topology, cost, summary=False, fold=False)
            assert got.iteration_time == pytest.approx(want.iteration_time, rel=1e-12, abs=0)
            assert got.peak_memory_bytes == want.peak_memory_bytes
            folds += got.num_tasks < want.num_tasks
            partial += low.copies is not None
        if rng.random() < 0.5:
            plan = proposal
    return folds, partial


def test_delta_simulation_on_folded_graphs_equals_full():
    """A walk from data parallel on resnet101 x 16 (p100-4x4), every device lowered."""
    graph = traced("resnet101", batch_size=16)
    folds, _ = _walk(graph, "p100-4x4", baseline("data_parallel", graph, 16), 12, 0, 0.5, False)
    assert folds >= 5


def test_delta_simulation_on_copy_zero_lowerings_equals_full():
    """The walk with the lowering of copy 0 (``lower(copies=)``, one cache across copy sets and
    proposals) on gpt data parallel x 8."""
    graph = traced("gpt", batch_size=16)
    _, partial = _walk(graph, "a100-1x8", baseline("data_parallel", graph, 8), 8, 1, 0.6, True)
    assert partial >= 8


def test_delta_simulation_on_copy_zero_lowerings_of_sharded_weights_equals_full():
    """The walk from FSDP on gpt x 8, ZeRO levels 0-3 drawn per op: weights sharded per use
    (levels 2 and 3) lowered for copy 0, one cache across proposals."""
    graph = traced("gpt", batch_size=16)
    plan = baseline("fsdp", graph, 8)
    _, partial = _walk(graph, "a100-1x8", plan, 12, 2, 0.3, True, zero=0.6)
    assert partial >= 12
