"""The flash kernel at FlashAttention-2's published rates (``simulator.attention_efficiency``):
the curve reads the figure's bars, the cost model charges the work the kernel does (the causal
mask's half, a backward of 2.5 forwards) at the curve's rate on the a100 and h100 presets, and a
longer sequence runs at a higher rate."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from simulator.attention_efficiency import (A100_FLASH, FLASH_BACKWARD, FLASH_RATES, FlashRates, causal_fraction,
                                            flash_rate)
from simulator.cost import COMPUTE_EFFICIENCY, GPU_LAUNCH_OVERHEAD, AnalyticalCostModel, partition_flops
from simulator.presets import get_topology
from soapsearch.trace import trace
from strategies.region import full_box

A100 = get_topology("a100-1x8").devices[0]
H100 = get_topology("h100-1x8").devices[0]


class Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def attention_op(seq: int, head_dim: int = 128, causal: bool = True, dtype=torch.bfloat16):
    with torch.device("meta"):
        x = torch.zeros(1, 16, seq, head_dim, dtype=dtype)
    return next(n for n in trace(Attention(causal), (x, x, x)) if n.kind == "attention")


def test_the_curve_reads_the_published_bars():
    # Dao 2023 Figure 4 (d): causal, head dim 128 on an A100: 173 TFLOP/s at 4k, 182 at 8k
    assert flash_rate("A100-SXM4-80GB", "bfloat16", 4096, 128, True) == 173e12
    assert flash_rate("A100-SXM4-80GB", "float16", 8192, 128, True) == 182e12
    assert flash_rate("A100-SXM4-80GB", "bfloat16", 2048, 64, False) == 162e12
    assert flash_rate("H100-SXM5-80GB", "bfloat16", 16384, 128, True) == 328e12
    # between the bars: linear in log2(keys) and in head dim; past them: the end bars
    assert flash_rate("A100-SXM4-80GB", "bfloat16", round(4096 * math.sqrt(2)), 128, True) == pytest.approx(
        177.5e12, rel=1e-4)
    assert flash_rate("A100-SXM4-80GB", "bfloat16", 4096, 96, True) == pytest.approx((156 + 173) / 2 * 1e12)
    assert flash_rate("A100-SXM4-80GB", "bfloat16", 128, 128, True) == 99e12
    assert flash_rate("A100-SXM4-80GB", "bfloat16", 65536, 256, False) == 203e12
    # no curve: a kind without one, a dtype the kernel does not run in
    assert flash_rate("A100", "bfloat16", 4096, 128, True) is None
    assert flash_rate("A100-SXM4-80GB", "float32", 4096, 128, True) is None
    assert {A100.kind, H100.kind} <= set(FLASH_RATES)  # the presets' devices have curves
    for curve in FLASH_RATES.values():  # every panel rises with the sequence
        assert all(list(r) == sorted(r) for r in curve.rates.values()), curve.kind


def test_a_curve_needs_every_panel():
    rates = dict(A100_FLASH.rates)
    del rates[(True, 64)]
    with pytest.raises(ValueError, match=r"FlashRates 'x': rates need the panels .* each 6 figures > 0"):
        FlashRates("x", "nowhere", rates)


@pytest.mark.parametrize("rows,keys,all_keys", [((0, 8), (0, 8), 8), ((3, 8), (0, 8), 8), ((2, 5), (0, 5), 8),
                                                ((0, 8), (2, 6), 8), ((5, 7), (1, 3), 8), ((0, 3), (4, 8), 8)])
def test_causal_fraction_counts_the_pairs_the_mask_leaves(rows, keys, all_keys):
    seen = sum(1 for i in range(*rows) for j in range(*keys) if j <= i)
    assert causal_fraction(rows, keys, all_keys) == pytest.approx(seen / ((rows[1] - rows[0]) * all_keys))


@pytest.mark.parametrize("device", [A100, H100], ids=lambda d: d.kind)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_charges_the_kernels_work_at_the_published_rate(device, causal):
    """16 heads of 8,192 queries at head dim 128 in bf16: forward the op's FLOPs (4·h·s²·d) times
    the share the causal mask leaves, (s + 1) / 2s, at the published rate; backward 2.5 times
    that; one kernel each way."""
    seq = 8192
    op = attention_op(seq, causal=causal)
    box = full_box(op.shape)
    flops = partition_flops(op, box)
    assert flops == 4 * 16 * seq * seq * 128
    work = flops * ((seq + 1) / (2 * seq) if causal else 1)
    rate = flash_rate(device.kind, "bfloat16", seq, 128, causal)
    fwd, bwd = AnalyticalCostModel().op_time(op, box, device)
    assert fwd == pytest.approx(work / rate + GPU_LAUNCH_OVERHEAD)
    assert bwd == pytest.approx(FLASH_BACKWARD * work / rate + GPU_LAUNCH_OVERHEAD)


def test_a_longer_sequence_runs_at_a_higher_rate():
    """Per FLOP, LLaMA-3's 8,192 keys run 173/182 of the time of LLaMA-2's 4,096 (Figure 4 (d))."""
    model = AnalyticalCostModel(launch_overhead=0.0)
    per_flop = {}
    for seq in (4096, 8192):
        op = attention_op(seq)
        box = full_box(op.shape)
        per_flop[seq] = sum(model.op_time(op, box, A100)) / partition_flops(op, box)
    assert per_flop[8192] / per_flop[4096] == pytest.approx(173 / 182 * (8193 / 8192) / (4097 / 4096), rel=1e-9)


def test_a_query_slice_of_a_causal_op_does_the_work_below_the_diagonal():
    """Queries [2048, 4096) of 4,096 read keys [0, 4096): 3/4 of the op's pairs lie below the
    diagonal in that slice, at the rate of 4,096 keys."""
    op = attention_op(4096)
    box = full_box(op.shape)[:2] + ((2048, 4096), (0, 128))
    fwd, _ = AnalyticalCostModel(launch_overhead=0.0).op_time(op, box, A100)
    pairs = sum(i + 1 for i in range(2048, 4096))
    assert fwd == pytest.approx(partition_flops(op, box) * pairs / (2048 * 4096) / 173e12)


def test_float32_and_other_kinds_keep_the_roofline():
    """No curve (a float32 op on the a100 preset): the constant efficiency, backward twice the
    forward's FLOPs, as before."""
    op = attention_op(4096, dtype=torch.float32)
    box = full_box(op.shape)
    flops = partition_flops(op, box)
    fwd, bwd = AnalyticalCostModel(launch_overhead=0.0).op_time(op, box, A100)
    assert fwd == pytest.approx(flops / (COMPUTE_EFFICIENCY * A100.flops_for("float32")))
    assert bwd == pytest.approx(2 * fwd)
