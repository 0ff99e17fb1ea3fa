"""Gradient buckets cut at the plan's cap as DDP cuts them (``strategies.lowered.split_buckets``,
torch's ``_compute_bucket_assignment_by_size``): shards in reverse order, a bucket closed once it
reaches its limit (the first min(1 MiB, cap), then the cap), by hand on zoo mlp and gpt; the
issue points (``strategies.overlap``) of the buckets; the cached lowering equals the reference
with several buckets; a bad cap is one line naming field, value and rule."""

from __future__ import annotations

import random

import pytest

from strategies import enumerate_configs
from strategies.baselines import data_parallel
from strategies.errors import PlanError
from strategies.lowered import BucketKey, split_buckets
from strategies.lowering import lower, lower_reference
from strategies.overlap import BucketIssue, bucket_issues, bucket_order
from strategies.schedule import Step
from strategies.zero import zero_buckets
from tests.conftest import traced
from tests.executor.plans import make_plan
from tests.strategies.test_lowering_reference import _assert_equal

F32 = ((0, 1), "float32")


def test_mlp_splits_by_hand_in_reverse_order():
    # mlp tiny's shards, float32 bytes: layers.0 weight 2048, bias 128; layers.2 4096, 128;
    # layers.4 1280, 40. Reversed, cap 4 KiB: 40 + 1280 + 128 + 4096 = 5544 >= 4096 closes
    # bucket 0 (layers.4, layers.2); layers.0's 128 + 2048 = 2176 is bucket 1
    g = traced("mlp")
    low = lower(g, data_parallel(g, 2).with_bucket_cap(4 / 1024))
    b0, b1 = BucketKey(*F32), BucketKey(*F32, 0, 1)
    assert low.gradient_sync.buckets == {b0: 5544, b1: 2176}
    assert {s.name: key for s, key in zip(low.weight_shards, low.gradient_sync.shard_buckets)} == {
        "layers.0.weight": b1, "layers.0.bias": b1, "layers.2.weight": b0, "layers.2.bias": b0,
        "layers.4.weight": b0, "layers.4.bias": b0}
    # bucket 0 is final after layers_2's backward, bucket 1 after layers_0's: issued in that order
    assert bucket_order(low) == [b0, b1]
    assert bucket_issues(low) == {d: [BucketIssue(b0, Step(True, "layers_2", d, 0)),
                                      BucketIssue(b1, Step(True, "layers_0", d, 0))] for d in (0, 1)}
    # DDP's default 25 MiB (first bucket 1 MiB): one bucket of all 7720 bytes
    assert lower(g, data_parallel(g, 2)).gradient_sync.buckets == {b0: 7720}


def test_the_first_bucket_is_capped_at_one_mib_as_ddps():
    # shards of 768 KiB each, cap 2 MiB: the first bucket closes at 1 MiB (two shards, 1.5 MiB),
    # the next at 2 MiB (three: 2.25 MiB), the last holds what is left (one)
    from strategies.lowered import WeightShard

    kib = 1024
    shards = [WeightShard(f"w{i}", ((0, 192 * kib),), (0, 1), 768 * kib, (f"op{i}",), "float32") for i in range(6)]
    sizes, of = split_buckets(shards, 2 << 20)
    assert sizes == {BucketKey(*F32, 0, 0): 1536 * kib, BucketKey(*F32, 0, 1): 2304 * kib,
                     BucketKey(*F32, 0, 2): 768 * kib}
    assert [key.index for key in of] == [2, 1, 1, 1, 0, 0]


def test_zero1_buckets_split_alike_and_levels_2_and_3_stay_one_per_group():
    g = traced("gpt")
    low = lower(g, make_plan(g, "cap8k_zero1_dp", 2))
    sizes = low.gradient_sync.buckets
    assert len(sizes) == 4 and {k.zero for k in sizes} == {1} and sorted(k.index for k in sizes) == list(range(4))
    assert sum(sizes.values()) == 33280  # gpt tiny's trainable bytes, float32
    zb = zero_buckets(low)
    assert list(zb) == sorted(sizes) and all(b.numel * 4 == sizes[k] for k, b in zb.items())
    for level in (2, 3):
        low = lower(g, make_plan(g, f"cap8k_zero{level}_dp", 2))
        assert list(low.gradient_sync.buckets) == [BucketKey(*F32, level)]


@pytest.mark.parametrize("cap", [0, -1, float("inf"), float("nan"), "25", True])
def test_a_bad_cap_is_one_line(cap):
    g = traced("mlp")
    with pytest.raises(PlanError, match=r"bucket_cap_mb = .*: the gradient bucket cap in MiB must be a finite "
                                        r"number > 0 \(DDP's bucket_cap_mb, default 25\)"):
        data_parallel(g, 2).with_bucket_cap(cap)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_cached_lowering_equals_the_reference_with_several_buckets(name):
    graph = traced(name)
    rng = random.Random(name)
    configs = {node.name: list(enumerate_configs(node, 4)) for node in graph}
    ops = [op for op, cfgs in configs.items() if len(cfgs) > 1]
    cache: dict = {}
    plan = data_parallel(graph, 4).with_bucket_cap(1 / 1024)
    low = lower(graph, plan, cache)
    _assert_equal(low, lower_reference(graph, plan))
    assert len(low.gradient_sync.buckets) >= 3
    for _ in range(20):
        op = rng.choice(ops)
        proposal = plan.replace(op, rng.choice(configs[op]).with_memory(zero=rng.choice((0, 0, 1))))
        try:
            want = lower_reference(graph, proposal)
        except PlanError:
            continue
        _assert_equal(lower(graph, proposal, cache), want)
        if rng.random() < 0.5:
            plan = proposal


def test_the_cli_records_the_cap_and_refuses_a_bad_one_in_one_line(tmp_path, capsys):
    import json

    from soapsearch.cli import main
    from tests.conftest import cli_error

    out = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--baseline", "data_parallel", "--topology", "local-cpu-2",
                 "--bucket-cap-mb", "0.5", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["bucket_cap_mb"] == 0.5
    capsys.readouterr()
    line = cli_error(capsys, ["simulate", "mlp", "--variant", "tiny", "--plan", str(out), "--topology",
                              "local-cpu-2", "--bucket-cap-mb", "-1"])
    assert "bucket_cap_mb = -1.0: the gradient bucket cap in MiB must be a finite number > 0" in line
