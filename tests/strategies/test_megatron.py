"""The megatron baseline (strategies/megatron.py): the blocks it finds by structure, the cuts it
gives them, and the bytes one transformer layer moves against Megatron-LM's count (Narayanan et
al. 2021; Korthikanti et al. 2022): per layer and tensor-parallel group, 2 all-reduces of
b·s·h elements forward and 2 backward, which sequence parallelism moves as 2 all-gathers and
2 reduce-scatters each way: (t−1)·b·s·h elements over the t devices of a group for each
(a ring's (t−1)/t per member), 2(t−1)·b·s·h per all-reduce."""

import pytest

from strategies import PlanError, baseline
from strategies.graph import DTYPE_BYTES
from strategies.lowering import lower
from strategies.megatron import default_tp, megatron, megatron_blocks
from tests.conftest import traced


def test_blocks_are_found_by_structure():
    g = traced("gpt")
    blocks = megatron_blocks(g)
    assert [(cols, row) for cols, _, row in blocks] == [
        (("blocks_0_attn_q", "blocks_0_attn_k", "blocks_0_attn_v"), "blocks_0_attn_proj"),
        (("blocks_0_mlp_fc",), "blocks_0_mlp_proj"),
        (("blocks_1_attn_q", "blocks_1_attn_k", "blocks_1_attn_v"), "blocks_1_attn_proj"),
        (("blocks_1_mlp_fc",), "blocks_1_mlp_proj")]
    assert blocks[0][1][-3:] == ("scaled_dot_product_attention", "transpose_3", "view_3")
    assert blocks[1][1] == ("blocks_0_mlp_gelu",)
    assert default_tp(g, 8) == 2  # 2 heads


def test_cuts_column_row_heads_and_sequence():
    g = traced("gpt")  # batch 4, seq 8
    plan = megatron(g, 4, tp=2, sequence_parallel=True)
    show = {n.name: plan[n.name].show(n.dims) for n in g}
    assert show["blocks_0_attn_q"] == "S2·P2 @ 0-3" and show["blocks_0_mlp_fc"] == "S2·P2 @ 0-3"
    assert show["blocks_0_attn_proj"] == "S2·R2 @ 0-3" and show["blocks_0_mlp_proj"] == "S2·R2 @ 0-3"
    heads = g["scaled_dot_product_attention"].dims[1]
    assert heads.name == "heads" and plan["scaled_dot_product_attention"].degrees[:2] == (2, 2)
    assert plan["blocks_0_ln_1"].degrees == (2, 2, 1)  # sample × sequence
    assert show["wte"] == "S2·R2 @ 0-3"  # vocab-parallel embedding
    assert show["lm_head"] == "S2·P2 @ 0-3" and plan["view_8"].degrees == (2, 2)  # vocab-parallel head
    # without sequence parallelism the ops between the blocks are cut on the samples over the
    # tensor-parallel group instead; the blocks are the same
    plain = megatron(g, 4, tp=2)
    assert plain["blocks_0_ln_1"].degrees == (4, 1, 1) and plain["add_2"].degrees == (4, 1, 1)
    assert all(plain[n.name] == plan[n.name] for n in g if n.kind in ("linear", "attention", "embedding"))
    assert plan["cross_entropy"].degrees == (2, 2)  # vocab-parallel loss: samples × classes


def _layer_bytes(g, plan, first, last):
    """(forward, backward) bytes moved into the ops from ``first`` to ``last``: their remote
    pieces and what every member of their collectives sends (``Collective.sent``)."""
    names = [n.name for n in g]
    layer = set(names[names.index(first):names.index(last) + 1])
    low = lower(g, plan)
    remote = [t for t in low.transfers if not t.local and t.dst_op in layer]
    shared = [c for c in low.collectives if low.collective_readers[c][0].dst_op in layer]
    return (sum(t.nbytes for t in remote) + sum(c.sent * len(c.devices) for c in shared),
            sum(t.nbytes for t in remote if g.moves_grad(t.src_op, t.dst_op))
            + sum(c.sent * len(c.devices) for c in shared if c.grad))


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("devices,tp", [(2, 2), (4, 2), (8, 2)])
def test_one_layer_moves_megatron_lm_bytes(devices, tp, sp):
    g = traced("gpt")
    b, s, h = 4 // (devices // tp), 8, 16  # per data-parallel replica (one tensor-parallel group)
    item = DTYPE_BYTES[g["blocks_0_mlp_proj"].output.dtype]
    groups = devices // tp
    all_reduce = 2 * (tp - 1) * b * s * h * item * groups  # a ring's bytes over each group's t devices
    plan = megatron(g, devices, tp, sequence_parallel=sp)
    low = lower(g, plan)
    # the MLP: an all-gather of ln_2's sequence (or sample) shards into fc, a reduce-scatter of proj's
    # Partial sums into the sequence-cut dropout; their duals backward: one all-reduce each way
    assert _layer_bytes(g, plan, "blocks_0_ln_2", "add_2") == (all_reduce, all_reduce)
    # attention: the same; q, k and v read ln_1's output through one all-gather (as Megatron's
    # fused qkv linear does)
    assert _layer_bytes(g, plan, "blocks_0_ln_1", "add_1") == (all_reduce, all_reduce)
    layer = [c for c in low.collectives if c.op.startswith("blocks_0_")]
    assert sorted((c.kind, c.op) for c in layer if c.devices == tuple(range(tp))) == [
        ("all_gather", "blocks_0_ln_1"), ("all_gather", "blocks_0_ln_2"),
        ("reduce_scatter", "blocks_0_attn_proj"), ("reduce_scatter", "blocks_0_mlp_proj")]
    assert all(c.nbytes == b * s * h * item and c.grad for c in layer)
    assert {r.dst_op for c in layer if c.op == "blocks_0_ln_1" for r in low.collective_readers[c]} == {
        "blocks_0_attn_q", "blocks_0_attn_k", "blocks_0_attn_v"}
    # no Partial piece moves point to point anywhere in the plan
    assert not any(t.partial and not t.local for t in low.transfers)


def test_bad_tensor_parallel_degree():
    g = traced("gpt")
    with pytest.raises(PlanError, match=r"tp = 3: tensor-parallel degree must be a whole number dividing num_devices \(4\)"):
        megatron(g, 4, tp=3)
    assert baseline("megatron", g, 4, tp=2) == megatron(g, 4, 2)


def test_llama_blocks_swiglu_and_rotary():
    """The zoo's llama: q/k/v through the rotary slices into grouped-query attention, and the
    SwiGLU MLP's two column linears (w1, w3) into one row linear (w2)."""
    g = traced("llama")
    assert [(cols, row) for cols, _, row in megatron_blocks(g)][:2] == [
        (("blocks_0_attn_wq", "blocks_0_attn_wk", "blocks_0_attn_wv"), "blocks_0_attn_wo"),
        (("blocks_0_mlp_w1", "blocks_0_mlp_w3"), "blocks_0_mlp_w2")]
    plan = megatron(g, 2, tp=2)
    show = {n.name: plan[n.name].show(n.dims) for n in g}
    assert show["blocks_0_attn_wo"] == "R2 @ 0-1" and show["blocks_0_mlp_w2"] == "R2 @ 0-1"
    assert plan["scaled_dot_product_attention"].degrees == (1, 2, 1, 1)  # by heads
    assert show["mul_4"] == "A2 @ 0-1"  # silu(w1) · w3 on its features


def _stage_devices(g, plan):
    return {n.name: set(plan[n.name].devices) for n in g}


def test_pipeline_stages_and_microbatches():
    g = traced("gpt")
    plan = megatron(g, 4, tp=2, pp=2, microbatches=2)
    assert (plan.microbatches, plan.schedule) == (2, "1f1b")
    on = _stage_devices(g, plan)
    blocks = megatron_blocks(g)
    for cols, middle, row in blocks:  # a block is never split between stages
        assert len({frozenset(on[x]) for x in (*cols, *middle, row)}) == 1
    assert on["blocks_0_attn_q"] == {0, 1} and on["lm_head"] == {2, 3} and on["targets"] == {2, 3}
    stage0 = [n for n in g if on[n.name] <= {0, 1} and n.kind not in ("input", "parameter")]
    stage1 = [n for n in g if on[n.name] <= {2, 3} and n.kind not in ("input", "parameter")]
    assert len(stage0) + len(stage1) == sum(n.kind not in ("input", "parameter") for n in g)
    names = [n.name for n in g]
    assert max(names.index(n.name) for n in stage0) < min(names.index(n.name) for n in stage1)  # contiguous
    f0, f1 = sum(n.flops for n in stage0), sum(n.flops for n in stage1)
    assert max(f0, f1) <= 0.75 * (f0 + f1), (f0, f1)  # balanced by forward FLOPs
    assert plan["blocks_0_attn_q"].show(g["blocks_0_attn_q"].dims) == "P2 @ 0-1"  # d = 4 / (2·2) = 1
    plan.validate(g)
    assert megatron(g, 8, tp=2, pp=2).num_devices == 8  # d = 2 in each stage


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_devices=4, tp=2, pp=3), r"pp = 3: 3 pipeline stages do not divide num_devices 4 \(4 % 3 = 1\)"),
    (dict(num_devices=6, tp=2, pp=2), r"tp x pp = 4: tp 2 x pp 2 = 4 does not divide num_devices 6"),
    (dict(num_devices=8, tp=8, pp=2), r"tp x pp = 16: tp 8 x pp 2 = 16 does not divide num_devices 8"),
    (dict(num_devices=4, tp=4), r"op 'scaled_dot_product_attention': tp = 4: the attention's 2 heads are not "
                                r"divisible by tp 4 \(2 % 4 = 2\)"),
    (dict(num_devices=2, tp=2, microbatches=3), r"microbatches = 3: batch 4 is not divisible by 3 micro-batches "
                                                r"\(4 % 3 = 1\)"),
    (dict(num_devices=8, tp=2, microbatches=2), r"tp = 2: batch 4 / 2 micro-batch\(es\) = 2 is not divisible by "
                                                r"num_devices 8 / \(tp 2 x pp 1\) = 4 data-parallel groups"),
    (dict(num_devices=8, tp=1, pp=8), r"pp = 8: more pipeline stages than the model's 4 transformer blocks; "
                                      r"give pp <= 4"),
    (dict(num_devices=2, tp=2, microbatches=0), r"microbatches = 0: must be a whole number >= 1"),
    (dict(num_devices=2, tp=2, pp=True), r"pp = True: must be a whole number >= 1"),
])
def test_bad_counts_are_one_line_with_the_arithmetic(kwargs, match):
    g = traced("gpt")
    with pytest.raises(PlanError, match=match):
        megatron(g, **kwargs)


def test_vocab_parallel_loss_when_the_rule_has_classes():
    """The loss is cut t ways on its dim named ``classes`` (Megatron's vocab-parallel
    cross-entropy) where its rule offers that dim; the head is column-parallel either way."""
    g = traced("gpt")
    loss = g["cross_entropy"]
    names = [d.name for d in loss.dims]
    plan = megatron(g, 4, tp=2)
    assert plan["lm_head"].show(g["lm_head"].dims) == "S2·P2 @ 0-3"
    if "classes" not in names:
        pytest.skip(f"the loss rule has no 'classes' dim yet (dims {names}): the loss reads whole logit rows")
    k = names.index("classes")
    assert plan["cross_entropy"].degrees[k] == 2 and plan["cross_entropy"].devices == (0, 1, 2, 3)
    assert not any(t.src_op == "view_8" and not t.local for t in lower(g, plan).transfers)  # logits never gathered


@pytest.mark.parametrize("microbatches,degrees", [(8, (2, 4)), (4, (4, 2)), (2, (8, 1)), (1, (8, 1))])
def test_targets_cut_as_their_flattened_view_reads_them(microbatches, degrees):
    """The targets [batch, seq] under sequence parallelism: one sample a replica's micro-batch
    cut on the sequence over the 4 members; 2 samples on 2 × d samples × 2 halves of the
    sequence, so member j holds the j-th quarter of the replica's flattened tokens, which the
    loss's view cut d·t ways reads there; 4 or more on the samples alone. No piece of the
    targets moves between devices, and the token ids the embedding reads stay cut on the
    sequence (an all-gather over the members)."""
    g = traced("gpt", "small")  # batch 16, 4 heads
    plan = megatron(g, 8, tp=4, pp=1, microbatches=microbatches, sequence_parallel=True)  # d = 2
    assert plan["targets"].degrees == degrees and plan["targets"].devices == tuple(range(8))
    assert plan["inputs"].degrees == ((2, 4) if microbatches > 2 else (8, 1))
    lowered = lower(g, plan)
    assert not any(t.src_op == "targets" and not t.local for t in lowered.transfers)
