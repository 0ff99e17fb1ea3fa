"""A linear that reads an all-gather keeps the shard and gathers again in its backward
(``strategies.collective_buffers.REGATHERED``; Megatron-LM's column-parallel linear under
sequence parallelism, ``LinearWithGradAccumulationAndAsyncCommunication``): a sequence-parallel
megatron plan with its attention cores recomputed (Korthikanti et al. 2022's selective
recompute) lets each layer-norm output's all-gather go after its last reader's forward and
calls it again at the backward of that reader, the first of them to run backward."""

import pytest

from strategies.collective_buffers import buffer_lives, regather_steps
from strategies.lowering import lower
from strategies.megatron import megatron
from strategies.schedule import Step
from tests.conftest import traced


def _selective_sp(devices: int = 2):
    g = traced("gpt")
    plan = megatron(g, devices, tp=devices, sequence_parallel=True)
    plan = plan.with_configs({name: cfg.with_memory(recompute=True) if g[name].kind == "attention" else cfg
                              for name, cfg in plan.items()})
    return g, lower(g, plan)


def test_linears_gather_again_in_their_backward():
    g, lowered = _selective_sp()
    lives = buffer_lives(lowered, microbatch=0)
    gathers = {life.collective.op: life for life in lives if life.collective.kind == "all_gather"}
    # by hand: gpt tiny's two blocks' ln_1 (read by q, k, v) and ln_2 (read by the MLP's first
    # linear) and ln_f (read by lm_head); the token ids (read by the embedding) and the targets
    # (read by the cross-entropy) stay kept
    linear = {op: life for op, life in gathers.items() if g[life.first].kind == "linear"}
    assert {op: (life.first, life.last, life.regather, life.kept) for op, life in linear.items()} == {
        "blocks_0_ln_1": ("blocks_0_attn_q", "blocks_0_attn_v", "blocks_0_attn_v", False),
        "blocks_0_ln_2": ("blocks_0_mlp_fc", "blocks_0_mlp_fc", "blocks_0_mlp_fc", False),
        "blocks_1_ln_1": ("blocks_1_attn_q", "blocks_1_attn_v", "blocks_1_attn_v", False),
        "blocks_1_ln_2": ("blocks_1_mlp_fc", "blocks_1_mlp_fc", "blocks_1_mlp_fc", False),
        "ln_f": ("lm_head", "lm_head", "lm_head", False),
    }
    others = [life for op, life in gathers.items() if op not in linear]
    assert len(others) == 2 and all(life.kept and life.regather is None for life in others)


def test_samples_and_features_gathered_stay_kept():
    """Krizhevsky's one weird trick (``owt``) all-gathers alexnet's samples into its first linear
    and the features the next two contract: what autograd saves, kept for the backward."""
    from strategies.baselines import baseline
    g = traced("alexnet")
    lives = buffer_lives(lower(g, baseline("owt", g, 2)))
    assert [(g[life.collective.op].dims[life.collective.dim].role, life.kept, life.regather) for life in lives] == [
        ("sample", True, None), ("attribute", True, None), ("attribute", True, None)]


def test_each_member_gathers_again_at_its_partition_of_the_readers_backward():
    """ln_2's all-gather is called again by each member at its own partition of the MLP's first
    linear's backward; a regather op a member holds no partition of (gpt tiny's ``wpe``, on
    device 0 alone) is refused in one line naming the devices that hold it."""
    _, lowered = _selective_sp()
    life = next(life for life in buffer_lives(lowered, microbatch=0) if life.collective.op == "blocks_0_ln_2")
    assert regather_steps(lowered, life) == {d: Step(True, "blocks_0_mlp_fc", d, 0) for d in (0, 1)}
    with pytest.raises(ValueError, match=r"^op 'wpe': device 1 is a member of the all_gather of 'blocks_0_ln_2' "
                       r"\(micro-batch 0\) called again at its backward but holds no partition of 'wpe' "
                       r"\(its partitions are on devices \[0\]\)$"):
        regather_steps(lowered, life._replace(regather="wpe"))
