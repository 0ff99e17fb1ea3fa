import pytest

from strategies import (PlanError, baseline, balanced_stages, data_parallel, hybrid, model_parallel, owt,
                        pipeline)
from strategies.region import partition_index
from strategies.rules import get_rule
from tests.conftest import traced

ZOO = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt"]


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel", "owt", "pipeline"])
def test_every_baseline_is_valid(name, kind):
    g = traced(name)
    plan = baseline(kind, g, 2, microbatches=2)
    plan.validate(g)
    assert plan.num_devices == 2


def test_data_parallel_splits_every_sample_dim():
    g = traced("resnet101")
    plan = data_parallel(g, 4)
    for n in g:
        cfg = plan[n.name]
        if n.sample_dim is not None:
            assert cfg.degrees[n.sample_dim] == 4 and cfg.devices == (0, 1, 2, 3), n.name
            assert cfg.parts == 4


def test_data_parallel_batch_must_divide():
    with pytest.raises(PlanError, match=r"batch 4 is not divisible by 3 devices x 1 micro-batches = 3"):
        data_parallel(traced("mlp"), 3)


def test_model_parallel_contiguous_and_balanced():
    g = traced("resnet101", "default")
    plan = model_parallel(g, 4)
    devs = [plan[n.name].devices[0] for n in g]
    assert devs == sorted(devs) and set(devs) == {0, 1, 2, 3}  # contiguous runs, every device used
    loads = [sum(n.flops for n in g if plan[n.name].devices[0] == d) for d in range(4)]
    assert max(loads) < 1.35 * sum(loads) / 4, loads


def test_balanced_stages_is_optimal_on_small_case():
    g = traced("mlp")
    runs = balanced_stages(g, 3)
    assert [x for r in runs for x in r] == [n.name for n in g]
    assert len(runs) <= 3


def test_owt_splits_linears_on_parameter_dim():
    g = traced("alexnet")
    plan = owt(g, 4)
    for n in g:
        cfg = plan[n.name]
        out = len(n.output.shape) - 1  # out_features (in_features, a reduction dim, follows)
        if n.kind == "linear" and n.shape[out] % 4 == 0:
            assert cfg.degrees[out] == 4 and n.dims[out].role == "parameter", n.name
        elif n.kind == "linear":  # 10 classes do not split 4 ways: data parallel instead
            assert cfg.degrees[n.sample_dim] == 4 and cfg.parts == 4, n.name
        elif n.kind == "conv2d":
            assert cfg.degrees[n.sample_dim] == 4 and cfg.parts == 4


def test_pipeline_micro_batches():
    g = traced("gpt")
    plan = pipeline(g, 2, microbatches=4)
    assert plan.microbatches == 4 and plan.schedule == "gpipe"
    with pytest.raises(PlanError, match=r"not divisible"):
        pipeline(g, 2, microbatches=3)


def test_unknown_baseline():
    with pytest.raises(PlanError, match=r"baseline = 'zero': must be one of"):
        baseline("zero", traced("mlp"), 2)


@pytest.mark.parametrize("name", ZOO)
def test_hybrid_is_data_parallel_when_the_batch_divides(name):
    g = traced(name)  # batch 4
    assert hybrid(g, 4) == data_parallel(g, 4)
    assert hybrid(g, 2) == data_parallel(g, 2)


@pytest.mark.parametrize("name", ZOO)
def test_hybrid_cuts_the_rest_of_the_devices(name):
    """Batch 2 on 4 devices: data parallel 2 ways x 2 ways on the first parameter dim that
    takes it (else the first attribute dim); partition (sample i, other j) on device 2i + j."""
    g = traced(name, batch_size=2)
    plan = hybrid(g, 4)
    plan.validate(g)
    cut_p = 0
    for n in g:
        cfg, i = plan[n.name], n.sample_dim
        if i is None:
            assert cfg.parts == 1, n.name
            continue
        assert cfg.degrees[i] == 2, (n.name, cfg)
        rule = get_rule(n.kind)

        def takes(k):
            degrees = tuple(2 if x == i else 2 if x == k else 1 for x in range(len(n.dims)))
            return k != i and rule.splittable(n)[k] and n.shape[k] % 2 == 0 and rule.check_degrees(n, degrees) is None

        first = [k for role in ("parameter", "attribute") for k, d in enumerate(n.dims) if d.role == role and takes(k)]
        others = [k for k, d in enumerate(cfg.degrees) if d > 1 and k != i]
        if not first:  # no other dim takes 2: on the first device of each sample shard's pair
            assert others == [] and cfg.devices == (0, 2), (n.name, cfg)
            continue
        assert others == first[:1] and cfg.degrees[first[0]] == 2, (n.name, cfg)
        cut_p += n.dims[first[0]].role == "parameter"
        for p, dev in enumerate(cfg.devices):
            c = partition_index(p, cfg.degrees)
            assert dev == 2 * c[i] + c[first[0]], (n.name, cfg)
    assert cut_p > 0


def test_hybrid_per_micro_batch_and_with_no_data_parallelism():
    """s divides the micro-batch, not the batch: batch 6 in 2 micro-batches on 4 devices has s =
    gcd(3, 4) = 1, so every op is cut 4 ways on a parameter or attribute dim where one takes 4
    (an unsplittable sample dim does not matter then), else whole on device 0."""
    g = traced("gpt", batch_size=6)
    assert hybrid(g, 4) != hybrid(g, 4, 2)  # s = 2 for the whole batch
    plan = hybrid(g, 4, 2).with_microbatches(2, "gpipe")
    plan.validate(g)
    for n in g:
        cfg = plan[n.name]
        if n.sample_dim is not None:
            assert cfg.degrees[n.sample_dim] == 1, n.name
        assert cfg.parts in (1, 4) and (cfg.parts == 1) == (cfg.devices == (0,)), (n.name, cfg)
    assert sum(plan[n.name].parts == 4 for n in g) > len(g.nodes) // 2
    one = traced("gpt", batch_size=1)  # batch 1: s = 1, and the sample dims (size 1) take no cut
    same = hybrid(one, 4)
    assert [same[n.name].show(n.dims) for n in one] == [plan[n.name].show(n.dims) for n in g]
    with pytest.raises(PlanError, match=r"microbatches = 4: batch 6 is not divisible"):
        hybrid(g, 4, 4)
