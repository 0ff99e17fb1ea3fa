"""The gradient buckets each rank all-reduces (``LocalWeights.sync_grads``) are the lowering's
(``GradientSync.buckets``, which the simulator times): the same keys, device set and dtype
(``strategies.lowering.bucket_key``), and the same bytes. Pure: no process group."""

from __future__ import annotations

import pytest
import torch

from soapsearch.executor import build_model
from soapsearch.executor.shards import LocalWeights
from strategies.baselines import data_parallel
from strategies.lowering import lower
from tests.executor.plans import make_plan
from tests.strategies.test_lowering import Mixed, mixed_graph

CASES = [("mlp", "dp", 2), ("gpt", "owt", 4), ("gpt", "random12", 4), ("alexnet", "hybrid", 4),
         ("resnet101", "stages_dp", 4), ("rnnlm", "random4", 2)]


def _assert_buckets_agree(low, state) -> None:
    for rank in range(low.strategy.num_devices):
        weights = LocalWeights(low, state, rank, torch.device("cpu"))
        want = {key: b for key, b in low.gradient_sync.buckets.items() if rank in key.devices}
        got = {key: sum(weights.view(name, index).numel() * weights.tensors[name].element_size()
                        for name, index in views)
               for key, views in weights.buckets.items()}
        assert got == want, rank
        for key, views in weights.buckets.items():
            assert {str(weights.tensors[name].dtype) for name, _ in views} == {f"torch.{key.dtype}"}


@pytest.mark.parametrize("model,plan,n", CASES, ids=[f"{m}-{p}-{n}" for m, p, n in CASES])
def test_each_ranks_buckets_are_the_lowerings(model, plan, n):
    built = build_model(model, "tiny")
    _assert_buckets_agree(lower(built.graph, make_plan(built.graph, plan, n)), built.model.state_dict())


def test_a_float32_and_a_float64_weight_on_one_device_set_are_two_buckets():
    graph = mixed_graph()
    low = lower(graph, data_parallel(graph, 2))
    assert sorted(k.dtype for k in low.gradient_sync.buckets) == ["float32", "float64"]
    _assert_buckets_agree(low, Mixed().state_dict())
