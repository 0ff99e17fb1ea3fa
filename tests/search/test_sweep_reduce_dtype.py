"""The sweep's closed-form estimate with the plan's gradient reduce dtype
(``soapsearch.search.sweep.estimate``, ``strategies.precision.reduce_scale``): a bf16 plan
summing its gradients in float32 moves twice the bytes in the data-parallel all-reduce (level
0), in the reduce-scatter half of it at levels 1-3, and holds its level-0/1 gradient buckets'
flat tensors in float32 at the step's sync; ``megatron_lm_factors`` picks the degrees by it."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.presets import get_topology
from simulator.topology import Topology
from soapsearch.search.globalmove import Factorization
from soapsearch.search.sweep import _ring, _shape, estimate, megatron_lm_factors
from tests.search.test_sweep_megatron_lm import _gpt3


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_reducing_in_float32_moves_and_holds_twice_the_gradient_bytes(zero):
    graph, topo = _gpt3(), get_topology("a100-1x8")
    half, wide = (_shape(graph, topo, 8, "adam", "bf16", r) for r in ("compute", "float32"))
    assert (half.reduce, wide.reduce, half.value) == (1, 2, 2)
    assert _shape(graph, topo, 8, "adam", "model").reduce == 1
    f = Factorization(1, 1, 2, "1f1b", zero, True, False)  # data parallel over 8, layers recomputed
    a, b = estimate(f, 8, half), estimate(f, 8, wide)
    held = half.held_inside + half.held_outside
    ring = _ring(held * half.value, 8, 8, half)  # one ring all-reduce of the bf16 gradients
    # level 0 all-reduces in float32: one more ring; levels 1-3 reduce-scatter in it: half a ring
    assert b.seconds - a.seconds == pytest.approx(ring * (1 if zero == 0 else 0.5), rel=1e-12)
    if zero >= 2:  # gradients reduce-scattered per use: no bucket held to the sync
        assert b.peak_bytes == a.peak_bytes
        return
    # the buckets at the sync (activations freed) outweigh the recomputed activations in float32:
    # every gradient in 4 bytes, level 1 also padded to 8 chunks with its chunk besides
    states = held * (2 + 2 + 12 / (8 if zero else 1))
    buckets = held * 4 * (1 if zero == 0 else 9 / 8)
    assert b.peak_bytes == pytest.approx(states + buckets, rel=1e-12)
    assert a.peak_bytes < b.peak_bytes and a.peak_bytes - states < buckets


def test_megatron_lm_picks_other_degrees_where_float32_buckets_do_not_fit():
    """GPT-3 1.3B's layer, four deep, on 8 A100s cut to 2.2 GB: T2 P1 (the fastest; one 2-way
    data-parallel ZeRO-1 bucket set) is estimated at 1.95 GB reducing in bf16 and 2.47 GB in
    float32, where T4 P1 (1.65 GB) is the fastest that fits."""
    graph, base = _gpt3(), get_topology("a100-1x8")
    topo = Topology("a100-2.2GB", tuple(dataclasses.replace(d, memory_bytes=2_200_000_000) for d in base.devices),
                    base.links, base.routes)
    assert megatron_lm_factors(graph, topo, 8, "adam", "bf16") == (2, 1)
    assert megatron_lm_factors(graph, topo, 8, "adam", "bf16", "compute") == (2, 1)
    assert megatron_lm_factors(graph, topo, 8, "adam", "bf16", "float32") == (4, 1)
    wide = _shape(graph, topo, 8, "adam", "bf16", "float32")
    t2 = estimate(Factorization(2, 1, 4, "1f1b", 1, True, True), 8, wide)
    assert t2.peak_bytes > topo.devices[0].memory_bytes
