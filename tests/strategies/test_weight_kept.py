"""A weight op keeps nothing for the backward: its output is its weight, held once
(``MemoryBreakdown.weights``), not per micro-batch in flight; the executor reads each
consumer's own view of it (``soapsearch.executor``: a weight op's step returns at once). A
position table added to the token embeddings (zoo gpt's ``wpe``) is the case: Megatron-LM's
position embedding is a lookup whose backward reads the position ids only (Korthikanti et al.
2022 §4.3 count the embedding's dropout mask alone on the first stage)."""

from strategies.baselines import data_parallel
from strategies.lowering import lower
from strategies.megatron import megatron
from tests.conftest import traced


def test_weight_ops_keep_nothing_per_microbatch():
    """gpt tiny alone and on 2 stages x 2-way tensor parallelism with 4 micro-batches: no weight
    op keeps a byte, where ``wpe``'s output alone is 8 x 16 float32 (512 bytes a micro-batch)."""
    g = traced("gpt")
    weights = [n.name for n in g if n.kind in ("parameter", "constant")]
    assert "wpe" in weights and g["wpe"].output.numel == 8 * 16  # gpt tiny: seq_len 8 x n_embd 16
    for plan in (data_parallel(g, 1), megatron(g, 4, tp=2, pp=2, microbatches=4)):
        low = lower(g, plan)
        assert {w: low.pieces[w].activations for w in weights} == {w: (0,) * plan.num_devices for w in weights}

