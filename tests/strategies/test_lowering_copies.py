"""The lowering of copy 0 (``lower(copies=)``, ``strategies.lowering_copies``) equals the full
lowering restricted to copy 0: partitions, transfers, collectives and reduction groups of copy
0's devices (groups whole), every weight shard whole, the gradient sync and every device's
totals; on baseline plans and random replicated ones, through the search's lowering cache, and
never mixed with another copy set's; a partial lowering is refused where every device is needed."""

from __future__ import annotations

import random

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import build_tasks
from soapsearch.executor.errors import check_runnable
from strategies import Strategy
from strategies.baselines import baseline, recomputed
from strategies.errors import PlanError
from strategies.lowered import WEIGHT_KINDS
from strategies.lowering import loss_on_every_device, lower
from strategies.megatron import megatron
from strategies.symmetry import Copies, CrossCopy, copies_of, find_copies
from strategies.zero import gather_uses
from tests.conftest import traced
from tests.simulator.test_fold import random_small, replicated


def assert_restricted(graph, plan, copies, cache=None):
    """``lower(copies=)`` is ``lower()`` restricted to copy 0 (module docstring)."""
    full, part = lower(graph, plan), lower(graph, plan, cache, copies)
    keep = copies.kept
    assert part.copies == copies and full.copies is None
    for node in full.graph:
        want = full.partitions[node.name]
        if node.kind not in WEIGHT_KINDS:
            want = tuple(tuple(p for p in mb if p.device in keep) for mb in want)
            assert all(len(mb) == len(part.partitions[node.name][0]) for mb in want)
            assert [part.pieces[node.name].activations[d] for d in keep] == \
                [full.pieces[node.name].activations[d] for d in keep]
        assert part.partitions[node.name] == want, node.name
    assert part.transfers == tuple(t for t in full.transfers if t.dst_device in keep)
    assert part.reductions == tuple(g for g in full.reductions if keep.intersection(g.devices))
    assert part.collectives == tuple(c for c in full.collectives if keep.intersection(c.devices))
    assert part.weight_shards == full.weight_shards
    assert part.device_bytes == full.device_bytes
    assert part.gradient_sync == full.gradient_sync
    assert loss_on_every_device(part) == loss_on_every_device(full)
    assert len(part.transfers) * copies.count == len(full.transfers)
    assert [tuple(u) for u in gather_uses(part)] == represented_uses(gather_uses(full), copies)
    return full, part


def represented_uses(uses, copies) -> list[tuple]:
    """The full lowering's level-2/3 ``uses`` as a lowering folded on ``copies`` records them:
    each holder reading through its representative's partition (``Copies.representative``), and
    only the uses of shards a kept device holds (a member fold's member m >= 2 alone: none)."""
    rep, out = copies.representative, []
    for u in uses:
        if copies.kept.intersection(u.shard.devices):
            on = dict(zip(u.shard.devices, u.partitions))
            out.append((u.shard, u.op, tuple(on[rep.get(d, d)] for d in u.shard.devices)))
    return out


def test_baseline_plans_lower_copy_zero_as_restricted():
    """Data parallel, ZeRO-1, FSDP (level 3: its uses' partitions), hybrid (1F1B, recompute, bf16) and megatron (sequence parallel:
    collectives; T=2, P=2 on 16 devices: 4 copies of 4)."""
    graph = traced("gpt", batch_size=16)
    plans = [baseline(b, graph, 8) for b in ("data_parallel", "zero1", "fsdp", "hybrid")]
    hybrid = baseline("hybrid", graph, 8).with_microbatches(2, "1f1b")
    plans.append(recomputed(hybrid, graph).with_precision("bf16"))
    plans.append(megatron(graph, 16, tp=2, pp=2, microbatches=2, sequence_parallel=True))
    counts = []
    for plan in plans:
        copies = find_copies(graph, plan)
        counts.append(copies.count)
        full, part = assert_restricted(graph, plan, copies)
        assert len(part.reductions) <= len(full.reductions)
    assert counts == [8, 8, 8, 8, 8, 4]
    mlp = traced("mlp", batch_size=32)
    plan = baseline("data_parallel", mlp, 16)
    for count in (16, 4, 2):  # fewer copies of more devices each
        assert_restricted(mlp, plan, copies_of(mlp, plan, count))


@pytest.mark.parametrize("microbatches,schedule", [(2, "1f1b"), (1, "gpipe")])
def test_random_replicated_plans_lower_copy_zero_as_restricted(microbatches, schedule):
    """Random mlp plans of G devices repeated on R copies (ZeRO levels 0-3, recompute)."""
    rng = random.Random(f"copies/{microbatches}/{schedule}")
    done = 0
    for _ in range(40):
        if done == 4:
            break
        g, count = rng.choice(((1, 4), (2, 2), (2, 4), (4, 2), (2, 8)))
        batch = 4 * count * microbatches * 3
        small_graph, graph = traced("mlp", batch_size=batch // count), traced("mlp", batch_size=batch)
        small = random_small(small_graph, g, rng, microbatches, schedule)
        try:
            plan = replicated(small, graph, count)
            lower(graph, plan)
        except PlanError:
            continue
        copies = find_copies(graph, plan)
        assert copies.count % count == 0
        assert_restricted(graph, plan, copies)
        done += 1
    assert done == 4


def test_weights_sharded_per_use_fold_on_copies():
    """Levels 2 and 3 pair their uses up per holder: a holder in copy r reads through its copy-0
    image's partition (megatron T 4 on 16 devices, the LM head at level 3 over its 4 copies)."""
    graph = traced("gpt", "small")
    plan = megatron(graph, 16, tp=4, pp=1)
    plan = plan.replace("lm_head", plan["lm_head"].with_memory(zero=3))
    copies = find_copies(graph, plan)
    assert copies.count == 4 and any(u.op == "lm_head" for u in gather_uses(lower(graph, plan)))
    assert_restricted(graph, plan, copies)


def test_the_cache_keeps_each_copy_set_apart():
    """One lowering cache across copy sets and proposals: each lowering equals a fresh one (a
    cache built for one copy set is never used for another)."""
    graph = traced("gpt", batch_size=16)
    plan = recomputed(baseline("data_parallel", graph, 8), graph)  # gpt x 16: test_fold's trace
    cache: dict = {}
    rng = random.Random(3)
    ops = [n.name for n in graph if n.kind not in WEIGHT_KINDS and plan[n.name].recompute]
    for step in range(6):
        op = rng.choice(ops)
        plan = plan.replace(op, plan[op].with_memory(recompute=not plan[op].recompute))
        for count in (8, 2, None, 4, 8):
            copies = None if count is None else copies_of(graph, plan, count)
            got = lower(graph, plan, cache, copies)
            if copies is None:
                assert got.copies is None and got.device_bytes == lower(graph, plan).device_bytes
            else:
                _, fresh = assert_restricted(graph, plan, copies, cache)
                assert got.partitions == fresh.partitions and got.device_bytes == fresh.device_bytes


def test_a_transfer_between_copies_is_refused():
    """Copies whose copy 0 reads from another copy (a consumer's devices swapped in pairs, the
    copies {0, 2} and {1, 3}): CrossCopy names the op and the devices."""
    graph = traced("mlp", batch_size=16)
    plan = baseline("data_parallel", graph, 4)
    op = next(n.name for n in graph if n.kind == "linear" and graph[n.inputs[0]].kind not in ("input", *WEIGHT_KINDS))
    c = plan[op]
    swapped = plan.replace(op, type(c)(c.degrees, (1, 0, 3, 2), c.zero, c.recompute))
    assert find_copies(graph, swapped).copies == ((0, 1), (2, 3))
    assert_restricted(graph, swapped, find_copies(graph, swapped))
    with pytest.raises(CrossCopy, match=f"op '{op}' reads .* on device 1, in another copy than its partition 1 on "
                                        "device 0"):
        lower(graph, swapped, copies=Copies(((0, 2), (1, 3))))


def test_a_partial_lowering_is_refused_where_every_device_is_needed():
    """The per-device task graph, a timeline, a simulation on other copies than its own and
    the executor refuse copy 0's lowering in one line."""
    graph = traced("mlp", batch_size=16)
    plan = baseline("data_parallel", graph, 8)
    part = lower(graph, plan, copies=find_copies(graph, plan))
    topology, cost = get_topology("a100-1x8"), get_cost_model("analytical")
    with pytest.raises(PlanError, match="a task graph per device needs every device's partitions") as e:
        build_tasks(part, topology, cost)
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="copy 0's only"):
        simulate_plan(graph, part, topology, timeline=True)
    with pytest.raises(PlanError, match="folded on 2 copies"):
        build_tasks(part, topology, cost, copies=copies_of(graph, plan, 2))
    with pytest.raises(PlanError, match="the executor needs every device's partitions"):
        check_runnable(part, 8)
    folded = simulate_plan(graph, part, topology, fold=True)
    assert folded.iteration_time == simulate_plan(graph, plan, topology, fold=False).iteration_time
    assert isinstance(plan, Strategy)
