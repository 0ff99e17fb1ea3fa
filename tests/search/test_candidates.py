"""The op moves' configs made when first read (soapsearch/search/candidates.py): each op's list is
``enumerate_configs``' in its order, the ops of one signature (a transformer's repeated layers)
share one list, each count of micro-batches shares the config objects of the others, a chain
draws the same proposals from them as from lists made up front, and a search makes one list
per signature however many ops share it."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search import candidates as candidates_module
from soapsearch.search.api import Evaluator, search
from soapsearch.search.candidates import ConfigSpace, config_key
from soapsearch.search.mcmc import Budget, candidate_configs, neighbor_ops, run_chain
from soapsearch.search.moves import Moves, MoveRates
from soapsearch.search.pace import SPACE, Pace
from strategies import data_parallel
from strategies.config import enumerate_configs
from strategies.repeats import repeated_blocks
from tests.conftest import traced


@pytest.fixture(scope="module")
def gpt():
    return traced("gpt", batch_size=16)


def _counted(monkeypatch) -> list[str]:
    """The ops whose configs were enumerated (``degree_grids`` called), in order."""
    made: list[str] = []
    grids = candidates_module.degree_grids

    def counting(node, *args):
        made.append(node.name)
        return grids(node, *args)
    monkeypatch.setattr(candidates_module, "degree_grids", counting)
    return made


@pytest.mark.parametrize("n,m,node_size", [(8, 1, 4), (4, 2, None)])
def test_each_op_s_list_is_enumerate_configs_one_list_per_signature(gpt, n, m, node_size, monkeypatch):
    made = _counted(monkeypatch)
    got = candidate_configs(gpt, n, m, node_size)
    assert made == []  # nothing enumerated before it is read
    assert got == {node.name: list(enumerate_configs(node, n, m, node_size)) for node in gpt}
    keys = {config_key(node) for node in gpt}
    assert len(made) == len({id(cfgs) for cfgs in got.values()}) == len(keys) < len(gpt) / 2
    first, second = repeated_blocks(gpt)[0].instances  # the 2 layers
    assert len(first) == len(second) > 5
    assert all(got[a] is got[b] for a, b in zip(first, second))  # repeated layers: one list


def test_counts_of_micro_batches_share_the_config_objects(gpt):
    space = ConfigSpace(gpt, 16, None)
    one, two = space.at(1), space.at(2)
    for op in one:
        same = {(c.degrees, c.devices) for c in one[op]} & {(c.degrees, c.devices) for c in two[op]}
        ids = {(c.degrees, c.devices): id(c) for c in one[op]}
        assert all(ids[(c.degrees, c.devices)] == id(c) for c in two[op] if (c.degrees, c.devices) in same)
    assert sum(map(len, two.values())) < sum(map(len, one.values()))  # a sample dim of 16 / 2 takes no degree 16


def test_a_chain_draws_the_same_from_lists_made_when_read_as_made_up_front(gpt):
    topo = get_topology("p100-1x4")
    eager = {node.name: list(enumerate_configs(node, 4, 1, topo.node_size)) for node in gpt}
    runs = []
    for cands in (candidate_configs(gpt, 4, 1, topo.node_size), eager):
        evaluate = Evaluator(gpt, topo, get_cost_model("analytical"))
        stats = run_chain(data_parallel(gpt, 4), evaluate, cands, Budget(proposals=60), random.Random(3),
                          neighbors=neighbor_ops(gpt, cands))
        runs.append((stats.best, stats.best_cost, stats.proposals, stats.accepted))
    assert runs[0] == runs[1] and runs[0][2] == 60 and runs[0][3] > 0


def test_a_search_enumerates_one_list_per_signature_and_count(gpt, monkeypatch):
    """Micro-batch moves (1, 2, 4) and group moves over 8 devices: each (signature, count) pair
    is enumerated once (before, every op's list, at every count a chain reached)."""
    made = _counted(monkeypatch)
    r = search(gpt, topology="p100-2x4", budget_s=None, proposals=80, seed=2, workers=1, chains=1, patience=0,
               microbatch_move=0.3, microbatch_choices=(1, 2, 4))
    keys = {config_key(gpt[op]) for op in made}
    assert r.proposals == 80 and r.strategy.microbatches in (1, 2, 4)
    assert len(keys) < len(gpt) / 2 and len(made) <= 3 * len(keys)


def test_a_moves_space_at_another_count_reuses_its_configs(gpt, monkeypatch):
    moves = Moves(gpt, 4, MoveRates(), (1, 2))
    made = _counted(monkeypatch)
    moves.space(1).ops
    at_one = len(made)
    moves.space(2).ops
    moves.space(1).ops
    assert at_one == len({config_key(node) for node in gpt}) and len(made) == 2 * at_one


@pytest.mark.parametrize("room", [False, True])
def test_a_chain_starting_at_another_count_builds_its_space_only_where_it_has_room(gpt, room, monkeypatch):
    """The space of the start's count is a paced step (``pace.SPACE``): predicted past the chain's
    budget, the chain ends with its start scored and nothing enumerated; with room, it is built
    once and the chain proposes from it."""
    topo = get_topology("p100-1x4")
    moves = Moves(gpt, 4, MoveRates(), (1, 2))
    moves.space(1).ops
    pace = Pace()
    pace.record(SPACE, 0.0 if room else 1e3)
    made = _counted(monkeypatch)
    evaluate = Evaluator(gpt, topo, get_cost_model("analytical"))
    start = data_parallel(gpt, 4).with_microbatches(2, "1f1b")
    stats = run_chain(start, evaluate, moves.space(1).candidates, Budget(seconds=30.0, proposals=20),
                      random.Random(0), moves=moves, pace=pace, patience=0)
    if room:
        assert stats.proposals == 20 and 2 in moves.spaces and 0 < len(made) < len(gpt) / 2
    else:
        assert stats.proposals == 0 and 2 not in moves.spaces and made == [] and stats.best is start
