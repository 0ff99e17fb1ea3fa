"""The task graph charges what the executor runs, on tiny graphs timed by hand: each small sum by
what waits on it (forward statistics, a loss's sum gating its backward or only the step), the
loss value's all-reduce when not every device knows it, the optimizer update's host work per
tensor, the blocking collectives inside a device's steps, and each collective's host work on
every member device.

Every test: 2 devices, a direct link each way with alpha = 2 ms and B = 40 kB/s (so 4 bytes
take 0.1 ms), compute a fixed time per op kind (``Fixed``), in milliseconds below."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from simulator.cost import CostModel
from simulator.devices import DeviceSpec, Link
from simulator.engine import run_events
from simulator.tasks import TaskKind, build_tasks
from simulator.topology import Topology
from soapsearch import trace
from strategies import ParallelConfig, Strategy, data_parallel
from strategies.lowering import Gate, lower

MS = 1e-3
ALPHA, B = 2 * MS, 40e3


class Fixed(CostModel):
    """(forward, backward) ms by op kind; inputs, views and adds are free."""

    TIMES = {"linear": (1.0, 0.5), "batchnorm2d": (1.0, 1.0), "loss": (0.5, 0.5)}

    def _op_time(self, node, box, regions, weight_regions, device):
        f, b = self.TIMES.get(node.kind, (0.0, 0.0))
        return f * MS, b * MS


def pair(memory_bandwidth, task_overhead=0.0, collective_overhead=0.0):
    dev = DeviceSpec("test", 1 << 40, {"float32": 1e12}, memory_bandwidth, task_overhead=task_overhead,
                     collective_overhead=collective_overhead)
    links = (Link("l0->1", "test", ALPHA, B), Link("l1->0", "test", ALPHA, B))
    return Topology("pair", (dev, dev), links, {(0, 1): (0,), (1, 0): (1,)})


class Linear(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.fc, self.loss = nn.Linear(4, 2), loss

    def forward(self, x, y):
        return self.loss(self.fc(x), y)


def mse_sum(out, y):
    return F.mse_loss(out, y, reduction="sum")


def regression():
    return trace(Linear(mse_sum), (torch.randn(4, 4), torch.randn(4, 2)))


def classifier():
    return trace(Linear(F.cross_entropy), (torch.randn(4, 4), torch.randint(0, 2, (4,))))


class Norm(nn.Module):
    """bn, then lin (not reading bn: it runs while bn's statistics are gathered only if the
    gather did not block), then fc over the normalized input; a sum MSE."""

    def __init__(self):
        super().__init__()
        self.bn, self.lin, self.fc = nn.BatchNorm2d(3), nn.Linear(2, 2), nn.Linear(12, 2)

    def forward(self, x, y, t):
        h = self.bn(x)
        z = self.lin(y)
        return F.mse_loss(self.fc(torch.flatten(h, 1)) + z, t, reduction="sum")


def simulate(graph, plan, topo):
    tg = build_tasks(lower(graph, plan), topo, Fixed())
    start, end = run_events(tg)
    return tg, start, end


def find(tg, prefix):
    return [t for t in range(len(tg)) if tg.label(t).startswith(prefix)]


def test_what_each_member_sends():
    # batch statistics of C = 3 channels in float32: forward mean, var (3 each) and the count,
    # 7 floats; backward Σdy and Σdy·x̂, 6 floats. A sum MSE: one float; a mean cross-entropy:
    # [s_p, c_p], two; neither sums anything backward.
    x, y, t = torch.randn(4, 3, 2, 2), torch.randn(4, 2), torch.randn(4, 2)
    norm = trace(Norm(), (x, y, t))
    sums = {(r.name, r.gates, r.nbytes, r.grad_nbytes) for r in lower(norm, data_parallel(norm, 2)).reductions}
    assert sums == {("batch_stats", Gate.FORWARD, 28, 24), ("loss_sum", Gate.STEP, 4, 0)}
    ce = classifier()
    two = data_parallel(ce, 2).with_microbatches(2, "gpipe")
    assert {(r.gates, r.nbytes, r.grad_nbytes) for r in lower(ce, two).reductions} == {(Gate.BACKWARD, 8, 0)}


def test_a_loss_sum_only_the_step_waits_on_rides_the_gradient_bucket():
    # data parallel, sum MSE (a static divisor): the loss sum travels in the gradient bucket of
    # its devices (strategies.lowering.bucket_sums), no collective of its own. Backward: loss
    # 1.5-2.0, fc 2.0-2.5; the bucket (40 B of gradients + 4 B of loss) packed into one tensor
    # (2 · 44 B / 200 kB/s = 0.44) 2.5-2.94, all-reduced (44/B + 2·alpha = 5.1) 2.94-8.04, the
    # gradients copied back (2 · 40 B / 200 kB/s = 0.4) 8.04-8.44; the update (5 · 40 B /
    # 200 kB/s = 1) 8.44-9.44.
    g = regression()
    tg, start, end = simulate(g, data_parallel(g, 2), pair(200e3))
    assert not [t for t in range(len(tg)) if tg.category[t] == TaskKind.REDUCE]
    [ar] = find(tg, "allreduce bucket")
    assert tg.nbytes[ar] == 44 and (start[ar], end[ar]) == pytest.approx((2.94 * MS, 8.04 * MS), rel=1e-9)
    for d in (0, 1):
        [pack], [unpack] = find(tg, f"pack allreduce bucket 0-1 device {d}"), find(tg, f"unpack allreduce bucket 0-1 device {d}")
        assert (start[pack], end[pack], start[unpack], end[unpack]) == pytest.approx(
            (2.5 * MS, 2.94 * MS, 8.04 * MS, 8.44 * MS), rel=1e-9)
        assert tg.resources[pack] == tg.resources[unpack] == (d,)
    assert max(end) == pytest.approx(9.44 * MS, rel=1e-9)
    # mean cross-entropy (C needs the data): [s_p, c_p] ride, 48 B: packed 2.5-2.98, all-reduced
    # 2.98-8.18, copied back 8.18-8.58, update 8.58-9.58
    g = classifier()
    tg, start, end = simulate(g, data_parallel(g, 2), pair(200e3))
    [ar] = find(tg, "allreduce bucket")
    assert tg.nbytes[ar] == 48 and (start[ar], end[ar]) == pytest.approx((2.98 * MS, 8.18 * MS), rel=1e-9)
    assert max(end) == pytest.approx(9.58 * MS, rel=1e-9)


def test_a_loss_sum_with_no_bucket_is_its_own_collective_the_gradients_wait_on():
    # fc whole on device 0 (no replicated weight: no bucket), the mean cross-entropy split on
    # the batch over both devices: its sum is an all-gather of its own, which device 0's update
    # waits on (it divides its gradients by C first). fc 0-1; rows 2-4 of its output (16 B:
    # alpha + 0.4 = 2.4) to device 1, 1-3.4; loss on device 0 1-1.5, on device 1 3.4-3.9. The sum
    # (8 B: alpha + 0.2 = 2.2) 3.9-6.1 on both links. Backward: loss on 0 1.5-2.0, on 1 3.9-4.4;
    # its gradient back to device 0 waits for the link the sum holds: 6.1-8.5; fc 8.5-9.0;
    # device 0's update 9.0-10.0.
    g = classifier()
    plan = data_parallel(g, 2)
    for n in g:
        if n.kind not in ("loss",) and n.name != "y":
            plan = plan.replace(n.name, ParallelConfig((1,) * len(n.dims), (0,)))
    tg, start, end = simulate(g, plan, pair(200e3))
    sends = [(tg.label(t), start[t], end[t]) for t in find(tg, "send")]
    assert sends == [("send fc[0]->cross_entropy[1]@mb0", pytest.approx(1.0 * MS), pytest.approx(3.4 * MS)),
                     ("send-grad fc[0]->cross_entropy[1]@mb0", pytest.approx(6.1 * MS), pytest.approx(8.5 * MS))]
    [r] = [t for t in range(len(tg)) if tg.category[t] == TaskKind.REDUCE]
    assert (start[r], end[r]) == pytest.approx((3.9 * MS, 6.1 * MS), rel=1e-9)
    assert {tg.category[u] for u in tg.successors(r)} == {TaskKind.UPDATE}
    assert not find(tg, "allreduce bucket") and not find(tg, "reduce-grad")
    assert max(end) == pytest.approx(10.0 * MS, rel=1e-9)


def test_a_loss_sum_the_backward_waits_on():
    # mean cross-entropy, 2 micro-batches (GPipe): the sum of micro-batch j (2 floats: alpha +
    # 0.2 = 2.2) gates the loss backward of j. F0: fc 0-1, loss 1-1.5; F1: fc 1.5-2.5, loss
    # 2.5-3.0. Sum 0: 1.5-3.7; sum 1 waits for the links: 3.7-5.9. B0: loss 3.7-4.2, fc
    # 4.2-4.7; B1: loss 5.9-6.4, fc 6.4-6.9. Bucket (40 B) packed 6.9-7.3, all-reduced 7.3-12.3,
    # copied back 12.3-12.7; update 12.7-13.7.
    g = classifier()
    tg, start, end = simulate(g, data_parallel(g, 2).with_microbatches(2, "gpipe"), pair(200e3))
    sums = sorted((t for t in range(len(tg)) if tg.category[t] == TaskKind.REDUCE), key=lambda t: start[t])
    assert [x for t in sums for x in (start[t], end[t])] == pytest.approx([1.5 * MS, 3.7 * MS, 3.7 * MS, 5.9 * MS],
                                                                         rel=1e-9)
    assert not find(tg, "reduce-grad")
    assert sorted(start[t] for t in find(tg, "bwd cross_entropy")) == pytest.approx(
        [3.7 * MS] * 2 + [5.9 * MS] * 2, rel=1e-9)
    assert max(end) == pytest.approx(13.7 * MS, rel=1e-9)


def test_batch_statistics_gather_forward_and_sum_backward_and_block_the_device():
    # data parallel. bn 0-1; its statistics gathered (28 B: alpha + 0.7 = 2.7) 1-3.7, during
    # which the device waits: lin 3.7-4.7 (not 1-2); fc 4.7-5.7, loss 5.7-6.2. Backward: loss
    # 6.2-6.7, fc 6.7-7.2, lin 7.2-7.7, bn 7.7-8.7; its gradient sum (24 B, 2.6) 8.7-11.3.
    # Bucket: 38 floats, 152 B, and the loss sum's 4 B riding it: packed (2 · 156 B / 760 kB/s
    # = 0.41) 11.3-11.71, all-reduced (3.9 + 2·alpha = 7.9) 11.71-19.61, copied back (2 · 152 B
    # / 760 kB/s = 0.4) 19.61-20.01; update (5 · 152 B / 760 kB/s = 1) 20.01-21.01.
    x, y, t = torch.randn(4, 3, 2, 2), torch.randn(4, 2), torch.randn(4, 2)
    g = trace(Norm(), (x, y, t))
    tg, start, end = simulate(g, data_parallel(g, 2), pair(760e3))
    [fwd_sum] = find(tg, "reduce batch_stats")
    [bwd_sum] = find(tg, "reduce-grad batch_stats")
    assert (start[fwd_sum], end[fwd_sum]) == pytest.approx((1 * MS, 3.7 * MS), rel=1e-9)
    assert (start[bwd_sum], end[bwd_sum]) == pytest.approx((8.7 * MS, 11.3 * MS), rel=1e-9)
    assert tg.nbytes[fwd_sum] == 28 and tg.nbytes[bwd_sum] == 24
    assert [start[t] for t in find(tg, "fwd lin")] == pytest.approx([3.7 * MS] * 2, rel=1e-9)
    pack = 2 * 156 / 760e3
    assert max(end) == pytest.approx(20.6 * MS + pack, rel=1e-9)


def test_the_loss_value_is_all_reduced_when_one_device_holds_the_loss():
    # fc on device 0, the loss on device 1. fc 0-1; its output (32 B: alpha + 0.8 = 2.8) 1-3.8;
    # loss 3.8-4.3 and 4.3-4.8; its gradient 4.8-7.6; fc backward 7.6-8.1. Then the loss value
    # (8 B over both devices: 8/B + 2·alpha = 4.2) 8.1-12.3, overlapping device 0's update (1)
    # 8.1-9.1, which does not read it: the step ends with the all-reduce. Device 1 holds no
    # trainable weight: no update.
    g = regression()
    on1 = {"y", "mse_loss"}
    plan = Strategy.of({n.name: ParallelConfig((1,) * len(n.dims), (int(n.name in on1),)) for n in g}, 2)
    tg, start, end = simulate(g, plan, pair(200e3))
    [rep] = find(tg, "allreduce loss")
    assert tg.nbytes[rep] == 8 and (start[rep], end[rep]) == pytest.approx((8.1 * MS, 12.3 * MS), rel=1e-9)
    [u] = [t for t in range(len(tg)) if tg.category[t] == TaskKind.UPDATE]
    assert tg.device[u] == 0 and (start[u], end[u]) == pytest.approx((8.1 * MS, 9.1 * MS), rel=1e-9)
    assert max(end) == pytest.approx(12.3 * MS, rel=1e-9)
    # with 2 ms of host work per collective: device 0's lands after its update, 12.3-14.3
    tg, start, end = simulate(g, plan, pair(200e3, collective_overhead=2 * MS))
    host = {tg.device[t]: (start[t], end[t]) for t in find(tg, "allreduce loss host")}
    assert host == {0: pytest.approx((12.3 * MS, 14.3 * MS), rel=1e-9), 1: pytest.approx((12.3 * MS, 14.3 * MS), rel=1e-9)}
    [u] = [t for t in range(len(tg)) if tg.category[t] == TaskKind.UPDATE]
    assert end[u] == pytest.approx(9.1 * MS, rel=1e-9) and max(end) == pytest.approx(14.3 * MS, rel=1e-9)
    # on every device (data parallel) the loss is known everywhere: no such all-reduce
    assert not find(simulate(g, data_parallel(g, 2), pair(200e3))[0], "allreduce loss")


def test_the_update_charges_host_work_per_trainable_tensor():
    # each device holds fc.weight and fc.bias (40 B): 5 · 40 B / 200 kB/s + 2 · 0.3 ms = 1.6 ms
    g = regression()
    tg = build_tasks(lower(g, data_parallel(g, 2)), pair(200e3, task_overhead=0.3 * MS), Fixed())
    updates = [t for t in range(len(tg)) if tg.category[t] == TaskKind.UPDATE]
    assert [tg.duration[t] for t in updates] == pytest.approx([1.6 * MS] * 2, rel=1e-9)


def test_every_collective_costs_each_member_its_collective_overhead_after_it():
    # as the classifier of test_a_loss_sum_only_the_step_waits_on_rides_the_gradient_bucket,
    # each collective followed by 0.4 ms on each member device: the bucket (the loss sum in it)
    # packed 2.5-2.98, all-reduced 2.98-8.18, its host work 8.18-8.58 on each device, copied
    # back 8.58-8.98; the update 8.98-9.98.
    g = classifier()
    tg, start, end = simulate(g, data_parallel(g, 2), pair(200e3, collective_overhead=0.4 * MS))
    host = sorted((start[t], tg.device[t], t) for t in find(tg, "") if "host" in tg.label(t))
    assert [x for _, _, t in host for x in (start[t], end[t])] == pytest.approx([8.18 * MS, 8.58 * MS] * 2, rel=1e-9)
    assert [(d, tg.category[t]) for _, d, t in host] == [(0, TaskKind.ALLREDUCE), (1, TaskKind.ALLREDUCE)]
    assert all(tg.resources[t] == (tg.device[t],) for t in find(tg, "") if "host" in tg.label(t))
    [ar] = [t for t in find(tg, "allreduce bucket") if "host" not in tg.label(t)]
    assert (start[ar], end[ar]) == pytest.approx((2.98 * MS, 8.18 * MS), rel=1e-9)
    assert max(end) == pytest.approx(9.98 * MS, rel=1e-9)


def test_collective_overhead_delays_what_waits_on_a_blocking_sum_on_its_device():
    # as test_batch_statistics_gather_forward_and_sum_backward_and_block_the_device, 0.4 ms per
    # collective per member. bn 0-1, gather 1-3.7, host 3.7-4.1; lin 4.1-5.1, fc 5.1-6.1, loss
    # 6.1-6.6. Backward: loss 6.6-7.1, fc 7.1-7.6, lin 7.6-8.1, bn 8.1-9.1; its gradient sum
    # 9.1-11.7, host 11.7-12.1. Bucket (the loss sum in it) packed 12.1-12.51, all-reduced
    # 12.51-20.41, host 20.41-20.81, copied back 20.81-21.21, update 21.21-22.21: each of the
    # three collectives' 0.4 ms on the critical path.
    x, y, t = torch.randn(4, 3, 2, 2), torch.randn(4, 2), torch.randn(4, 2)
    g = trace(Norm(), (x, y, t))
    tg, start, end = simulate(g, data_parallel(g, 2), pair(760e3, collective_overhead=0.4 * MS))
    assert [start[t] for t in find(tg, "fwd lin")] == pytest.approx([4.1 * MS] * 2, rel=1e-9)
    [bwd_sum] = [t for t in find(tg, "reduce-grad batch_stats") if "host" not in tg.label(t)]
    assert (start[bwd_sum], end[bwd_sum]) == pytest.approx((9.1 * MS, 11.7 * MS), rel=1e-9)
    [ar] = [t for t in find(tg, "allreduce bucket") if "host" not in tg.label(t)]
    pack = 2 * 156 / 760e3
    assert start[ar] == pytest.approx(12.1 * MS + pack, rel=1e-9)
    assert max(end) == pytest.approx(21.8 * MS + pack, rel=1e-9)
    assert sum(1 for t in range(len(tg)) if "host" in tg.label(t)) == 3 * 2


def test_a_class_cut_loss_charges_its_max_then_its_sums():
    # fc column-parallel and the mean cross-entropy cut on its 2 classes over both devices
    # (vocab-parallel: strategies.rules.cross_entropy). x and y are data parallel and read whole
    # by fc's and the loss's partitions: each is an all-gather over both devices (one ring step,
    # 32 B: alpha + 0.8 = 2.8; 16 B: 2.4), called where its first reader runs (a blocking
    # collective, ``strategies.schedule.collective_steps``): x 0-2.8, fc 2.8-3.8, y 3.8-6.2, the
    # loss 6.2-6.7. Then, per sample of the partition (4, float32): the max, an all-gather of
    # 16 B (2.4) 6.7-9.1; the sums [Σexp, z_t], 32 B (2.8) 9.1-11.9, which the loss's backward
    # waits on (11.9-12.4); the loss's [s_p, c_p] (8 B, 2.2) after them, 11.9-14.1; nothing
    # sums in backward.
    g = classifier()
    fc, loss = g["fc"], g["cross_entropy"]
    assert loss.dims[-1].name == "classes"
    plan = data_parallel(g, 2).replace(fc.name, ParallelConfig((1, 2, 1), (0, 1))) \
        .replace(loss.name, ParallelConfig((1, 2), (0, 1)))
    sums = {(r.name, r.gates, r.nbytes, r.grad_nbytes) for r in lower(g, plan).reductions}
    assert sums == {("class_max", Gate.FORWARD, 16, 0), ("class_sum", Gate.FORWARD, 32, 0),
                    ("loss_sum", Gate.STEP, 8, 0)}
    tg, start, end = simulate(g, plan, pair(200e3))
    want = {"all_gather x": (0, 2.8), "all_gather y": (3.8, 6.2), "reduce class_max": (6.7, 9.1),
            "reduce class_sum": (9.1, 11.9), "reduce loss_sum": (11.9, 14.1), "bwd cross_entropy[0]": (11.9, 12.4)}
    for name, (a, b) in want.items():
        [t] = find(tg, name)
        assert (start[t], end[t]) == pytest.approx((a * MS, b * MS), rel=1e-9), name
