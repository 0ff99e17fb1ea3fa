"""The lowering of member representatives (``strategies.lowering_members``): members 0 and 1 of
copy 0 lowered for all equal the per-device lowering restricted to them (partitions, transfers,
collectives with their whole member lists, reduction groups), with every weight shard, gradient
bucket and per-device total of the per-device lowering (member m's weight regions derived,
not member 1's imaged). Plans whose members are not alike are refused with the reason."""

from __future__ import annotations

import random

import pytest

from strategies import Strategy
from strategies.baselines import data_parallel, megatron_lm, recomputed
from strategies.lowered import WEIGHT_KINDS
from strategies.lowering import lower
from strategies.lowering_members import MemberFold, member_fold
from strategies.megatron import megatron
from strategies.member_symmetry import TensorMembers
from strategies.symmetry import CrossCopy, find_copies
from strategies.zero import gather_uses
from tests.conftest import traced
from tests.strategies.test_lowering_copies import represented_uses


def random_plan(graph, n: int, seed: int, levels: tuple[int, ...] = (0, 1)) -> Strategy:
    """megatron T 4, P 2 on ``n`` devices with each op's recompute and ZeRO level (of ``levels``)
    drawn at random, GPipe or 1F1B."""
    rng = random.Random(seed)
    base = megatron(graph, n, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    configs = {}
    for node in graph:
        c = base[node.name]
        zero = rng.choice(levels) if any(w.trainable for w in node.weights) else 0
        recompute = node.kind not in (*WEIGHT_KINDS, "input") and graph.needs_grad[node.name] and rng.random() < 0.3
        configs[node.name] = c.with_memory(zero, recompute)
    return Strategy.of(configs, n, 2, rng.choice(("gpipe", "1f1b")))


def _plans():
    small = traced("gpt", "small")
    sp = megatron(small, 16, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    return [
        pytest.param(sp, id="megatron-T4-P2-D2-gpipe"),
        pytest.param(recomputed(sp.with_microbatches(2, "1f1b"), small), id="megatron-T4-P2-D2-1f1b-recompute"),
        pytest.param(megatron(small, 8, tp=4, pp=1, microbatches=2), id="megatron-T4-D2"),
        pytest.param(megatron_lm(small, 16, 4, 2), id="megatron_lm-T4-P2-D2"),  # ZeRO-1, bf16, 1F1B
        *(pytest.param(random_plan(small, 16, seed), id=f"random-{seed}") for seed in (0, 1, 2)),
    ]


def assert_restricted(folded, full, kept) -> None:
    """``folded`` is ``full`` restricted to the ``kept`` devices' partitions, with whole weight
    shards, buckets and per-device totals."""
    graph = full.graph
    for op, per_mb in full.partitions.items():
        weight = graph[op].kind in WEIGHT_KINDS
        assert folded.partitions[op] == tuple(tuple(p for p in mb if weight or p.device in kept) for mb in per_mb), op
    mine = {op: {p.index for mb in per_mb for p in mb} for op, per_mb in folded.partitions.items()}
    assert folded.transfers == tuple(t for t in full.transfers if t.dst_index in mine[t.dst_op])
    reads = [r for p in full.pieces.values() for r in p.collective_reads if r.dst_index in mine[r.dst_op]]
    assert [r for p in folded.pieces.values() for r in p.collective_reads] == reads
    assert folded.collectives == tuple(dict.fromkeys(r.collective for r in reads))
    assert all(set(c.devices) - kept for c in folded.collectives)  # whole groups, not the kept members only
    assert folded.reductions == tuple(g for g in full.reductions if set(g.devices) & kept)
    assert folded.weight_shards == full.weight_shards
    assert folded.gradient_sync == full.gradient_sync
    assert folded.device_bytes == full.device_bytes


@pytest.mark.parametrize("plan", _plans())
def test_representatives_lower_as_every_device(plan):
    graph = traced("gpt", "small")
    full = lower(graph, plan)
    copies = find_copies(graph, plan)
    for over in (copies, None):  # within copy 0 of the copies, and with no copy fold
        fold = member_fold(graph, plan, over)
        assert isinstance(fold, MemberFold), fold
        t = fold.members.count
        assert t >= 4 and len(fold.kept) == 2 * fold.members.size < len(fold.copies[0])
        folded = lower(graph, plan, copies=fold)
        assert_restricted(folded, full, fold.kept)
        # the kept devices' totals were lowered, the other members' are their member-1 images'
        for m in range(2, t):
            for d1, d in zip(fold.members.members[1], fold.members.members[m]):
                assert full.device_bytes.kept[d] == full.device_bytes.kept[d1]
        # member 0 reads the row-parallel biases: its weight bytes are not member 1's
        d0, d1 = fold.members.members[0][0], fold.members.members[1][0]
        assert full.device_bytes.trainable[d0] > full.device_bytes.trainable[d1]


def test_member_fold_keeps_the_kept_members_uses_of_weights_sharded_per_use():
    """Levels 2 and 3 under a member fold: the uses of every shard a kept device holds, each
    holder reading through its representative's partition (``Copies.representative``); a
    shard member m >= 2 alone holds has none (member 1's stand for its)."""
    graph = traced("gpt", "small")
    plan = random_plan(graph, 16, 4, (0, 1, 2, 3))
    fold = member_fold(graph, plan, find_copies(graph, plan))
    full, folded = gather_uses(lower(graph, plan)), gather_uses(lower(graph, plan, copies=fold))
    want = represented_uses(full, fold)
    assert [tuple(u) for u in folded] == want
    assert {u.shard.zero for u in folded} == {2, 3} and len(want) < len(full)


def test_delta_lowering_of_members_equals_a_fresh_one():
    """A search's lowering cache patched by one op's change: the same as lowered afresh."""
    graph = traced("gpt", "small")
    plan = megatron_lm(graph, 16, 4, 2)
    fold = member_fold(graph, plan, find_copies(graph, plan))
    cache: dict = {}
    lower(graph, plan, cache, copies=fold)
    op = next(n.name for n in graph if n.kind == "linear" and not plan[n.name].recompute)
    configs = dict(plan.configs)
    configs[op] = plan[op].with_memory(plan[op].zero, True)
    changed = Strategy.of(configs, plan.num_devices, plan.microbatches, plan.schedule, plan.precision)
    assert_restricted(lower(graph, changed, cache, copies=fold), lower(graph, changed), fold.kept)


def test_a_member_mapped_wrongly_is_refused_or_differs():
    """ψ_1 and ψ_2 swapped in one group: the kept devices are another member's, and the lowering
    refuses the fold (member 2's partitions are not its image's) or differs from per device."""
    graph = traced("gpt", "small")
    plan = megatron_lm(graph, 16, 4, 2)
    fold = member_fold(graph, plan, find_copies(graph, plan))
    rows = [list(r) for r in fold.members.members]
    rows[0][0], rows[1][0] = rows[1][0], rows[0][0]
    wrong = MemberFold(fold.copies, TensorMembers(tuple(map(tuple, rows))))
    with pytest.raises(CrossCopy, match="crosses members|member-1 image"):
        lower(graph, plan, copies=wrong)


def test_plans_without_alike_members_name_why():
    gpt, llama = traced("gpt", "tiny"), traced("llama", "tiny")
    assert "find_members" in member_fold(gpt, data_parallel(gpt, 4))
    assert member_fold(gpt, megatron(gpt, 8, tp=2, pp=2, microbatches=2)) == \
        "2 members: members 0 and 1 are all of them"
    plan = megatron(llama, 8, tp=4, pp=2, microbatches=2, sequence_parallel=True)  # rotary views across members
    fold = member_fold(llama, plan)
    assert isinstance(fold, MemberFold)
    with pytest.raises(CrossCopy, match=r"transfer view\[\d+\] -> transpose\[\d+\]: device \d+ -> \d+ crosses members"):
        lower(llama, plan, copies=fold)
