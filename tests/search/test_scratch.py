"""The sweep's trial lowering cache (``soapsearch.search.scratch``): a plan lowered through a
``Scratch`` is the plan lowered fresh, the search's cache is untouched unless the trial is kept,
and a kept trial's entries serve the next lowering."""

from simulator.memory import peak_memory
from soapsearch.search.scratch import Scratch
from strategies import data_parallel
from strategies.baselines import sharded
from strategies.lowering import lower
from tests.conftest import traced


def _snapshot(cache: dict) -> dict:
    return {k: (v if not isinstance(v, dict) else _snapshot(v)) for k, v in cache.items()}


def test_a_trial_reads_the_cache_and_leaves_it_as_it_was():
    graph = traced("mlp")
    first = data_parallel(graph, 4).with_precision("bf16")
    other = sharded(first, graph, 1)  # the weighted ops' configs change, the others' do not
    base: dict = {}
    lower(graph, first, base)
    before = _snapshot(base)
    trial = Scratch(base)
    got = lower(graph, other, trial)
    alone: dict = {}
    fresh = lower(graph, other, alone)
    assert peak_memory(got, "adam") == peak_memory(fresh, "adam") and got == fresh
    assert _snapshot(base) == before  # nothing written, no state patched
    mine, theirs = len(trial[("precision", "bf16")]), len(alone[("precision", "bf16")])
    assert 0 < mine < theirs  # the unchanged ops' pieces read from the base, not lowered again
    trial.keep()
    inner = base[("precision", "bf16")]
    assert len(inner) > len(before[("precision", "bf16")])
    again = lower(graph, other, base)
    assert peak_memory(again, "adam") == peak_memory(fresh, "adam") and again == fresh
