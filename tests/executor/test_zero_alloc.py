"""What a rank holds after a step at each sharding level (``strategies.zero``) equals the memory
model's categories (``simulator.memory.memory_breakdown``), measured on CPU as the bytes of the
tensors it keeps: the weights whole (level 3: only its chunks, the leaves' storage freed);
optimizer state (Adam's two moments) for its chunk only at levels 1-3, and at levels 1 and 2
the chunk's working copy (``master_weights`` in model precision); the gradient whole at level 0,
only its chunk of the sum at levels 1-3 (at level 1 the full gradient, counted by the model
while the backward accumulates it, is freed after the step-end reduce-scatter; at levels 2
and 3 after each use's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from simulator.memory import memory_breakdown
from soapsearch.executor import Executor, TrainConfig, build_model
from strategies import data_parallel
from strategies.lowering import lower
from strategies.zero import sharded_state
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.executor.plans import zero

pytestmark = pytest.mark.distributed

WORLD = 2


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _held(rank: int, world: int, port: int, out: str) -> None:
    with gloo_group(rank, world, port):
        built = build_model("gpt", "tiny", dtype="float64")
        got = {}
        for level in (0, 1, 2, 3):
            ex = Executor(built.graph, zero(level, data_parallel(built.graph, WORLD), built.graph), built.state,
                          built.inputs, TrainConfig("adam", lr=0.01, timeout_s=60))
            ex.step()
            w = ex.weights
            state = [v for p in w.parameters() for k, v in ex.optimizer.state[p].items() if k != "step"]
            own = {s.zero: [] for s in w.fsdp.chunks} | {2: [], 3: []}
            for s, t in w.fsdp.chunks.items():  # level 3's chunk is the weight, level 2's a working copy
                own[s.zero].append(t)
            got[level] = {"weights": sum(t.untyped_storage().nbytes() for t in w.tensors.values()) + _nbytes(own[3]),
                          "gradients": _nbytes([t.grad for t in w.grad_holders()]),
                          "optimizer_state": _nbytes(state),
                          "master_weights": _nbytes(w.chunks.values()) + _nbytes(own[2])}
        torch.save(got, Path(out) / f"{rank}.pt")


def test_held_tensors_match_the_memory_model():
    held = spawn_ranks(_held, WORLD)
    g = build_model("gpt", "tiny", dtype="float64").graph
    for level in (0, 1, 2, 3):
        low = lower(g, zero(level, data_parallel(g, WORLD), g))
        model, ss = memory_breakdown(low, "adam"), sharded_state(low)
        for r in range(WORLD):
            h, m = held[r][level], model[r]
            assert (h["weights"], h["optimizer_state"], h["master_weights"]) == (
                m.weights, m.optimizer_state, m.master_weights), (level, r, h, m)
            assert h["gradients"] == (m.gradients if level != 1 else ss.copies[r]), (level, r, h)
            if level:
                assert 2 * h["optimizer_state"] <= held[r][0]["optimizer_state"] + 64  # a half, padding aside
            if level == 3:  # the weights too: the leaves' storage is freed between uses
                assert 2 * h["weights"] <= held[r][0]["weights"] + 64 and h["weights"] == ss.weights[r]
