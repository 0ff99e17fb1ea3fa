"""An op's pieces of its interior micro-batches taken from a series (``strategies.series``,
``strategies.pieces.SERIES_FROM``) equal those derived one micro-batch after another: on random
plans of tiny zoo models at 8 and 16 micro-batches, and on the member fold of GPT's Megatron-LM
plan at 32; and the series itself: ints moved on by their steps, everything else kept, shared
values shared, no series where two terms differ otherwise."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

import strategies.pieces as pieces
from strategies import Strategy, enumerate_configs
from strategies.baselines import megatron_lm
from strategies.lowering import lower, lower_reference
from strategies.lowering_members import MemberFold, member_fold
from strategies.members import Hashed
from strategies.series import series
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
    inner = pieces._microbatches

    def counting(one, m):
        calls = []

        def once(j):
            calls.append(j)
            return one(j)
        out = inner(once, m)
        if m >= pieces.SERIES_FROM:
            seen[0] += 1
            seen[1] += len(calls) < m
        return out

    monkeypatch.setattr(pieces, "_microbatches", counting)
    return seen


def _plainly(monkeypatch, fn):
    """``fn()`` with every micro-batch derived on its own."""
    with monkeypatch.context() as patch:
        patch.setattr(pieces, "SERIES_FROM", 1 << 30)
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


def test_series_under_the_member_fold_equals_each_derived(counted, monkeypatch):
    graph = traced("gpt", "small", batch_size=64)
    plan = megatron_lm(graph, 16, 4, 2)
    assert plan.microbatches == 32
    fold = member_fold(graph, plan, find_copies(graph, plan))
    assert isinstance(fold, MemberFold), fold
    got = lower(graph, plan, copies=fold)
    _assert_equal(got, _plainly(monkeypatch, lambda: lower(graph, plan, copies=fold)))
    assert got.collectives and counted[1] > counted[0] // 2
