"""Gradient buckets started during the backward (``strategies.overlap``): a plan whose first
weighted op is at sharding level 1 has two buckets on the same devices, the other ops' (level 0)
ready after the second weighted op's backward, the first op's (level 1) after the last backward
step. Parity with one device on 2 and 4 gloo processes (float64, SGD and Adam), and on 2
processes the executor's trace shows the level-0 bucket's all-reduce started between the
backward step that makes it final and the last backward step. Without ``overlap_grad_reduce``
(``after_``: random plans with pipeline sends among them) both buckets start after the last
backward step, with the same parity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soapsearch.executor import Executor, build_model
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.executor._worker import OPTIMIZERS
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan

CASES_2 = [("mlp", "first1_dp"), ("mlp", "first1_dp_mb2"), ("mlp", "first1_dp+rc_mid"),
           ("mlp", "after_first1_dp_mb2"), ("mlp", "after_random_mb3"), ("gpt", "after_random_mb5")]
CASES_4 = [("mlp", "first1_dp"), ("mlp", "after_stages_dp"), ("mlp", "after_random_mb7")]

results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
test_parity_4_processes = pytest.mark.slow(test_parity_4_processes)  # the README's test command stays within CI's time; `pytest -m slow` runs them


def _trace(rank: int, world: int, port: int, out_dir: str, plan: str = "first1_dp") -> None:
    with gloo_group(rank, world, port):
        built = build_model("mlp", "tiny", dtype="float64")
        ex = Executor(built.graph, make_plan(built.graph, plan, world), built.state, built.inputs,
                      OPTIMIZERS["sgd"], trace=True)
        ex.step(seed=0)
        torch.save(ex.events, Path(out_dir) / f"{rank}.pt")


def test_a_bucket_starts_before_the_last_backward_step():
    traces = spawn_ranks(_trace, 2)
    for events in traces:
        starts = [e for e in events if e["name"] == "gradient sync start"]
        assert [e["args"]["zero"] for e in starts] == [0, 1]  # bucket_order: the later ops' first
        backward = [e for e in events if e["cat"] == "backward"]
        names = [e["name"] for e in backward]
        second = max(i for i, n in enumerate(names) if "layers_2" in n)
        first = names.index(next(n for n in names if "layers_0" in n))
        level0, level1 = starts
        assert backward[second]["ts"] + backward[second]["dur"] <= level0["ts"]  # its gradients final
        assert level0["ts"] + level0["dur"] <= backward[first]["ts"]  # started before layers_0's backward
        last = backward[first]  # the last backward step with a weight (the inputs' after it do nothing)
        assert level1["ts"] >= last["ts"] + last["dur"]  # the level-1 bucket: after it
        sync = next(e for e in events if e["name"] == "gradient sync")
        assert sync["ts"] >= level1["ts"]  # waited at the step end


def _trace_after(rank: int, world: int, port: int, out_dir: str) -> None:
    _trace(rank, world, port, out_dir, "after_first1_dp")


def test_without_overlap_every_bucket_starts_after_the_last_backward_step():
    for events in spawn_ranks(_trace_after, 2):
        starts = [e for e in events if e["name"] == "gradient sync start"]
        assert [e["args"]["zero"] for e in starts] == [0, 1]  # bucket_order still
        backward = [e for e in events if e["cat"] == "backward"]
        end = max(e["ts"] + e["dur"] for e in backward)
        assert all(e["ts"] >= end for e in starts)
