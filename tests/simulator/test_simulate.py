import dataclasses
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from simulator.comm import allreduce_time, transfer_time
from simulator.cost import AnalyticalCostModel, CostModel
from simulator.devices import DeviceSpec, Link
from simulator.engine import run_events
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import TaskKind, build_tasks
from simulator.topology import Topology
from soapsearch import trace
from strategies import ParallelConfig, Strategy, baseline, data_parallel, model_parallel, pipeline
from strategies.lowering import lower
from strategies.region import box_numel
from tests.conftest import traced


class Perfect(CostModel):
    """Compute that scales perfectly: time proportional to the partition's share of FLOPs."""

    def _op_time(self, node, box, regions, weight_regions, device):
        if node.kind in ("input", "parameter", "constant"):
            return 0.0, 0.0
        share = box_numel(box) / max(1, math.prod(node.shape))
        f = (node.flops + 1e6) * share / device.flops_for("float32")
        return f, 2 * f


def mesh(n, latency=0.0, bandwidth=1e30, memory_bandwidth=1e30, memory=2**40):
    """n devices, a direct link per ordered pair."""
    dev = DeviceSpec("test", memory, {"float32": 1e12}, memory_bandwidth)
    links, routes = [], {}
    for a in range(n):
        for b in range(n):
            if a != b:
                routes[(a, b)] = (len(links),)
                links.append(Link(f"l{a}->{b}", "test", latency, bandwidth))
    return Topology("mesh", (dev,) * n, tuple(links), routes)


def test_one_device_is_the_sum_of_compute_times():
    g = traced("resnet101")
    topo = get_topology("p100-1x1")
    cost = AnalyticalCostModel()
    lowered = lower(g, data_parallel(g, 1))
    tg = build_tasks(lowered, topo, cost)
    start, end = run_events(tg)
    assert max(end) == pytest.approx(sum(tg.duration), rel=1e-12)
    assert simulate_plan(g, lowered, topo, cost).iteration_time == pytest.approx(sum(tg.duration), rel=1e-12)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.b = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))

    def forward(self, x, y, t):
        return F.cross_entropy(self.a(x), t), F.cross_entropy(self.b(y), t)


def test_no_cross_device_data_is_the_longest_device_chain():
    x, t = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = TwoHeads()
    g = trace(model, (x, x.clone(), t))
    # branch a (and the targets) on device 0, branch b on device 1: no transfer between them
    on1 = {n.name for n in g if n.name.startswith("b_") or n.name in ("y", "cross_entropy_1")}
    cfgs = {n.name: ParallelConfig((1,) * len(n.dims), (1 if n.name in on1 else 0,)) for n in g}
    plan = Strategy.of(cfgs, 2)
    lowered = lower(g, plan)
    cross = [tr for tr in lowered.transfers if not tr.local]
    # the only cross-device read is the targets, so make the link free and check the rest
    topo = mesh(2, latency=0.0, bandwidth=1e30)
    tg = build_tasks(lowered, topo, Perfect())
    _, end = run_events(tg)
    per_device = [sum(d for d, dev, res in zip(tg.duration, tg.device, tg.resources)
                      if res == (k,)) for k in range(2)]
    assert cross and all(tr.dst_op == "cross_entropy_1" and tr.src_op == "t" for tr in cross)
    assert max(end) == pytest.approx(max(per_device), rel=1e-9)


@pytest.mark.parametrize("name", ["resnet101", "gpt", "rnnlm"])
@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_on_free_links_is_one_nth(name, n):
    g = traced(name)
    one = simulate_plan(g, data_parallel(g, 1), mesh(1), Perfect())
    many = simulate_plan(g, data_parallel(g, n), mesh(n), Perfect())
    assert many.iteration_time == pytest.approx(one.iteration_time / n, rel=1e-9)


def test_transfer_and_allreduce_tasks_follow_their_formulas():
    g = traced("alexnet")
    topo = get_topology("p100-1x2")
    lowered = lower(g, baseline("owt", g, 2))
    tg = build_tasks(lowered, topo, AnalyticalCostModel())
    sends = [t for t in range(len(tg)) if tg.category[t] == TaskKind.TRANSFER]
    # each fully connected layer reads its input whole, cut on the batch (the convolutions') or
    # on the features (the linear before): an all-gather over (0, 1) (strategies.collectives),
    # each member sending its half; the gradient goes back as a reduce-scatter
    assert [(c.kind, c.devices, c.dim) for c in lowered.collectives] == [
        ("all_gather", (0, 1), 0), ("all_gather", (0, 1), 1), ("all_gather", (0, 1), 1)]
    ring = [t for t in range(len(tg)) if tg.category[t] == TaskKind.COLLECTIVE and tg.duration[t] > 0]
    assert [tg.label(t) for t in ring] == [
        f"{kind} {c.op}@mb0 devices 0,1" for c in lowered.collectives for kind in ("all_gather", "reduce_scatter grad")]
    for t in ring:
        assert tg.duration[t] == pytest.approx(2e-6 + tg.nbytes[t] / 2 / 20e9, rel=1e-9)
    assert [tg.nbytes[t] for t in ring[::2]] == [c.nbytes for c in lowered.collectives] == [18432, 1024, 1024]
    assert sum(tg.nbytes[t] for t in sends) + sum(c.nbytes for c in lowered.collectives) == lowered.bytes_moved == 20560
    for t in sends:
        src, dst = tg.device[t], 1 - tg.device[t]
        assert tg.duration[t] == transfer_time(topo, src, dst, tg.nbytes[t])
        assert tg.duration[t] == pytest.approx(2e-6 + tg.nbytes[t] / 20e9, rel=1e-9)
    ars = [t for t in range(len(tg)) if tg.category[t] == TaskKind.ALLREDUCE and tg.label(t).startswith("allreduce")]
    replicated = [s for s in lowered.weight_shards if len(s.devices) > 1 and s.trainable]
    # one bucket per device set, as the executor syncs: here every replicated shard is on (0, 1),
    # and the loss's [s_p, c_p] (two float32, gated STEP) ride it (strategies.lowering.bucket_sums)
    assert len(ars) == 1 and tg.nbytes[ars[0]] == sum(s.nbytes for s in replicated) + 8 > 8
    assert tg.duration[ars[0]] == allreduce_time(topo, (0, 1), tg.nbytes[ars[0]])
    # each member packs the bucket into one tensor before and copies the gradients back after:
    # 2 · bytes / memory bandwidth each (read + write)
    bw = topo.devices[0].memory_bandwidth
    for d in (0, 1):
        [pack] = [t for t in range(len(tg)) if tg.label(t) == f"pack allreduce bucket 0-1 device {d}"]
        [unpack] = [t for t in range(len(tg)) if tg.label(t) == f"unpack allreduce bucket 0-1 device {d}"]
        assert tg.duration[pack] == pytest.approx(2 * tg.nbytes[ars[0]] / bw, rel=1e-12)
        assert tg.duration[unpack] == pytest.approx(2 * (tg.nbytes[ars[0]] - 8) / bw, rel=1e-12)


def test_route_across_nodes_is_slower():
    g = traced("mlp")
    inside = simulate_plan(g, model_parallel(g, 2), get_topology("p100-1x2"))
    across = simulate_plan(g, model_parallel(g, 2), get_topology("p100-2x1"))
    assert across.iteration_time > inside.iteration_time


def test_same_input_same_output_bit_for_bit():
    g = traced("inception_v3")
    plan = baseline("owt", g, 4)
    a = simulate_plan(g, plan, "p100-1x4", timeline=True)
    b = simulate_plan(g, plan, "p100-1x4", timeline=True)
    assert a == b and a.iteration_time == b.iteration_time and a.timeline == b.timeline


def test_pipeline_overlaps_micro_batches_and_1f1b_holds_less():
    g = traced("resnet101", "default")  # compute-bound: micro-batches do not re-read much
    topo = get_topology("p100-1x4")
    mp = simulate_plan(g, model_parallel(g, 4), topo)
    gp = simulate_plan(g, pipeline(g, 4, microbatches=8), topo)
    ofob = simulate_plan(g, pipeline(g, 4, microbatches=8, schedule="1f1b"), topo)
    assert gp.iteration_time < mp.iteration_time
    assert max(ofob.peak_memory_bytes) < max(gp.peak_memory_bytes)


def test_memory_counts_weights_grads_state_and_activations():
    g = traced("mlp")
    params = sum(w.spec.nbytes for n in g for w in n.weights)
    # the peak at the second ReLU's forward: every output so far but the first linear's, which
    # no backward reads (a ReLU's reads its output) and is let go after the first ReLU; the
    # logits and the loss come after the second linear's is let go too
    acts = sum(g[n].output.nbytes for n in ("inputs", "targets", "layers_1", "layers_2", "layers_3"))
    one = simulate_plan(g, data_parallel(g, 1), mesh(1))
    assert one.peak_memory_bytes == (3 * params + acts,)
    adam = simulate_plan(g, data_parallel(g, 1), mesh(1), optimizer="adam")
    assert adam.peak_memory_bytes == (4 * params + acts,)
    small = simulate_plan(g, data_parallel(g, 1), mesh(1, memory=3 * params))
    assert not small.fits and one.fits


def test_memory_counts_receive_buffers_posted_a_micro_batch_ahead():
    """Two stages, 2 micro-batches: stage 1 receives layers_1's output (512 B / 2) and the
    targets (32 B / 2) per micro-batch, stage 0 their gradient (layers_1's only: targets need
    none). Stage 0 holds the gradient buffers of 2 micro-batches; under 1F1B stage 1 warms up
    1 < 2 micro-batches and holds the next one's forward buffers too."""
    g = traced("mlp")
    w = {d: sum(x.spec.nbytes for n in g if n.name in ops for x in n.weights)
         for d, ops in {0: ("layers_0",), 1: ("layers_2", "layers_4")}.items()}
    # kept per micro-batch: each stage's ReLU output, not the linear's before it (read by no
    # backward, ``strategies.saved``), which is alive at the ReLU's forward: each stage's peak
    received1 = 512 // 2 + 32 // 2
    kept0, kept1 = (256 + 32 + 512) // 2, (512 + 160) // 2 + 8 + received1
    acts0 = 2 * kept0 + 512 // 2
    rise1 = 3 * (512 // 2)  # layers_1's piece received, layers_2's and layers_3's outputs
    gp = simulate_plan(g, pipeline(g, 2, microbatches=2), mesh(2))
    assert gp.peak_memory_bytes == (3 * w[0] + acts0 + 2 * (512 // 2), 3 * w[1] + kept1 + rise1)
    ofob = simulate_plan(g, pipeline(g, 2, microbatches=2, schedule="1f1b"), mesh(2))
    assert ofob.peak_memory_bytes == (3 * w[0] + acts0 + 2 * (512 // 2), 3 * w[1] + rise1 + received1)


@pytest.mark.parametrize("plan_name", ["owt", "model_parallel", "param", "loss_across"])
def test_exchanged_pieces_cost_the_exchange_overhead(plan_name):
    """A piece whose op moves another piece back between the same two devices in the same
    micro-batch (each unit of OWT's or a tensor-parallel op's all-to-all) costs the receiver
    ``exchange_overhead`` instead of ``message_overhead``; its gradient, where it moves (not
    the targets'), likewise on the producer's device when a gradient moves the other way too:
    busy time grows by x per exchanged piece and r per other one. ``loss_across``: the logits
    go 0 -> 1 and a targets piece 1 -> 0, so the logits are exchanged forward, not backward."""
    g = traced("mlp")
    if plan_name == "param":  # every linear cut on out_features, the rest on the batch: all exchanged
        plan = Strategy.of({n.name: ParallelConfig(tuple(2 if i == (len(n.output.shape) - 1 if n.kind == "linear" else 0)
                                                         else 1 for i in range(len(n.dims))), (0, 1)) for n in g}, 2)
    elif plan_name == "loss_across":
        last, targets = [n for n in g if n.kind == "linear"][-1], [n for n in g if n.kind == "input"][-1]
        plan = data_parallel(g, 2).replace(last.name, ParallelConfig((1,) * len(last.dims), (0,)))
        plan = plan.replace(targets.name, ParallelConfig((2,) + (1,) * (len(targets.dims) - 1), (1, 0)))
    else:
        plan = baseline(plan_name, g, 2)
    base, r, x = mesh(2), 5e-5, 7e-4
    loaded_topo = Topology(base.name, tuple(dataclasses.replace(d, message_overhead=r, exchange_overhead=x)
                                            for d in base.devices), base.links, base.routes)
    remote = [t for t in lower(g, plan).transfers if not t.local]
    pairs = {(t.dst_op, t.microbatch, t.src_device, t.dst_device) for t in remote}
    grads = {(t.dst_op, t.microbatch, t.src_device, t.dst_device) for t in remote if g.moves_grad(t.src_op, t.dst_op)}
    grows = [0.0, 0.0]
    for t in remote:
        back = (t.dst_op, t.microbatch, t.dst_device, t.src_device)
        grows[t.dst_device] += x if back in pairs else r
        if g.moves_grad(t.src_op, t.dst_op):
            grows[t.src_device] += x if back in grads else r
    plain = simulate_plan(g, plan, base, Perfect())
    loaded = simulate_plan(g, plan, loaded_topo, Perfect())
    for d in range(2):
        assert loaded.busy_time[d] - plain.busy_time[d] == pytest.approx(grows[d], rel=1e-9)
    # the targets' pieces: no gradient back (owt and param all-gather the targets with their
    # linears' inputs instead, strategies.collectives, and move only the logits point to point)
    assert any(not g.moves_grad(t.src_op, t.dst_op) for t in remote) == (plan_name not in ("owt", "param"))
    exchanged = sum(1 for t in remote if (t.dst_op, t.microbatch, t.dst_device, t.src_device) in pairs)
    assert (exchanged > 0) == (plan_name != "model_parallel")
    if plan_name == "loss_across":  # the logits: exchanged forward, their gradient back a message
        logits = [t for t in remote if g[t.dst_op].kind == "loss" and g.moves_grad(t.src_op, t.dst_op)]
        assert logits and all((t.dst_op, t.microbatch, t.dst_device, t.src_device) in pairs for t in logits)
        assert not any((t.dst_op, t.microbatch, t.dst_device, t.src_device) in grads for t in logits)
    if plan_name == "param":
        assert exchanged == len(remote)


def test_chrome_trace_has_a_lane_per_device_and_link(tmp_path):
    g = traced("alexnet")
    result = simulate_plan(g, baseline("owt", g, 2), "p100-1x2", timeline=True)
    tr = result.chrome_trace()
    json.dumps(tr)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(1 for _ in result.timeline) and {e["pid"] for e in xs} == {0, 1}
    lanes = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert "compute" in lanes and any(l.startswith("nvlink") for l in lanes)
    # ts and dur are each rounded to the nanosecond
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(result.iteration_time * 1e6, abs=1e-3)


def test_host_overheads_add_to_busy_time_exactly():
    """task_overhead o: each device's busy time grows by o per forward of a non-weight op and
    per backward of an op carrying a gradient and per trainable tensor its optimizer update
    steps; message_overhead r: by r per piece it receives (a forward piece on the consumer's
    device, its gradient on the producer's where the gradient moves)."""
    g = traced("mlp")
    plan = model_parallel(g, 2)
    base, o, r = mesh(2), 3e-4, 5e-5

    def with_overheads(topo, task, message):
        devices = tuple(DeviceSpec(d.kind, d.memory_bytes, dict(d.peak_flops), d.memory_bandwidth, d.node,
                                   task_overhead=task, message_overhead=message) for d in topo.devices)
        return Topology(topo.name, devices, topo.links, topo.routes)

    lowered = lower(g, plan)
    runs = {n.name for n in g if n.kind not in ("parameter", "constant")}
    tasks = [0, 0]
    for op, per_mb in lowered.partitions.items():
        for p in per_mb[0]:
            tasks[p.device] += (op in runs) + (op in runs and g.needs_grad[op])
    for d in range(2):
        tasks[d] += len({s.name for s in lowered.weight_shards if s.trainable and d in s.devices})
    received = [0, 0]
    for t in lowered.transfers:
        if not t.local:
            received[t.dst_device] += 1
            received[t.src_device] += g.moves_grad(t.src_op, t.dst_op)  # the executor's rule
    assert min(received) > 0 and min(tasks) > 0
    plain = simulate_plan(g, plan, base, Perfect())
    loaded = simulate_plan(g, plan, with_overheads(base, o, r), Perfect())
    for d in range(2):
        assert loaded.busy_time[d] - plain.busy_time[d] == pytest.approx(tasks[d] * o + received[d] * r, rel=1e-9)
    assert loaded.iteration_time > plain.iteration_time
