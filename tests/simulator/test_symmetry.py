"""Replica folding's detection (``simulator.symmetry.find_copies``): the copies of data
parallel, FSDP, hybrid and Megatron-LM plans, and none for a pipeline or a plan one op of
which breaks the symmetry."""

from __future__ import annotations

from simulator.symmetry import find_copies
from strategies import ParallelConfig
from strategies.baselines import baseline
from tests.conftest import traced


def test_data_parallel_and_fsdp_are_one_copy_per_device():
    graph = traced("gpt", batch_size=16)
    for name in ("data_parallel", "fsdp", "zero1"):
        found = find_copies(graph, baseline(name, graph, 8))
        assert found.copies == tuple((d,) for d in range(8)), name
        assert (found.count, found.size) == (8, 1)


def test_megatron_copies_are_its_data_parallel_replicas():
    """T = 2, P = 2 on 8 devices: stage 0 on 0-3, stage 1 on 4-7, data parallel 2 inside each
    stage: copy 0 is the first tensor-parallel pair of both stages."""
    graph = traced("gpt", batch_size=16)
    plan = baseline("megatron", graph, 8, tp=2, pp=2, microbatches=2)
    found = find_copies(graph, plan)
    assert found.copies == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert found.representative[6] == 4 and found.kept == frozenset((0, 1, 4, 5))


def test_hybrid_copies_are_its_tensor_parallel_pairs():
    graph = traced("mlp")  # batch 4: sample 4 x out_features 2
    found = find_copies(graph, baseline("hybrid", graph, 8))
    assert found.copies == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_pipeline_and_a_broken_replica_are_one_fold():
    graph = traced("gpt", batch_size=16)
    assert find_copies(graph, baseline("pipeline", graph, 8)) is None
    plan = baseline("data_parallel", graph, 8)
    op = next(n.name for n in graph if n.kind == "linear")
    c = plan[op]
    swapped = plan.replace(op, ParallelConfig(c.degrees, (1, 0) + c.devices[2:]))  # 0 and 1 swap for one op
    assert find_copies(graph, swapped) is None  # sample 0 on device 1 here, on device 0 elsewhere
    assert find_copies(graph, plan.replace(op, ParallelConfig(c.degrees, c.devices[4:] + c.devices[:4]))) is None
