"""The peak's breakdown by category (simulator.memory.memory_breakdown): each category counted
by hand on plans of known shapes, and the categories summing to ``peak_memory``'s figure."""

import pytest

from simulator.memory import MemoryBreakdown, activation_peaks, memory_breakdown, peak_memory
from simulator.memory_walks import _rises
from simulator.memory_collectives import collective_rows
from simulator.simulate import simulate_plan
from strategies import baseline, data_parallel, pipeline
from strategies.lowering import lower
from tests.conftest import traced
from tests.simulator.test_simulate import mesh

MLP_PARAMS = 4 * (32 * 16 + 32 + 32 * 32 + 32 + 10 * 32 + 10)  # the tiny mlp's weights and biases, float32


def test_data_parallel_mlp_with_adam_by_hand():
    """Each of 2 devices holds every weight (7720 B), its gradient and Adam's two moments, and
    per micro-batch half of each output its backward or a consumer's reads (``strategies.saved``):
    inputs 256, targets 32, the two ReLUs' 512 B outputs (ReLU's backward reads its output, a
    linear's its input), the logits 160 (the loss reads them), plus the loss's 8 B; the two
    hidden linears' outputs are read by no backward, let go after the ReLU's forward: the peak
    is at the second ReLU's forward, its linear's output still alive, before the logits and the
    loss (744 kept, 912 at the peak); nothing is received or gathered. The one gradient bucket
    (every weight, 7720 B) is packed into its flat tensor after the first linear's backward and
    held to the step's sync (``strategies.collective_buffers.bucket_buffers``): by then only the
    inputs and targets (144 B) are still held, so the peak is there, 7864 B, 6952 over the
    activations'."""
    g = traced("mlp")
    assert sum(w.spec.nbytes for n in g for w in n.weights) == MLP_PARAMS
    acts = (256 + 32 + 2 * 512) // 2 + 512 // 2
    assert lower(g, data_parallel(g, 2)).device_bytes.kept == ((256 + 32 + 2 * 512 + 160) // 2 + 8,) * 2
    want = MemoryBreakdown(weights=MLP_PARAMS, gradients=MLP_PARAMS, optimizer_state=2 * MLP_PARAMS,
                           activations=acts, receive_buffers=0, collective_buffers=0,
                           gradient_buckets=MLP_PARAMS + (256 + 32) // 2 - acts)
    lowered = lower(g, data_parallel(g, 2))
    assert memory_breakdown(lowered, "adam") == [want, want]
    assert peak_memory(lowered, "adam") == [want.total] * 2 == [5 * MLP_PARAMS + (256 + 32) // 2] * 2
    sgd = memory_breakdown(lowered, "sgd")[0]
    assert sgd.optimizer_state == MLP_PARAMS and sgd._replace(optimizer_state=2 * MLP_PARAMS) == want
    assert want.largest(2) == [("optimizer_state", 2 * MLP_PARAMS), ("weights", MLP_PARAMS)]
    result = simulate_plan(g, lowered, mesh(2), optimizer="adam")
    assert result.memory == (want, want) and result.peak_breakdown == want
    assert result.to_json()["peak_memory"] == {"device": 0, "bytes": want.total, "breakdown": {
        "weights": MLP_PARAMS, "gradients": MLP_PARAMS, "optimizer_state": 2 * MLP_PARAMS,
        "activations": acts, "receive_buffers": 0, "collective_buffers": 0, "master_weights": 0,
        "gathered_weights": 0, "gradient_buckets": want.gradient_buckets}}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_receive_buffers_by_hand(schedule):
    """Two stages, 2 micro-batches (as test_simulate's receive-buffer test): stage 1 receives
    layers_1's output and the targets per micro-batch (kept for backward: activations), stage 0
    posts 2 micro-batches' gradient buffers of layers_1; under 1F1B stage 1 has 1 micro-batch
    in flight and posts the next one's forward pieces. Each stage keeps K per micro-batch (its
    ReLU's output, not the linear's before it: ``strategies.saved``) and peaks at the last
    forward's ReLU, the linear's output still alive (stage 1 before its logits and loss)."""
    g = traced("mlp")
    w0 = 4 * (32 * 16 + 32)
    w1 = MLP_PARAMS - w0
    received1 = 512 // 2 + 32 // 2
    kept0 = (256 + 32 + 512) // 2
    kept1 = (512 + 160) // 2 + 8 + received1
    in_flight1 = 2 if schedule == "gpipe" else 1
    got = memory_breakdown(lower(g, pipeline(g, 2, microbatches=2, schedule=schedule)), "sgd")
    assert got[0] == MemoryBreakdown(w0, w0, w0, 2 * kept0 + 512 // 2, 2 * (512 // 2), 0)
    rise1 = 3 * (512 // 2)  # at the ReLU: layers_1's piece received, the linear's output and the ReLU's
    assert got[1] == MemoryBreakdown(w1, w1, w1, (in_flight1 - 1) * kept1 + rise1,
                                     0 if schedule == "gpipe" else received1, 0)


def test_megatron_sequence_parallel_has_collective_buffers():
    """A sequence-parallel megatron plan (T = 2, 4 devices, one micro-batch) all-gathers the
    column linears' inputs and reduce-scatters the row linears' sums. By hand, per member: the
    batch's indices and the cross-entropy's targets (128 bytes each) are kept, K = 256; the five
    layer-norm outputs all-gathered (1,024 each: two blocks' ln_1 and ln_2, and ln_f) are read by
    linears only, which keep the shard and gather again in the backward (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``), so each is let go after its last
    reader's forward, as a reduce-scatter's chunk (512) read by a dropout only: r_f = 128 (the
    indices) + 1,024 (one gathered output while its readers run). In the backward the attention's
    all-gather comes again at its last reader's (v's) backward (1,024) with q, k and v's input
    gradients (3 × 1,024) until ln_1's backward, the targets (128) freed by the cross-entropy's
    backward first: r_b = 4,096 − 128 = 3,968. So the walk's collective rows peak at K + r_b, and
    the breakdown's category is what they add to the activations' walk."""
    g = traced("gpt")
    lowered = lower(g, baseline("megatron", g, 4, None, 2, 1, True))
    held, freed, redone, gone = collective_rows(lowered, {n.name: i for i, n in enumerate(g)}, 4)
    assert (held.sum(axis=0) - freed.sum(axis=0)).tolist() == [128 * 2] * 4
    # the embedding's sum and 4 blocks' row linears; the five gathered layer-norm outputs
    assert freed.sum(axis=0).tolist() == [5 * 512 + 5 * 1024] * 4
    rise_f, rise_b = _rises(held, freed, redone, gone)
    assert rise_f.tolist() == [128 + 1024] * 4 and rise_b.tolist() == [1024 + 3 * 1024 - 128] * 4
    got = memory_breakdown(lowered, "adam")
    without = activation_peaks(lowered, collectives=False)
    assert [b.activations for b in got] == without
    assert [b.collective_buffers for b in got] == [a - b for a, b in zip(activation_peaks(lowered), without)]
    assert all(b.collective_buffers > 0 for b in got)
    assert [b.total for b in got] == peak_memory(lowered, "adam")


def test_describe_names_the_peak_and_its_largest_categories():
    b = MemoryBreakdown(weights=2**30, gradients=2**30, optimizer_state=2**31, activations=3 * 2**30,
                        receive_buffers=0, collective_buffers=2**20)
    assert b.describe() == "peak 7 GiB: activations 3, optimizer state 2, weights 1 GiB"
    assert MemoryBreakdown(0, 0, 0, 3 * 2**20, 2**19, 0).describe(1) == "peak 3.5 MiB: activations 3 MiB"
    assert MemoryBreakdown(0, 0, 0, 0, 0, 0).describe() == "peak 0 KiB"
