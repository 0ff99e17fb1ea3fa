"""The memory walk with the gradient buckets' flat tensors (``simulator.memory.activation_peaks``:
max((w − 1)·K + r_f, w·K + r_b, K + r_last), and the interleaved walk pass by pass) equals a
step-by-step walk of each device's run order (``strategies.schedule.device_order``) over the same
rows: each op's forward adds what it holds and frees what its forward lets go, each backward
adds what is recomputed and frees what it kept, and in the last micro-batch each backward step
is followed by the buckets issued after it (``simulator.memory_collectives.bucket_rows``), held
to the end. On data parallel, ZeRO-1, 1F1B stages with data-parallel replicas and Megatron-LM
under the interleaved schedule (its layer norms replicated over the tensor-parallel pairs; and
two stages of two chunks, data parallel in each, at ZeRO-1)."""

from __future__ import annotations

import pytest

from simulator.memory_walks import _issued, _positions, _rows, activation_peaks
from strategies.lowering import lower
from strategies.megatron import megatron
from strategies.schedule import device_order
from tests.conftest import traced
from tests.executor.plans import make_plan, zero


def _walked(low) -> list[int]:
    """Per device, the most it holds over its steps, one op's rows at its first step of each
    pass (every op here has one partition a device and micro-batch)."""
    n = low.strategy.num_devices
    held, freed, redone, gone = _rows(low)
    issued = _issued(low, None, n)
    position, last = _positions(low.graph), low.strategy.microbatches - 1
    out = [0] * n
    for d, steps in device_order(low).items():
        level = peak = 0
        for s in steps:
            i = position[s.op]
            if s.backward:
                level += redone[i, d]
                peak = max(peak, level)
                level -= gone[i, d]
                if s.microbatch == last:
                    level += issued[i, d]
            else:
                level += held[i, d]
                peak = max(peak, level)
                level -= freed[i, d]
        out[d] = int(max(peak, level))
    return out


def _plans():
    gpt = traced("gpt")
    yield "dp", gpt, make_plan(gpt, "cap8k_dp", 2)
    yield "zero1", gpt, zero(1, make_plan(gpt, "cap8k_dp", 2), gpt)
    yield "dp_mb2", gpt, make_plan(gpt, "dp", 2).with_microbatches(2, "gpipe").with_bucket_cap(8 / 1024)
    mlp = traced("mlp", batch_size=16)
    yield "stages_dp", mlp, make_plan(mlp, "stages_dp", 4).with_microbatches(2, "1f1b").with_bucket_cap(1 / 1024)
    yield "interleaved", gpt, megatron(gpt, 4, tp=2, pp=2, microbatches=4, virtual_stages=2)
    yield "interleaved_zero1", gpt, zero(1, megatron(gpt, 4, tp=1, pp=2, microbatches=2, virtual_stages=2), gpt)


@pytest.mark.parametrize("name,graph,plan", list(_plans()), ids=[p[0] for p in _plans()])
def test_the_walk_with_buckets_equals_a_step_by_step_walk(name, graph, plan):
    low = lower(graph, plan)
    assert _issued(low, None, plan.num_devices) is not None, name
    walked = _walked(low)
    assert activation_peaks(low) == walked, name
    # the buckets raise ZeRO-1's peaks (n + 1 chunks) and the stages' (one micro-batch's activations
    # small beside the weights); data parallel's activations outweigh its buckets at the sync, and
    # the Megatron pairs' replicated layer norms are small
    raised = any(w > b for w, b in zip(walked, activation_peaks(low, buckets=False)))
    assert raised == (name in ("zero1", "stages_dp", "interleaved_zero1")), name
