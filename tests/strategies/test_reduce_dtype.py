"""A plan's gradient reduce dtype (``Strategy.reduce_dtype``, FSDP2's
``MixedPrecisionPolicy.reduce_dtype``; docs/design.md, "Mixed precision"): validated in one
line, carried by every plan transform, written to and read from the plan JSON, and the
gradient buckets' cap counted in the dtype they are summed in."""

from __future__ import annotations

import copy

import pytest

from strategies import PlanError, baseline, load_strategy, strategy_to_json
from strategies.baselines import data_parallel, sharded
from strategies.config import ParallelConfig
from strategies.lowered import BucketKey, WeightShard, split_buckets
from strategies.lowering import lower, lower_reference
from strategies.megatron_layers import layer_recomputed
from strategies.precision import reduce_dtype, reduce_scale
from strategies.strategy import Strategy
from tests.conftest import traced
from tests.strategies.test_lowering_reference import _assert_equal


@pytest.fixture(scope="module")
def mlp():
    return traced("mlp")


@pytest.mark.parametrize("precision,reduce,says", [
    ("model", "float32", "reduce_dtype = 'float32': a gradient reduce dtype other than 'compute' needs mixed "
                         "precision (precision bf16 or fp16)"),
    ("bf16", "float64", "reduce_dtype = 'float64': must be one of ['compute', 'float32']"),
])
def test_a_bad_reduce_dtype_is_one_line(mlp, precision, reduce, says):
    with pytest.raises(PlanError) as e:
        data_parallel(mlp, 2).with_precision(precision, reduce)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_every_transform_keeps_it(mlp):
    plan = data_parallel(mlp, 2).with_precision("bf16", "float32")
    op = plan.configs[0][0]
    kept = [plan.replace(op, plan[op]), plan.with_microbatches(2), plan.with_bucket_cap(1.0),
            plan.with_fsdp_unit("block"), plan.with_precision("fp16"), plan.with_configs(dict(plan.items())),
            sharded(plan, mlp, 3), layer_recomputed(plan, mlp, [{op}])]
    assert [p.reduce_dtype for p in kept] == ["float32"] * len(kept)
    assert plan.with_precision("model").reduce_dtype == "compute"  # one dtype: nothing to widen
    assert plan != plan.with_precision("bf16", "compute")


def test_the_json_round_trips_and_a_plan_without_it_reduces_in_the_compute_dtype(mlp):
    plan = baseline("data_parallel", mlp, 2).with_precision("bf16", "float32")
    obj = strategy_to_json(plan, mlp)
    assert obj["reduce_dtype"] == "float32" and load_strategy(obj, mlp) == plan
    old = copy.deepcopy(obj)
    del old["reduce_dtype"]
    assert load_strategy(old, mlp).reduce_dtype == "compute"
    old["version"] = 3
    del old["bucket_cap_mb"], old["fsdp_unit"]
    assert load_strategy(old, mlp).reduce_dtype == "compute"
    bad = dict(obj, reduce_dtype="bf16")
    with pytest.raises(PlanError, match=r"reduce_dtype = 'bf16': must be one of \['compute', 'float32'\]"):
        load_strategy(bad, mlp)


def test_reduce_dtype_widens_only_half_gradients(mlp):
    plan = data_parallel(mlp, 2).with_precision("bf16", "float32")
    assert [reduce_dtype(plan, d) for d in ("bfloat16", "float16", "float32", "int64")] == \
        ["float32", "float32", "float32", "int64"]
    assert [reduce_scale(plan, d) for d in ("bfloat16", "float16", "float32")] == [2, 2, 1]
    same = plan.with_precision("bf16", "compute")
    assert (reduce_dtype(same, "bfloat16"), reduce_scale(same, "bfloat16")) == ("bfloat16", 1)


def test_a_float32_bucket_fills_at_half_the_bf16_gradients():
    """Shards of 384 KiB of bf16 gradients, cap 2 MiB: summed in bf16 the first bucket closes at
    1 MiB (three shards, 1,152 KiB), the next at 2 MiB (six); summed in float32 each shard
    counts 768 KiB, as ``test_buckets``' float32 shards: two, three, the last one."""
    kib = 1024
    shards = [WeightShard(f"w{i}", ((0, 192 * kib),), (0, 1), 384 * kib, (f"op{i}",), "bfloat16") for i in range(6)]
    keys = [BucketKey((0, 1), "bfloat16", 0, i) for i in range(3)]
    plan = Strategy.of({"x": ParallelConfig((2,), (0, 1))}, 2, precision="bf16", reduce_dtype="float32")
    assert split_buckets(shards, 2 << 20)[0] == {keys[0]: 1152 * kib, keys[1]: 1152 * kib}
    sizes, of = split_buckets(shards, 2 << 20, plan)
    assert sizes == {keys[0]: 768 * kib, keys[1]: 1152 * kib, keys[2]: 384 * kib}  # the shards' own bytes
    assert [k.index for k in of] == [2, 1, 1, 1, 0, 0]
    assert split_buckets(shards, 2 << 20, plan.with_precision("bf16", "compute")) == split_buckets(shards, 2 << 20)


def test_the_cached_lowering_follows_the_reduce_dtype():
    """One cache lowers a plan in both reduce dtypes in turn; each equals the reference lowering
    (the buckets split again where only the reduce dtype changed)."""
    g = traced("gpt")
    plan = data_parallel(g, 2).with_precision("bf16").with_bucket_cap(0.01)
    cache: dict = {}
    for reduce in ("compute", "float32", "compute"):
        p = plan.with_precision("bf16", reduce)
        got = lower(g, p, cache)
        _assert_equal(got, lower_reference(g, p))
    wide = lower(g, plan.with_precision("bf16", "float32")).gradient_sync.buckets
    narrow = lower(g, plan).gradient_sync.buckets
    assert sum(wide.values()) == sum(narrow.values()) and len(wide) > len(narrow)
