"""Folds under the interleaved 1F1B schedule (``strategies.chunks``): a Megatron-LM plan of v
chunks a pipeline rank is lowered on copy 0 (``strategies.lowering_copies``) or on members 0
and 1 of copy 0 (``strategies.lowering_members``), as under GPipe and 1F1B, and the folded
simulation gives the per-device one's iteration time, busy time and peak memory per device
and bytes per link kind (the memory walk pass by pass, ``simulator.memory_walks._interleaved_peaks``,
over every device's passes and copy 0's expanded rows); and ``link_maps`` leaves the
topology's route memo as it was (a copy's G² routes are not held)."""

from __future__ import annotations

import pickle

import pytest
import torch

from simulator.fold import link_maps
from simulator.fold_members import member_maps
from simulator.presets import get_topology
from simulator.memory import activation_peaks
from simulator.simulate import Lowerings, simulate_plan
from soapsearch import trace
from soapsearch._models.transformer import GPT, GPTConfig
from strategies.lowering_members import MemberFold
from strategies.megatron import megatron
from strategies.chunks import pipeline_chunks
from strategies.lowering import lower
from strategies.megatron_layers import layer_recomputed
from strategies.symmetry import Copies
from tests.conftest import traced
from tests.simulator.test_bucket_walk import _walked
from tests.simulator.test_fold_members_sim import assert_same


def _plans():
    gpt = traced("gpt", "small")

    def plan(n, sp=False, recompute=False, cap=None, precision=None, zero=0):
        p = megatron(gpt, n, tp=4, pp=2, microbatches=4, sequence_parallel=sp, virtual_stages=2)
        p = layer_recomputed(p, gpt) if recompute else p
        p = p.with_configs({op: c.with_memory(zero=zero) if any(w.trainable for w in gpt[op].weights) else c
                            for op, c in p.items()})
        p = p if cap is None else p.with_bucket_cap(cap)
        return p if precision is None else p.with_precision(precision)

    return [  # Table 1's rows: T 8, P 16-64, D 6-15, full recompute, local DDP's one bucket, fp16
        pytest.param(plan(8), "a100-1x8", MemberFold, id="T4-P2-v2-D1"),
        # at D 2, 2 samples a replica's micro-batch: the targets cut on samples x sequence keep the members
        pytest.param(plan(16), "a100-2x8", MemberFold, id="T4-P2-v2-D2"),
        pytest.param(plan(16, sp=True, recompute=True), "a100-2x8", MemberFold, id="T4-P2-v2-D2-sp-recompute"),
        pytest.param(plan(32, recompute=True, cap=float(1 << 30), precision="fp16"), "a100-4x8", MemberFold,
                     id="T4-P2-v2-D4-recompute-one-bucket-fp16"),
        pytest.param(plan(32, sp=True, precision="bf16", zero=1), "a100-4x8", MemberFold,
                     id="T4-P2-v2-D4-sp-zero1-bf16"),
    ]


@pytest.mark.parametrize("plan,preset,fold", _plans())
def test_interleaved_folds_exactly(plan, preset, fold):
    graph, topo = traced("gpt", "small"), get_topology(preset)
    assert plan.schedule == "interleaved"
    lowerings = Lowerings(graph, plan)
    lowered = lowerings.first(topo, True)
    assert type(lowered.copies) is fold, lowerings.why
    full = simulate_plan(graph, plan, topo, "analytical", optimizer="adam", fold=False)
    folded = simulate_plan(graph, plan, topo, "analytical", optimizer="adam", fold=True)
    assert_same(folded, full)
    assert folded.num_tasks < full.num_tasks
    assert len(set(full.peak_memory_bytes)) > 1  # the ranks' warm-ups differ: the walk is per device


def test_link_maps_keep_no_routes():
    """The copies' and members' maps read every pair of a copy's routes and keep none of them in
    the topology's memo (``Topology.route`` keeps each pair it is asked)."""
    graph = traced("gpt", "small")
    topo = pickle.loads(pickle.dumps(get_topology("a100-4x8")))  # a fresh memo: no pair asked yet
    fold = Lowerings(graph, _plans()[3].values[0]).first(topo, True).copies
    assert isinstance(fold, MemberFold) and fold.count == 4
    link_maps.cache_clear()  # made again, not read off the cache
    member_maps.cache_clear()
    assert len(topo._memo) == 0
    assert link_maps(topo, Copies(fold.copies)) is not None
    assert not isinstance(member_maps(topo, fold), str)
    assert len(topo._memo) == 0


def test_ranks_alike_walk_their_own_passes():
    """Eight equal layers on P 4, v 2, D 2: ranks 1 and 2 hold equal chunks (the same per-chunk
    figures) and warm up differently, so the walk, made once per rank and figures, gives them
    different peaks, each a step-by-step walk of its run order's (``test_bucket_walk._walked``);
    the copy fold gives the per-device simulation's."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=16, seq_len=8, vocab_size=50))
        tokens = torch.zeros(8, 8, dtype=torch.long)
    graph = trace(model, (tokens, tokens), name="gpt-8-layers")
    plan = megatron(graph, 8, tp=1, pp=4, microbatches=4, virtual_stages=2)
    peaks = activation_peaks(lower(graph, plan))
    assert peaks == _walked(lower(graph, plan))
    ranks = pipeline_chunks(graph, plan).rank
    assert (ranks[2], ranks[4]) == (1, 2) and peaks[2] != peaks[4], peaks
    topo = get_topology("a100-1x8")
    assert type(Lowerings(graph, plan).first(topo, True).copies) is Copies
    assert_same(simulate_plan(graph, plan, topo, fold=True), simulate_plan(graph, plan, topo, fold=False))
