"""Recipes (pure, no process group): where autograd graphs are linked and cut, and that linking
never changes a rank's sequence of sends, receives and collectives (what keeps the fixed
orders deadlock-free)."""

from __future__ import annotations

import functools

import pytest

from soapsearch.executor import build_model
from soapsearch.executor.recipe import LINKED, ROOT, SKIP, LossSum, Recipe, receives_ahead, recipes
from strategies.lowering import BucketKey, Gate, bucket_sums, lower
from strategies.schedule import device_order
from tests.executor.plans import make_plan
from tests.executor.models import SPEC as M


@functools.cache
def _graph(model: str):
    return build_model(model, "tiny").graph


def _recipes(model: str, plan: str, n: int) -> dict[int, tuple[list, list[Recipe]]]:
    graph = _graph(model)
    low = lower(graph, make_plan(graph, plan, n))
    return {rank: (order, recipes(low, order, rank, lambda name, region: None))
            for rank, order in device_order(low).items()}


@pytest.mark.parametrize("model", ["mlp", "gpt", "alexnet", "resnet101"])
def test_data_parallel_runs_one_backward_call_per_rank(model):
    for rank, (_, rs) in _recipes(model, "dp", 2).items():
        roots = [r for r in rs if r.backward == ROOT]
        assert [r.node.kind for r in roots] == ["loss"], rank
        assert not any(s.leaf for r in rs for s in r.slots if s is not None)
        # the batchnorms' collectives run inside that one call
        assert all(r.backward == LINKED for r in rs if r.group and r.node.kind == "batchnorm2d")


def test_a_gradient_that_crosses_ranks_cuts_the_graph():
    """Model parallel: rank 0's last linear sends its output to rank 1, so it is a root that
    receives its gradient, and rank 1 reads it through a leaf whose gradient it sends back (the
    targets cross too, without a gradient)."""
    rs = _recipes("mlp", "mp", 2)
    (sender,) = [r for r in rs[0][1] if r.sends and r.backward != SKIP]
    assert sender.backward == ROOT and [p.peer for p in sender.grad_pieces] == [1]
    (reader,) = [r for r in rs[1][1] if r.grad_sends]
    assert [(s.leaf, s.link, [p.peer for p in s.pieces]) for s in reader.slots] == [(True, False, [0])]
    assert [(s.peer, s.slot, s.transfer) for s in reader.grad_sends] == [(0, 0, sender.sends[0].transfer)]
    loss = next(r for r in rs[1][1] if r.node.kind == "loss")
    assert [(s.leaf, s.link) for s in loss.slots] == [(False, True), (False, False)]


def _collective_in_backward(r: Recipe) -> bool:
    return r.group is not None and r.backward != SKIP and r.node.kind != "loss"


def _communications(order, rs: list[Recipe], linked: bool) -> list[tuple]:
    """This rank's communications in the order it makes them: every backward step at its own
    place (``linked`` False: one backward call per partition), or as the recipes run them."""
    by_key = {(r.part.op, r.part.index, r.part.microbatch): r for r in rs}
    root = {}
    for r in reversed(rs):  # consumers before producers: a linked partition leads to its root
        for s in r.slots:
            if s is not None and s.link:
                q = s.pieces[0].task
                assert root.setdefault(q, root.get(r.id, r.id)) == root.get(r.id, r.id)
    out: list[tuple] = []
    for step in order:
        r = by_key[(step.op, step.index, step.microbatch)]
        if not step.backward:
            out += [("recv", p.transfer) for s in r.slots if s is not None for p in s.pieces if p.peer is not None]
            out += [("collective", r.id, "forward")] if r.group is not None else []
            out += [("send", s.transfer) for s in r.sends]
            continue
        if r.backward == SKIP:
            continue
        if not linked or r.backward == ROOT:
            out += [("recv", p.transfer) for p in r.grad_pieces if p.peer is not None]
            members = [q for q in rs if (q.id == r.id or (linked and root.get(q.id) == r.id))]
            out += [("collective", q.id, "backward") for q in sorted(members, key=lambda q: -q.id)
                    if _collective_in_backward(q)]
        out += [("send", s.transfer) for s in r.grad_sends]
    return out


CASES = ([(m, "dp", 4) for m in ("resnet101", "gpt")] + [(m, p, 2) for m in ("resnet101", "mlp", "rnnlm")
                                                           for p in ("spatial", "gpipe", "1f1b", "owt")]
         + [(m, f"random{s}", n) for m in ("mlp", "gpt", "alexnet", "resnet101", "rnnlm")
            for s in range(6) for n in (2, 4)]
         + [(m, f"random_mb{s}", 2) for m in ("mlp", "gpt", "resnet101") for s in range(4)])


@pytest.mark.parametrize("model,plan,n", CASES, ids=[f"{m}-{p}-{n}" for m, p, n in CASES])
def test_linking_keeps_every_ranks_sequence_of_communications(model, plan, n):
    for rank, (order, rs) in _recipes(model, plan, n).items():
        assert _communications(order, rs, linked=True) == _communications(order, rs, linked=False), rank


STEP, BACKWARD = Gate.STEP, Gate.BACKWARD
F32_01, F32_23 = BucketKey((0, 1), "float32"), BucketKey((2, 3), "float32")

# (model, plan, devices) -> every loss partition's (LossSum, seed) and the ranks counting the loss;
# a STEP sum whose devices and dtype are a gradient bucket's rides it (strategies.lowering.bucket_sums)
LOSS_CASES = [
    # every gradient divided by C after the bucket's all-reduce that summed [s_p, c_p] too
    ("mlp", "dp", 2, LossSum(None, STEP, F32_01), 1.0, {0, 1}),
    ("gpt", "dp", 2, LossSum(None, STEP, F32_01), 1.0, {0, 1}),
    (M + "weighted", "dp", 2, LossSum(None, STEP, F32_01), 1.0, {0, 1}),
    ("gpt", "owt", 2, LossSum(None, STEP, F32_01), 1.0, {0, 1}),  # its embeddings are replicated
    ("mlp", "owt", 2, LossSum(None, STEP), 1.0, {0, 1}),  # no replicated weight: its own collective
    (M + "regression", "dp", 2, LossSum(96.0, STEP, F32_01), 1.0, {0, 1}),  # mean MSE: C = 8·3·4
    (M + "regression", "dp_mb2", 2, LossSum(48.0, STEP, F32_01), 0.5, {0, 1}),  # C_j = 96/2; both ride
    (M + "summed", "dp_mb2", 2, LossSum(1.0, STEP, F32_01), 0.5, {0, 1}),
    ("mlp", "dp_mb2", 2, LossSum(None, BACKWARD), 0.5, {0, 1}),  # seed 1/(m·C_j) once C_j is summed
    (M + "weighted", "dp_mb2", 2, LossSum(None, BACKWARD), 0.5, {0, 1}),
    ("mlp", "stages_dp", 4, LossSum(None, BACKWARD), 0.5, {2}),  # pipeline: the loss on ranks 2, 3
    (M + "summed", "stages_dp", 4, LossSum(1.0, STEP, F32_23), 0.5, {2}),  # the last stage's bucket
    ("mlp", "loss_some", 4, LossSum(None, BACKWARD), 1.0, {2}),
    (M + "regression", "loss_some", 4, LossSum(96.0, STEP), 1.0, {2}),  # weights on 0-3, loss on 2, 3
    ("mlp", "loss_some", 2, LossSum(None, None), 1.0, {1}),  # alone: C_j is its own c_p
    ("mlp", "gpipe", 2, LossSum(None, None), 0.5, {1}),
]


@pytest.mark.parametrize("model,plan,n,loss_sum,seed,counting", LOSS_CASES,
                         ids=[f"{c[0].removeprefix(M)}-{c[1]}-{c[2]}" for c in LOSS_CASES])
def test_loss_partitions_seed_and_wait_as_their_gates_say(model, plan, n, loss_sum, seed, counting):
    """The parity cases cover every way a loss's sum is waited (test_parity.py's docstring)."""
    losses = [(rank, r) for rank, (_, rs) in _recipes(model, plan, n).items() for r in rs if r.loss_sum]
    assert {(r.loss_sum, r.seed) for _, r in losses} == {(loss_sum, seed)}
    assert {rank for rank, r in losses if r.loss} == counting


RIDE_CASES = [(c[0], c[1], c[2]) for c in LOSS_CASES if c[3].bucket is not None] + [
    ("alexnet", "owt", 4), ("gpt", "random12", 4), ("mlp", "random11", 4)]


@pytest.mark.parametrize("model,plan,n", RIDE_CASES, ids=[f"{m.removeprefix(M)}-{p}-{n}" for m, p, n in RIDE_CASES])
def test_every_member_of_a_bucket_appends_the_same_sums_in_the_same_order(model, plan, n):
    """The runtime appends the riding sums to a bucket in (op, micro-batch) order: every member
    of the bucket must hold one partition of each, else the flat all-reduce would mix terms."""
    graph = _graph(model)
    low = lower(graph, make_plan(graph, plan, n))
    by_rank = {rank: sorted((r.part.op, r.part.microbatch, r.loss_sum.bucket) for r in rs
                            if r.loss_sum is not None and r.loss_sum.bucket is not None)
               for rank, (_, rs) in _recipes(model, plan, n).items()}
    riding = bucket_sums(low)
    for group, bucket in riding.items():
        for rank in bucket.devices:
            assert (group.op, group.microbatch, bucket) in by_rank[rank]
    for rank, rides in by_rank.items():
        assert len(rides) == len(set(rides)) == sum(rank in b.devices for b in riding.values())
        for bucket in {b for _, _, b in rides}:
            assert all([x for x in by_rank[o] if x[2] == bucket] == [x for x in rides if x[2] == bucket]
                       for o in bucket.devices)


@pytest.mark.parametrize("model,plan,n", [("mlp", "1f1b", 2), ("gpt", "gpipe", 2), ("mlp", "owt", 2),
                                          ("gpt", "random_mb3", 3), ("alexnet", "stages_dp", 4)])
def test_every_receive_is_posted_once_a_micro_batch_ahead(model, plan, n):
    """Every remote piece a rank's steps read (forward) or take as a gradient (a root's
    backward) is posted exactly once, at its first step of the piece's micro-batch j - 1 or j
    in that direction, and never after the step that reads it."""
    for rank, (order, rs) in _recipes(model, plan, n).items():
        by_key = {(r.part.op, r.part.index, r.part.microbatch): r for r in rs}
        steps = [(s.backward, by_key[(s.op, s.index, s.microbatch)]) for s in order]
        posted_at = {}
        for i, ahead in enumerate(receives_ahead(steps)):
            for a in ahead:
                assert (a.peer, a.transfer, a.backward) not in posted_at, (rank, a)
                posted_at[(a.peer, a.transfer, a.backward)] = i
        read = {}
        for i, (backward, r) in enumerate(steps):
            pieces = r.grad_pieces if backward else [p for s in r.slots if s is not None for p in s.pieces]
            read.update({(p.peer, p.transfer, backward): (i, r.part.microbatch) for p in pieces if p.peer is not None})
        assert posted_at.keys() == read.keys(), rank
        firsts = {}
        for i, (backward, r) in enumerate(steps):
            firsts.setdefault((backward, r.part.microbatch), i)
        for key, (i, j) in read.items():
            assert posted_at[key] <= i and posted_at[key] in (firsts.get((key[2], j - 1)), firsts[(key[2], j)]), key
