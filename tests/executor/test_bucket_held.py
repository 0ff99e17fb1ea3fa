"""What a rank holds of its level-0/1 gradient buckets' flat tensors equals the memory model's
rows of them (``strategies.collective_buffers.bucket_buffers``,
``simulator.memory_collectives.bucket_rows``), and the model's peak counts them: on 2 gloo
processes, tiny gpt with data-parallel and ZeRO-1 plans whose buckets are capped at 8 KiB (4 KiB
in bf16: 4 to 7 buckets, started through the last backward pass), in float64, in bf16 (reduced in bf16) and in
bf16 reduced in float32 (FSDP2's ``reduce_dtype=torch.float32``: each flat tensor twice the
bucket's bytes), and ZeRO-1 synced after the backward (``overlap_grad_reduce`` false: nothing
held before the sync). Every tensor ``start_bucket`` leaves in flight (level 0: the flat gradients;
level 1: the padded flat tensor and the rank's chunk of the sum) is watched by a weak reference
from its start; the bytes of those alive are counted at the start of every backward step and of
the step's sync. They equal the model's buckets issued before that point, and the walk's peak
(``activation_peaks``) is the most, over those points, of the model's activations there plus
the bytes measured: without the buckets the peak falls short of it."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from simulator.memory import activation_peaks, memory_breakdown
from simulator.memory_walks import _positions, _rows
from simulator.memory_collectives import bucket_rows
from soapsearch.executor import Executor, TrainConfig, build_model
from strategies.lowering import lower
from strategies.schedule import device_order
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

CASES = [("cap8k_dp", "model"), ("cap8k_zero1_dp", "model"), ("cap4k_dp", "bf16"), ("cap4k_dp", "bf16:float32"),
         ("cap4k_zero1_dp", "bf16:float32"), ("after_cap8k_zero1_dp", "model")]
"""(plan, precision): ``model`` runs the float64 model; ``bf16:float32`` reduces in float32."""


def _built(precision: str):
    return build_model("gpt", "tiny", dtype="float64" if precision == "model" else "float32")


def _plan(graph, name: str, precision: str, world: int):
    plan = make_plan(graph, name, world)
    if precision == "model":
        return plan
    compute, _, reduce = precision.partition(":")
    return plan.with_precision(compute, reduce or None)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        got = {}
        for name, precision in CASES:
            built = _built(precision)
            ex = Executor(built.graph, _plan(built.graph, name, precision, world), built.state, built.inputs,
                          TrainConfig("adam", lr=0.01, timeout_s=60))
            watched: list[tuple[weakref.ref, int]] = []
            points: list[tuple[str, int]] = []  # (the backward step's op or "sync", bucket bytes alive)
            start, backward, sync = ex.weights.start_bucket, ex._backward, ex._sync_grads

            def alive() -> int:
                return sum(n for ref, n in watched if ref() is not None)

            def start_bucket(key, groups, riders=(), start=start, watched=watched):
                start(key, groups, riders)
                _, result, held, extra = ex.weights.started[key]
                flats = [result, held] if key in ex.weights.zero else [result]  # level 1: the chunk and x
                riding = sum(t.numel() for t in extra) * result.element_size()  # the loss sums riding it
                for t in flats:
                    watched.append((weakref.ref(t), t.untyped_storage().nbytes() - (riding if t is result else 0)))

            def each_backward(r, backward=backward, points=points):
                if r.part.microbatch == ex.strategy.microbatches - 1:
                    points.append((r.part.op, alive()))
                backward(r)

            def at_sync(sync=sync, points=points):
                points.append(("sync", alive()))
                sync()
            ex.weights.start_bucket, ex._backward, ex._sync_grads = start_bucket, each_backward, at_sync
            ex.step(seed=1)
            got[name, precision] = points
        torch.save(got, f"{out_dir}/{rank}.pt")


def test_each_rank_holds_the_modelled_gradient_buckets():
    held = spawn_ranks(_worker, 2)
    for name, precision in CASES:
        built = _built(precision)
        low = lower(built.graph, _plan(built.graph, name, precision, 2))
        assert low.strategy.microbatches == 1 and len(low.gradient_sync.buckets) >= 4
        position = _positions(low.graph)
        issued = bucket_rows(low, position, 2)
        _, _, redone, gone = _rows(low)
        kept = low.device_bytes.kept
        peaks = activation_peaks(low)
        for d in range(2):
            points = held[d][name, precision]
            ops = [op for op, _ in points[:-1]]
            assert ops == [s.op for s in device_order(low)[d] if s.backward], (name, precision)
            # the model's buckets issued before each point: after the ops backwarded so far
            model = np.concatenate([[0], np.cumsum([issued[position[op], d] for op in ops])]).tolist()
            assert [b for _, b in points] == model, (name, precision, d)
            # its activations at the start of each backward step (one micro-batch in flight)
            level = [kept[d] + int(redone[position[op]:, d].sum() - gone[position[op] + 1:, d].sum()) for op in ops]
            most = max(a + b for a, (_, b) in zip(level + [0], points))
            assert peaks[d] == most, (name, precision, d, most, peaks[d])
            # the buckets raise the peak but in bf16 reduced in bf16, whose buffers are half as large
            assert (most > kept[d]) == (precision != "bf16"), (name, precision, d, most, kept[d])
            assert memory_breakdown(low)[d].gradient_buckets == most - kept[d]
    # synced after the backward: nothing held before the sync, all of ZeRO-1's buffers at it
    after = held[0]["after_cap8k_zero1_dp", "model"]
    assert all(b == 0 for _, b in after[:-1]) and after[-1][1] == held[0]["cap8k_zero1_dp", "model"][-1][1] > 0
    # float32 reduction holds the flat tensors in float32: at the sync, all of them, twice the bf16 ones
    assert held[0]["cap4k_dp", "bf16:float32"][-1][1] == 2 * held[0]["cap4k_dp", "bf16"][-1][1] > 0
