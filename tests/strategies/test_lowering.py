import random

import pytest
import torch
import torch.nn as nn

from soapsearch import trace
from strategies import ParallelConfig, Strategy, baseline, data_parallel, enumerate_configs, owt
from strategies.errors import PlanError
from strategies.lowering import WEIGHT_KINDS, lower
from strategies.region import box_numel, intersect
from tests.conftest import traced

ZOO = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt"]


def random_plan(graph, n, seed, microbatches=1):
    """Every op a random valid config (the search's own enumeration)."""
    rng = random.Random(seed)
    return Strategy.of({node.name: rng.choice(list(enumerate_configs(node, n, microbatches)))
                        for node in graph}, n, microbatches)


def assert_exact_cover(lowered):
    """Every element a consumer partition reads comes from exactly one producer partition, or,
    from a producer whose reduction dims are cut r ways in all, from exactly one partition per
    reduction coordinate: r Partial pieces, every one marked partial; or, read from a
    collective, is what the collective leaves the reader's device, and the collective's holders
    hold Partial sums of its region (all-reduce, reduce-scatter) or tile it (all-gather)."""
    shared = {(r.dst_op, r.dst_index, r.collective.microbatch, r.slot): r
              for p in lowered.pieces.values() for r in p.collective_reads}
    for c in lowered.collectives:
        held = [lowered.partitions[c.op][c.microbatch][q] for q in c.holders]
        assert [h.device for h in held] == list(c.devices) == sorted(set(c.devices))
        if c.kind == "all_gather":
            assert [h.output for h in held] == [c.chunk(i) for i in range(len(held))]
        else:
            assert all(h.output == c.region for h in held)
            assert any(lowered.strategy[c.op].degrees[i] > 1 for i in lowered.graph[c.op].reduction_dims)
    pieces = {}
    for t in lowered.transfers:
        pieces.setdefault((t.dst_op, t.dst_index, t.microbatch, t.slot), []).append(t)
    for op, per_mb in lowered.partitions.items():
        for parts in per_mb:
            for p in parts:
                for slot, region in enumerate(p.input_regions):
                    got = pieces.get((op, p.index, p.microbatch, slot), [])
                    producer = lowered.graph[lowered.graph[op].inputs[slot]]
                    if producer.kind in WEIGHT_KINDS and region is not None:
                        # read from the device's own replica: shards on it cover the region
                        assert not got
                        mine = [sh for sh in lowered.weight_shards
                                if sh.name == producer.weights[0].name and p.device in sh.devices]
                        assert sum(box_numel(x) for sh in mine
                                   for x in [intersect(sh.region, region)] if x) == box_numel(region)
                        continue
                    if region is None:
                        assert not got
                        continue
                    read = shared.get((op, p.index, p.microbatch, slot))
                    if read is not None:
                        assert not got and read.device == p.device
                        assert read.collective.result(read.collective.devices.index(p.device)) == region
                        continue
                    cfg = lowered.strategy[producer.name]
                    r = 1
                    for i in producer.reduction_dims:
                        r *= cfg.degrees[i]
                    assert sum(box_numel(t.region) for t in got) == r * box_numel(region), (op, slot)
                    assert all(t.partial == (r > 1) for t in got)
                    for t in got:
                        assert intersect(t.region, region) == t.region
                    by_coord = {}  # the pieces of one reduction coordinate do not overlap
                    for t in got:
                        c = lowered.partitions[producer.name][t.microbatch][t.src_index].box
                        by_coord.setdefault(tuple(c[i] for i in producer.reduction_dims), []).append(t)
                    assert len(by_coord) == r
                    for same in by_coord.values():
                        for a in range(len(same)):
                            for b in range(a + 1, len(same)):
                                assert intersect(same[a].region, same[b].region) is None


@pytest.mark.parametrize("name", ZOO)
def test_every_read_element_has_exactly_one_producer(name):
    g = traced(name)
    for plan in [baseline(b, g, 4, microbatches=2) for b in ("data_parallel", "owt", "pipeline")] + \
            [random_plan(g, 4, seed) for seed in range(3)] + [random_plan(g, 4, 7, microbatches=2)]:
        assert_exact_cover(lower(g, plan))


def test_data_parallel_moves_only_the_weight_allreduce():
    g = traced("resnet101")
    lowered = lower(g, data_parallel(g, 4))
    assert lowered.bytes_moved == 0
    trainable = [s for s in lowered.weight_shards if s.trainable]
    assert all(s.devices == (0, 1, 2, 3) for s in lowered.weight_shards)
    params = sum(w.spec.nbytes for n in g for w in n.weights if w.trainable)
    assert sum(s.nbytes for s in trainable) == params
    # batch statistics: every batchnorm, one group of all 4 partitions
    bn = [n.name for n in g if n.kind == "batchnorm2d"]
    assert sorted(r.op for r in lowered.reductions if r.name == "batch_stats") == sorted(bn)


def test_owt_on_alexnet_moves_the_bytes_computed_by_hand():
    g = traced("alexnet")  # batch 4, float32, 2 devices
    lowered = lower(g, owt(g, 2))
    # classifier_1 (P2) reads all of [4, 1152] from the data-parallel halves: each device
    # receives the other's 2 x 1152; classifier_4 and classifier_6 read all of [4, 64] from
    # feature-split halves: 4 x 32 each way; the data-parallel loss reads its 2 rows of the
    # class-split logits [4, 10]: 2 x 5 from the other device.
    want = 2 * 4 * (2 * 1152) + 2 * (2 * 4 * (4 * 32)) + 2 * 4 * (2 * 5)
    assert lowered.bytes_moved == want == 20560
    fc = [s for s in lowered.weight_shards if s.name.startswith("classifier.1.")]
    assert {s.devices for s in fc} == {(0,), (1,)}  # parameter split: no replica, no all-reduce


def test_conv_spatial_split_reads_a_halo():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1))
    g = trace(model, (torch.randn(2, 2, 8, 8),))
    a, b = g.nodes[1], g.nodes[2]
    configs = {g.nodes[0].name: ParallelConfig((1, 1, 1, 1), (0,)),
               a.name: ParallelConfig((1, 1, 2, 1, 1), (0, 1)),   # rows 0-3 on 0, 4-7 on 1
               b.name: ParallelConfig((1, 1, 2, 1, 1), (1, 0))}   # rows 0-3 on 1, 4-7 on 0
    lowered = lower(g, Strategy.of(configs, 2))
    moved = [t for t in lowered.transfers if t.dst_op == b.name and not t.local]
    # b's rows 0-3 (device 1) read a's rows 0-4: rows 0-3 from device 0 and row 4 locally;
    # b's rows 4-7 (device 0) read rows 3-7: row 3 locally and rows 4-7 from device 1.
    assert sorted((t.src_device, t.dst_device, t.region[2]) for t in moved) == [(0, 1, (0, 4)), (1, 0, (4, 8))]
    assert all(t.nbytes == 2 * 4 * 4 * 8 * 4 for t in moved)


def test_micro_batches_cut_the_sample_dim():
    g = traced("mlp")  # batch 4
    lowered = lower(g, baseline("pipeline", g, 2, microbatches=2))
    parts = lowered.partitions["layers_0"]
    assert [p.box[0] for mb in parts for p in mb] == [(0, 2), (2, 4)]
    assert_exact_cover(lowered)


class Tied(nn.Module):
    """One Linear applied twice: both ops read (and so replicate) the same weight."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


def test_parameter_ops_are_replicated_weights_under_data_parallel():
    g = traced("gpt")
    lowered = lower(g, data_parallel(g, 4))
    wpe = [s for s in lowered.weight_shards if s.name == "wpe"]
    assert len(wpe) == 1 and wpe[0].devices == (0, 1, 2, 3) and wpe[0].ops == ("add",)
    assert lowered.bytes_moved == 0


def test_partly_overlapping_weight_regions_become_exact_cells():
    g = trace(Tied(), (torch.randn(4, 8),))
    first, second = [n.name for n in g if n.kind == "linear"]
    configs = {n.name: ParallelConfig((1,) * len(n.dims), (0,)) for n in g}
    configs[first] = ParallelConfig((1, 2, 1), (0, 1))        # weight rows 0-3 on 0, 4-7 on 1
    configs[second] = ParallelConfig((1, 4, 1), (2, 3, 0, 1)) # rows 0-1 on 2, 2-3 on 3, ...
    lowered = lower(g, Strategy.of(configs, 4))
    shards = sorted((s.region[0], s.devices) for s in lowered.weight_shards)
    assert shards == [((0, 2), (0, 2)), ((2, 4), (0, 3)), ((4, 6), (0, 1)), ((6, 8), (1,))]
    assert sum(s.nbytes for s in lowered.weight_shards) == 8 * 8 * 4
    assert all(s.ops == (first, second) for s in lowered.weight_shards)


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc(x), y)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_what_waits_on_each_reduction(microbatches):
    import dataclasses

    from strategies.lowering import Gate

    FORWARD, BACKWARD, STEP = Gate.FORWARD, Gate.BACKWARD, Gate.STEP

    def gates(graph, strategy):
        return {(r.name, r.gates) for r in lower(graph, dataclasses.replace(strategy, microbatches=microbatches)).reductions}

    # cross-entropy mean: the divisor Σ w_i needs the data; one micro-batch on every device
    # scales the gradients by 1/C after the backward pass, several seed each backward with it
    g = traced("mlp")
    assert gates(g, data_parallel(g, 2)) == {("loss_sum", STEP if microbatches == 1 else BACKWARD)}
    # the loss on 2 of 4 devices: the other two hold gradients it cannot scale
    half = dataclasses.replace(data_parallel(g, 2), num_devices=4, microbatches=microbatches)
    assert {r.gates for r in lower(g, half).reductions} == {BACKWARD}
    # batch statistics gate the forward
    r = traced("resnet101")
    assert ("batch_stats", FORWARD) in gates(r, data_parallel(r, 2))
    # a mean MSE divides by its element count, known without the data
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    m = trace(Regression(), (x, y))
    assert gates(m, data_parallel(m, 2)) == {("loss_sum", STEP)}
    # a loss that feeds another op must be whole before it: summed in the forward, and the
    # gradient of that sum summed in the backward (2 float32 elements each way, [Σw·ℓ, Σw])
    s = trace(Scaled(), (x, torch.tensor([0, 1, 2, 1])))
    assert gates(s, data_parallel(s, 2)) == {("loss_sum", FORWARD)}
    assert {(r.nbytes, r.grad_nbytes) for r in lower(s, data_parallel(s, 2)).reductions} == {(8, 8)}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, t):
        return nn.functional.cross_entropy(self.fc(x), t) * 0.5


def test_step_sums_ride_the_gradient_bucket_of_their_devices():
    import dataclasses

    from strategies.lowering import BucketKey, Gate, bucket_sums

    g = traced("mlp")
    dp = data_parallel(g, 2)
    # one micro-batch, the loss on both devices, every weight replicated on (0, 1): its bucket
    [(group, bucket)] = bucket_sums(lower(g, dp)).items()
    assert (group.op, group.gates, bucket) == (g.outputs[0], Gate.STEP, BucketKey((0, 1), "float32"))
    # two micro-batches: each sum gates its micro-batch's backward, none is left for the bucket
    assert bucket_sums(lower(g, dataclasses.replace(dp, microbatches=2))) == {}
    # a mean MSE's sums are read at the end of the step whatever the micro-batches: both ride
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    m = trace(Regression(), (x, y))
    low = lower(m, dataclasses.replace(data_parallel(m, 2), microbatches=2))
    assert sorted(r.microbatch for r in bucket_sums(low)) == [0, 1]
    # OWT cuts every linear on its outputs: no replicated weight, so no bucket for the loss's
    # STEP sum, which keeps its own collective
    low = lower(g, owt(g, 2))
    assert [r.gates for r in low.reductions] == [Gate.STEP] and bucket_sums(low) == {}


class Mixed(nn.Module):
    """A float32 layer, then a float64 one and the loss in float64."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 3).double()

    def forward(self, x, t):
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x)).double()), t)


def mixed_graph():
    return trace(Mixed(), (torch.randn(4, 6), torch.tensor([0, 1, 2, 1])))


def test_gradient_buckets_are_one_per_device_set_and_dtype():
    # a flat tensor has one dtype: data parallel over (0, 1) syncs two buckets, float32
    # (fc1: 6·5 + 5 elements · 4 bytes = 140) and float64 (fc2: 5·3 + 3 elements · 8 = 144); the
    # float64 loss's STEP sum rides the float64 one (the executor's LocalWeights.sync_grads
    # runs the same buckets: tests/executor/test_shards.py)
    from strategies.lowering import BucketKey, bucket_key, bucket_sums

    g = mixed_graph()
    low = lower(g, data_parallel(g, 2))
    f32, f64 = BucketKey((0, 1), "float32"), BucketKey((0, 1), "float64")
    assert low.gradient_sync.buckets == {f32: 140, f64: 144}
    assert {s.name: bucket_key(s) for s in low.weight_shards} == {
        "fc1.weight": f32, "fc1.bias": f32, "fc2.weight": f64, "fc2.bias": f64}
    [(group, bucket)] = bucket_sums(low).items()
    assert (group.op, bucket) == (g.outputs[0], f64)
    # a shard on one device, or frozen, is in no bucket
    assert all(bucket_key(s) is None for s in lower(g, owt(g, 2)).weight_shards if len(s.devices) == 1)


@pytest.mark.parametrize("name,microbatches", [("gpt", 2), ("alexnet", 1), ("rnntc", 1)])
def test_a_cached_lowering_patched_plan_by_plan_equals_one_from_scratch(name, microbatches):
    # a walk of one-op changes (some accepted, as MCMC's), and a plan with an invalid config
    # on the way: each lowering through one cache (the previous call's patched) is the one
    # derived from scratch, weight shards in order, totals and gradient-sync buckets included.
    graph = traced(name, batch_size=16)
    rng = random.Random(7)
    configs = {node.name: list(enumerate_configs(node, 4, microbatches)) for node in graph}
    ops = [op for op, cfgs in configs.items() if len(cfgs) > 1]
    current = data_parallel(graph, 4).with_microbatches(microbatches)
    cache: dict = {}
    for i in range(60):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(configs[op]))
        if i == 30:  # the first op changed, a later one given a degree that does not divide its
            # dim: the first is patched before the second raises, and the cache starts over
            order = [node.name for node in graph]
            first, later = min(ops, key=order.index), max(ops, key=order.index)
            bad = current.replace(first, next(c for c in configs[first] if c != current[first])).replace(
                later, ParallelConfig((3,) + (1,) * (len(current[later].degrees) - 1), (0, 1, 2)))
            with pytest.raises(PlanError, match=rf"op '{later}'.*degree 3 .* does not divide it"):
                lower(graph, bad, cache)
        got, want = lower(graph, proposal, cache), lower(graph, proposal)
        assert got.weight_shards == want.weight_shards
        assert got.device_bytes == want.device_bytes and got.gradient_sync == want.gradient_sync
        assert got.partitions == want.partitions and got.transfers == want.transfers
        assert got.reductions == want.reductions
        if rng.random() < 0.5:
            current = proposal


def test_replace_makes_the_plan_built_anew_and_patches_its_devices():
    # replace() splices one config in (no pass over the ops): equal, hashed and used alike as
    # the plan made from scratch, down a chain of replacements.
    graph = traced("alexnet", batch_size=16)
    rng = random.Random(3)
    plan = data_parallel(graph, 4)
    assert plan.devices_used == (0, 1, 2, 3)
    for _ in range(40):
        op = rng.choice([node.name for node in graph])
        plan = plan.replace(op, rng.choice(list(enumerate_configs(graph[op], 4))))
        anew = Strategy.of(dict(plan.configs), 4)
        assert plan == anew and hash(plan) == hash(anew) and plan[op] is anew[op]
        assert plan.devices_used == anew.devices_used == tuple(sorted({d for _, c in anew.configs for d in c.devices}))
    with pytest.raises(KeyError, match="no config for op 'nope'"):
        plan.replace("nope", plan[graph.outputs[0]])
