"""``strategies.memo.per_lowered`` keeps no lowering alive: once an Evaluator and its caches are
let go, no ``Lowered`` is left (the memos of the ZeRO uses, the run orders, the bucket plan held
the last lowering each saw: at 1,024 devices a plan's pieces, hundreds of MB), and a memo still
answers with the same object while its lowering lives."""

from __future__ import annotations

import gc

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search.api import Evaluator
from soapsearch.search.globalmove import GlobalMoves
from strategies.lowered import Lowered
from strategies.lowering import lower
from strategies.memo import per_lowered
from tests.conftest import traced


def _alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Lowered)


def test_no_lowering_outlives_the_evaluator():
    graph = traced("gpt", batch_size=16)
    evaluate = Evaluator(graph, get_topology("p100-1x4"), get_cost_model("analytical"), "adam", "bf16")
    moves = GlobalMoves(graph, 4, (1, 2), "bf16", evaluate)
    plans = [p for p in map(moves.plan, moves.factorizations[::5]) if p is not None][:3]
    before = _alive()
    for plan in plans:  # ZeRO levels, schedules and micro-batches: every memo reads some
        evaluate(plan)
        moves.op_seconds(plan)
    evaluate = moves = None
    assert _alive() == before


def test_a_memo_answers_the_same_object_while_its_lowering_lives():
    graph = traced("mlp", batch_size=16)
    moves = GlobalMoves(graph, 4, (1, 2), "model")
    lowered = lower(graph, moves.plan(moves.factorizations[0]))
    calls = []

    @per_lowered
    def derived(lw):
        calls.append(lw)
        return [len(lw.pieces)]

    first = derived(lowered)
    assert derived(lowered) is first and len(calls) == 1
    lowered = lower(graph, moves.plan(moves.factorizations[-1]))
    assert derived(lowered) is not first and len(calls) == 2
