"""Member-folded simulation (``simulator.fold_members``): members 0 and 1 of copy 0 simulated for
every member give the per-device simulation's iteration time, busy time per device, peak
memory per device and bytes per link kind (rel 1e-9) on megatron GPipe and 1F1B with
recompute, megatron_lm (sequence parallel, ZeRO-1, bf16) and random recompute/ZeRO plans (levels
0-1, and 0-3: weights sharded per use) at 8-64 devices; plans that fall back name why."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import Lowerings, simulate_plan, timed_graph
from simulator.tasks import TaskCache
from simulator.topology import Topology
from soapsearch import trace
from soapsearch._models.transformer import GPT, GPTConfig
from strategies.baselines import megatron_lm, recomputed
from strategies.config import ParallelConfig
from strategies.lowered import WEIGHT_KINDS
from strategies.lowering import lower
from strategies.lowering_members import MemberFold
from strategies.megatron import megatron
from strategies.symmetry import Copies
from tests.conftest import traced
from tests.strategies.test_lowering_members import random_plan


def _plans():
    small = traced("gpt", "small")
    sp = megatron(small, 16, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    return [
        pytest.param(sp, "a100-2x8", id="megatron-T4-P2-D2-gpipe"),
        pytest.param(recomputed(sp.with_microbatches(2, "1f1b"), small), "a100-2x8",
                     id="megatron-T4-P2-D2-1f1b-recompute"),
        pytest.param(megatron(small, 8, tp=4, pp=2, microbatches=2), "a100-1x8", id="megatron-T4-P2-D1"),
        pytest.param(megatron_lm(small, 16, 4, 2), "a100-2x8", id="megatron_lm-T4-P2-D2"),
        # 2 samples a replica's micro-batch: the targets cut on samples × sequence
        pytest.param(megatron_lm(small, 16, 4, 2, micro_batch=2), "a100-2x8", id="megatron_lm-T4-P2-D2-mbs2"),
        pytest.param(megatron(small, 8, tp=4, pp=2, microbatches=8, sequence_parallel=True), "a100-1x8",
                     id="megatron-T4-P2-D1-mbs2"),
        *(pytest.param(random_plan(small, 16, seed), "a100-2x8", id=f"random-{seed}-16") for seed in (0, 1)),
        pytest.param(recomputed(megatron(small, 64, tp=4, pp=2, microbatches=2, sequence_parallel=True)
                                .with_microbatches(2, "1f1b"), small), "a100-8x8", id="megatron-T4-P2-D8-1f1b-recompute"),
        pytest.param(random_plan(small, 64, 3), "a100-8x8", id="random-3-64"),
        *(pytest.param(random_plan(small, n, seed, (0, 1, 2, 3)), preset, id=f"random-zero3-{seed}-{n}")
          for seed, n, preset in ((0, 16, "a100-2x8"), (4, 16, "a100-2x8"), (5, 64, "a100-8x8"))),
    ]


def assert_same(folded, full) -> None:
    assert folded.iteration_time == pytest.approx(full.iteration_time, rel=1e-9, abs=0)
    assert folded.busy_time == pytest.approx(full.busy_time, rel=1e-9, abs=0)
    assert folded.peak_memory_bytes == full.peak_memory_bytes
    assert folded.bytes_moved.keys() == full.bytes_moved.keys()
    for kind, b in full.bytes_moved.items():
        assert folded.bytes_moved[kind] == pytest.approx(b, rel=1e-9, abs=0), kind


@pytest.mark.parametrize("plan,preset", _plans())
def test_member_fold_equals_per_device(plan, preset):
    graph, topo = traced("gpt", "small"), get_topology(preset)
    full = simulate_plan(graph, plan, topo, fold=False)
    lowerings = Lowerings(graph, plan)
    lowered = lowerings.first(topo, True)
    assert isinstance(lowered.copies, MemberFold), lowerings.why
    folded = simulate_plan(graph, plan, topo, fold=True)
    assert_same(folded, full)
    # members 2..T-1 are not simulated: fewer tasks than the copies alone fold to
    alone = _copies_alone(graph, plan, topo, lowered.copies)
    assert_same(alone, full)
    assert folded.num_tasks < alone.num_tasks


def _copies_alone(graph, plan, topo, fold: MemberFold):
    """``plan`` simulated on its copies alone (per device where it has one copy)."""
    if fold.count == 1:
        return simulate_plan(graph, plan, topo, fold=False)
    return simulate_plan(graph, lower(graph, plan, copies=Copies(fold.copies)), topo, fold=True)


@pytest.mark.parametrize("seed,n,preset", [(2, 16, "a100-2x8"), (6, 64, "a100-8x8"), (2, 64, "a100-8x8")])
def test_member_fold_equals_the_copy_fold(seed, n, preset):
    """Random plans whose copy fold was once not the per-device simulation (a bucket's pack
    before device 0's weight-op step, ``tests/simulator/test_fold_exact.py``): the member fold
    is the copy fold, and both are the per-device simulation."""
    graph, topo = traced("gpt", "small"), get_topology(preset)
    plan = random_plan(graph, n, seed)
    lowerings = Lowerings(graph, plan)
    lowered = lowerings.first(topo, True)
    assert isinstance(lowered.copies, MemberFold), lowerings.why
    alone = _copies_alone(graph, plan, topo, lowered.copies)
    folded = simulate_plan(graph, plan, topo, fold=True)
    assert_same(folded, alone)
    assert_same(folded, simulate_plan(graph, plan, topo, fold=False))


def test_transfer_across_members_falls_back_named():
    """GPT at D 4 with 2 samples a replica's micro-batch and its targets cut on the sequence
    (each member a quarter of both samples' tokens) reads them across members into the loss's
    view, cut in contiguous rows: the member fold is refused, named, and the copies fold alone,
    as per device. ``megatron`` cuts such targets 8 × 2 (``test_member_fold_equals_per_device``)."""
    graph, topo = traced("gpt", "small"), get_topology("a100-4x8")
    plan = megatron(graph, 32, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    assert plan["targets"] == ParallelConfig((8, 2), range(16, 32))
    plan = plan.replace("targets", ParallelConfig((4, 4), range(16, 32)))
    lowerings = Lowerings(graph, plan)
    lowered = lowerings.first(topo, True)
    assert type(lowered.copies) is Copies
    assert lowerings.why.startswith("transfer targets[1] -> view_9[0]: device 17 -> 16 crosses members")
    assert_same(simulate_plan(graph, plan, topo, fold=True), simulate_plan(graph, plan, topo, fold=False))


def test_fallback_names_why():
    """LLaMA's megatron layout moves rotary views across members: the lowering refuses the
    member fold (naming the transfer) and the plan is simulated on its copies alone, alike."""
    graph, topo = traced("llama", "tiny"), get_topology("a100-2x8")
    plan = megatron(graph, 16, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    lowerings = Lowerings(graph, plan)
    lowered = lowerings.first(topo, True)
    assert not isinstance(lowered.copies, MemberFold)
    assert "crosses members" in lowerings.why
    assert_same(simulate_plan(graph, plan, topo, fold=True), simulate_plan(graph, plan, topo, fold=False))
    tiny = traced("gpt", "tiny")
    lowerings = Lowerings(tiny, megatron(tiny, 8, tp=2, pp=2, microbatches=2))
    lowerings.first(topo, True)
    assert lowerings.why == "2 members: members 0 and 1 are all of them"


def test_delta_simulation_of_member_folds_equals_full():
    """A walk of one-op proposals (recompute toggled, a ZeRO level 0-3 drawn: the members stay alike)
    from megatron_lm T4 P2 D2, each simulated member-folded with the search's caches (lowering
    and task blocks kept across proposals) and equal to a per-device run from scratch."""
    graph, topo = traced("gpt", "small"), get_topology("a100-2x8")
    cost = get_cost_model("analytical")
    plan = megatron_lm(graph, 16, 4, 2)
    rng = random.Random(0)
    lowering, tasks = {}, TaskCache(topo, cost)
    ops = [n.name for n in graph if n.kind not in (*WEIGHT_KINDS, "input") and graph.needs_grad[n.name]]
    folded = 0
    for _ in range(10):
        op = rng.choice(ops)
        c = plan[op]
        zero = rng.choice((0, 1, 2, 3)) if any(w.trainable for w in graph[op].weights) else c.zero
        proposal = plan.replace(op, c.with_memory(zero, not c.recompute))
        for p in (plan, proposal):
            got = simulate_plan(graph, p, topo, cost, cache=tasks, lowering_cache=lowering, fold=True)
            assert_same(got, simulate_plan(graph, p, topo, cost, fold=False))
            folded += isinstance(Lowerings(graph, p, lowering).first(topo, True).copies, MemberFold)
        if rng.random() < 0.5:
            plan = proposal
    assert folded == 20


def test_stragglers_over_members_fall_back_named():
    """With a collective overhead (``simulator.stragglers``) a step-end bucket over every member
    weighs its simulated hosts alike, which members 0 and 1 are not: simulated on the copies,
    named, equal to per device (member-folded its iteration time would be 6e-8 relatively off)."""
    base = get_topology("a100-2x8")
    topo = Topology(base.name + "-overhead", tuple(dataclasses.replace(d, collective_overhead=2e-5)
                                                    for d in base.devices), base.links, base.routes)
    graph = traced("gpt", "small")
    plan = megatron_lm(graph, 16, 4, 2)
    lowerings = Lowerings(graph, plan)
    lowered = lowerings.first(topo, True)
    assert isinstance(lowered.copies, MemberFold)
    timed_graph(lowered, topo, get_cost_model("analytical"), relower=lowerings)
    assert type(lowerings.last.copies) is Copies
    assert lowerings.why.startswith("step-end collective 'reducescatter bucket 8-15 zero1' waits on member 0 and another member")
    assert_same(simulate_plan(graph, plan, topo, fold=True), simulate_plan(graph, plan, topo, fold=False))


def test_memo_refusals_on_a_delta_walk(monkeypatch):
    """The member memo (``strategies.member_memo``) on a walk with the search's caches: a plan
    whose view of the targets reads them across members (the targets' devices swapped, then the
    view's) is refused at that op and remembered; the same op under the same configs (the plan
    again, with another op changed besides) is refused without a member lowering; the plan before
    each swap folds again (a memo keyed without the op's own config or without its producers'
    would refuse it). Every result equals a per-device run from scratch."""
    import simulator.simulate as simulate

    graph, topo = traced("gpt", "small"), get_topology("a100-2x8")
    cost = get_cost_model("analytical")
    swapped = (9, 8, 10, 11, 13, 12, 14, 15)  # members 0 and 1 swapped in both copies: the same fold
    base = megatron_lm(graph, 16, 4, 2).with_microbatches(2).replace("targets", ParallelConfig((8, 1), range(8, 16)))
    by_targets = base.replace("targets", ParallelConfig((8, 1), swapped))
    by_view = base.replace("view_9", ParallelConfig((8,), swapped))
    other = next(n.name for n in graph if n.kind == "linear")
    again = by_targets.replace(other, by_targets[other].with_memory(recompute=True))
    lowered: list[str] = []
    real = simulate.lower

    def counted(graph, plan, cache=None, copies=None):
        if isinstance(copies, MemberFold):
            lowered.append(plan)
        return real(graph, plan, cache, copies)

    monkeypatch.setattr(simulate, "lower", counted)
    lowering, tasks = {}, TaskCache(topo, cost)
    walk = [(base, False), (by_targets, True), (base, False), (by_view, True), (base, False), (by_targets, "memo"),
            (again, "memo"), (by_view, "memo")]
    for plan, refused in walk:
        del lowered[:]
        lowerings = Lowerings(graph, plan, lowering)
        got = lowerings.first(topo, True)
        if not refused:
            assert isinstance(got.copies, MemberFold), lowerings.why
        else:
            assert type(got.copies) is Copies
            assert lowerings.why.startswith("transfer targets[0] -> view_9[0]: device ")
            assert lowered == ([] if refused == "memo" else [plan])  # remembered: no member lowering
        assert_same(simulate_plan(graph, plan, topo, cost, cache=tasks, lowering_cache=lowering, fold=True),
                    simulate_plan(graph, plan, topo, cost, fold=False))


def test_memo_members_equal_find_members():
    """A walk of one-op proposals (recompute toggled, an op's devices swapped within a group or
    between groups, which breaks the members, and back; a plan of other degrees): the memo's
    members, cutting again only the changed ops, and its fold equal ``find_members``' and
    ``member_fold``'s of each plan from scratch."""
    from strategies.lowering_members import member_fold
    from strategies.member_memo import MemberMemo
    from strategies.member_symmetry import find_members

    graph = traced("gpt", "small")
    rng = random.Random(1)
    start = megatron_lm(graph, 16, 4, 2)
    others = [megatron(graph, 16, tp=2, pp=2, microbatches=2), random_plan(graph, 16, 0), start]
    ops = [n.name for n in graph if n.kind not in WEIGHT_KINDS]
    memo, plan, kinds = MemberMemo(), start, set()
    for step in range(120):
        if step % 40 == 39:
            plan = others[step // 40]
        else:
            op = rng.choice(ops)
            c = plan[op]
            devices = list(c.devices)
            i, j = rng.sample(range(len(devices)), 2) if len(devices) > 1 else (0, 0)
            devices[i], devices[j] = devices[j], devices[i]
            choice = rng.random()
            new = (c.with_memory(recompute=not c.recompute) if choice < 0.4 or not graph.needs_grad[op]
                   else ParallelConfig(c.degrees, devices, c.zero, c.recompute) if choice < 0.7 else start[op])
            plan = plan.replace(op, new)
        want = find_members(graph, plan)
        assert memo.members(graph, plan) == want
        assert memo.fold(graph, plan, None) == member_fold(graph, plan)
        kinds.add(want is None)
    assert kinds == {True, False}


def test_copies_that_do_not_own_their_links_fall_back_per_device(monkeypatch):
    """A member fold refused on a topology where neither the members nor their copies own their
    links (``link_maps`` None, as a topology JSON whose copies share a link) is simulated per
    device, not left as a FoldError."""
    import simulator.simulate as simulate
    graph, topo = traced("gpt", "small"), get_topology("a100-2x8")
    plan = megatron(graph, 16, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    full = simulate_plan(graph, plan, topo, fold=False)
    monkeypatch.setattr(simulate, "link_maps", lambda topology, copies: None)
    result = simulate_plan(graph, plan, topo, fold=True)
    assert_same(result, full)
    assert result.num_tasks == full.num_tasks


def test_member_fold_with_more_stages_than_layers():
    """24 layers in 32 stages (T4 x P32, GPipe, sequence parallel; GPT-3's 96 layers in 128 at
    1,024 devices in small): the stages once started after a row linear (blocks_4_mlp_proj's
    partial sums sent to the next stage crossed members, so it was lowered per device); with the
    reduction on the linear's stage (``strategies.megatron_stages``) its members fold, and the
    member fold is the per-device simulation."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=24, n_head=4, n_embd=16, seq_len=16, vocab_size=64))
        tokens = torch.zeros(8, 16, dtype=torch.long)
    graph, topo = trace(model, (tokens, tokens), name="gpt-24-layers"), get_topology("a100-16x8")
    plan = megatron(graph, 128, tp=4, pp=32, microbatches=2, sequence_parallel=True)
    lowerings = Lowerings(graph, plan)
    assert isinstance(lowerings.first(topo, True).copies, MemberFold), lowerings.why
    assert_same(simulate_plan(graph, plan, topo, fold=True), simulate_plan(graph, plan, topo, fold=False))
