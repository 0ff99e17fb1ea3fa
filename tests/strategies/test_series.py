"""An op's pieces of its interior micro-batches taken from a series (``strategies.series``) equal
those derived one micro-batch after another: on random plans of tiny zoo models at 8 and 16
micro-batches, on the member and copy folds of GPT's Megatron-LM plan at 32 (the collectives
its readers share shared alike), and for an op without a sample dim that reads one row of the
batch; a micro-batch that raises raises in order; and the series itself: ints moved on by their
steps, everything else kept, shared values shared, no series where two terms differ otherwise."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch
from torch import nn

import strategies.pieces as pieces
import strategies.series as series_module
from soapsearch import trace
from strategies import Strategy, enumerate_configs
from strategies.baselines import megatron_lm
from strategies.lowering import lower, lower_reference
from strategies.lowering_members import MemberFold, member_fold
from strategies.members import Hashed
from strategies.series import Microbatch, microbatches, series
from strategies.symmetry import find_copies
from tests.conftest import traced
from tests.strategies.test_lowering_reference import _assert_equal


class Piece(NamedTuple):
    name: str
    at: int
    box: tuple


def test_series_moves_ints_on_by_their_steps():
    a = Piece("x", 3, ((0, 4), (8, 12)))
    f = series(a, Piece("x", 4, ((0, 4), (12, 16))))
    assert f(0) == a and f(5) == Piece("x", 8, ((0, 4), (28, 32)))
    assert type(f(2)) is Piece and type(f(2).box) is tuple
    g = series((1, "y", None), (1, "y", None))
    assert g(7) == (1, "y", None)


def test_series_keeps_what_two_fields_share():
    c0, c1 = Piece("c", 0, ((0, 2),)), Piece("c", 1, ((2, 4),))
    f = series((c0, c0, Piece("r", 0, ())), (c1, c1, Piece("r", 1, ())))
    out = f(3)
    assert out[0] is out[1] and out[0] == Piece("c", 3, ((6, 8),))
    assert f(4)[0] is not out[0]  # a new object every call


@pytest.mark.parametrize("a,b", [
    (("x", 1), ("y", 2)),  # a string differs
    ((1, 2), (1, 2, 3)),  # a length
    ((1, True), (2, False)),  # a bool is no int
    ((1, 2.0), (2, 3.0)),  # nor a float
    (Piece("x", 0, ()), ("x", 1, ())),  # a type
    ((0, Hashed((1, 2))), (1, Hashed((1, 3)))),  # a tuple of another kind: made as it is or not at all
])
def test_no_series_where_terms_differ_otherwise(a, b):
    assert series(a, b) is None


def test_no_series_where_sharing_differs():
    c0 = Piece("c", 0, ())
    assert series((c0, c0), (Piece("c", 1, ()), Piece("c", 1, ()))) is None
    c1 = Piece("c", 1, ())
    assert series((c0, Piece("c", 0, ())), (c1, c1)) is None


@pytest.fixture
def counted(monkeypatch):
    """[ops lowered with the series on, those whose interior micro-batches came from it]."""
    seen = [0, 0]
    inner = pieces.microbatches

    def counting(one, m, alike):
        calls = []

        def once(j):
            calls.append(j)
            return one(j)
        out = inner(once, m, alike)
        if m >= series_module.SERIES_FROM:
            seen[0] += 1
            seen[1] += len(calls) < m
        return out

    monkeypatch.setattr(pieces, "microbatches", counting)
    return seen


def _plainly(monkeypatch, fn):
    """``fn()`` with every micro-batch derived on its own."""
    with monkeypatch.context() as patch:
        patch.setattr(series_module, "SERIES_FROM", 1 << 30)
        return fn()


@pytest.mark.parametrize("microbatches", [8, 16])
@pytest.mark.parametrize("name", ["mlp", "gpt", "rnnlm", "llama", "inception_v3"])
def test_series_of_microbatches_equals_each_derived(name, microbatches, counted, monkeypatch):
    graph = traced(name, batch_size=32)
    rng = random.Random(f"{name}-{microbatches}")
    configs = {node.name: list(enumerate_configs(node, 4, microbatches)) for node in graph}
    for schedule in ("gpipe", "1f1b"):
        plan = Strategy.of({op: rng.choice(cfgs) for op, cfgs in configs.items()}, 4, microbatches, schedule)
        _assert_equal(lower_reference(graph, plan), _plainly(monkeypatch, lambda: lower_reference(graph, plan)))
    assert counted[1] > counted[0] // 2  # most ops took the series


def _sharing(lowered) -> dict:
    """Per op, its collective reads grouped by the collective object they read."""
    out = {}
    for op, p in lowered.pieces.items():
        ids: dict = {}
        out[op] = [ids.setdefault(id(r.collective), len(ids)) for r in p.collective_reads]
    return out


def test_series_under_the_member_and_copy_folds_equals_each_derived(counted, monkeypatch):
    graph = traced("gpt", "small", batch_size=64)
    plan = megatron_lm(graph, 16, 4, 2)
    assert plan.microbatches == 32
    copies = find_copies(graph, plan)
    fold = member_fold(graph, plan, copies)
    assert isinstance(fold, MemberFold), fold
    for over in (fold, copies):
        got = lower(graph, plan, copies=over)
        want = _plainly(monkeypatch, lambda: lower(graph, plan, copies=over))
        _assert_equal(got, want)
        assert got.collectives and _sharing(got) == _sharing(want)
    assert counted[1] > counted[0] // 2


class Row(nn.Module):
    """Every sample plus row 37 of the batch: an op without a sample dim reading the rows of one
    micro-batch alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h + h[37]


def test_an_op_without_a_sample_dim_reading_one_row_is_derived_each(monkeypatch):
    graph = trace(Row(), (torch.randn(64, 8),))
    plan = Strategy.of({node.name: next(iter(enumerate_configs(node, 2, 8))) for node in graph}, 2, 8)
    got = lower_reference(graph, plan)
    _assert_equal(got, _plainly(monkeypatch, lambda: lower_reference(graph, plan)))
    row = next(op for op in got.partitions if graph[op].sample_dim is None and graph[op].inputs)
    assert [t.microbatch for t in got.transfers if t.dst_op == row] == [4]  # rows [32, 40)


def _one(raise_at: tuple[int, ...] = (), bend: int | None = None):
    """Micro-batch j's pieces: a box [4j, 4j + 4), raising at the micro-batches ``raise_at``, moved
    off the line at ``bend``."""
    def one(j):
        if j in raise_at:
            raise ValueError(f"micro-batch {j}")
        lo = 4 * j + (1 if j == bend else 0)
        return Microbatch(((j, (lo, lo + 4)),), (), (), frozenset({(0, 1)}))
    return one


def _derived(one, m: int, alike: bool) -> tuple[list, list[int]]:
    """``microbatches(one, m, alike)`` and the micro-batches it derived, in order."""
    calls: list[int] = []
    got = microbatches(lambda j: calls.append(j) or one(j), m, alike)
    return got, calls


def test_microbatches_follow_the_series_and_fall_back_in_order():
    for one, derived in ((_one(), [0, 1, 2, 11]),  # on the line: the interior from the series
                         (_one(bend=11), [0, 1, 2, 11] + list(range(3, 11))),  # the last off the line
                         (_one(bend=2), [0, 1, 2, 11] + list(range(3, 11)))):  # no series of 1 and 2 to the last
        got, calls = _derived(one, 12, True)
        assert got == [one(j) for j in range(12)] and calls == derived
    assert _derived(_one(), 12, False)[1] == list(range(12))  # not alike: each derived
    assert _derived(_one(), 7, True)[1] == list(range(7))  # fewer than SERIES_FROM
    with pytest.raises(ValueError, match="micro-batch 11"):
        microbatches(_one(raise_at=(11,)), 12, True)
    with pytest.raises(ValueError, match="micro-batch 5"):  # the last raises: the first in order raises
        microbatches(_one(raise_at=(5, 11)), 12, True)
    with pytest.raises(ValueError, match="micro-batch 1"):
        microbatches(_one(raise_at=(1, 11)), 12, False)
