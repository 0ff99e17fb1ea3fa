"""HF transformers models, which torch.fx cannot trace (``masking_utils``' Python control
flow), captured by torch.export under ``capture="auto"``: no opaque op, and the OpGraph computes
the model's loss (every op's rule forward, unsplit, on real inputs)."""

import math

import pytest
import torch

from soapsearch.trace import trace_with_module
from strategies.region import slice_box
from strategies.rules import get_rule

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 64, 2, 8


class LossOf(torch.nn.Module):
    """forward(ids, labels) -> the HF model's training loss."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids, labels):
        return self.hf(input_ids=ids, labels=labels).loss


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64))


def _graph_loss(graph, module, inputs):
    """The graph's output computed op by op: each rule's forward on the whole op, from the
    regions of its inputs and weights the rule names."""
    values = {}
    for n in graph:
        if n.kind == "input":
            values[n.name] = inputs[n.attrs["index"]]
            continue
        rule, box = get_rule(n.kind), tuple((0, s) for s in n.shape)
        regions = rule.weight_regions(n, box)
        weights = {w.role: _attr(module, w.name)[slice_box(regions[w.role])] for w in n.weights}
        ins = [None if r is None else values[i][slice_box(r)]
               for i, r in zip(n.inputs, rule.input_regions(n, box))]
        values[n.name] = rule.forward(n, box, ins, weights)
    return values[graph.outputs[0]]


def _attr(module, qual):
    for part in qual.split("."):
        module = getattr(module, part)
    return module


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_model_captures_by_export_and_computes_its_loss(build):
    torch.manual_seed(0)
    model = LossOf(build()).train()
    ids, labels = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    graph, module = trace_with_module(model, (ids, labels))
    assert graph.capture == "export"
    assert [n.name for n in graph if n.kind == "opaque"] == []
    kinds = {n.kind for n in graph}
    assert {"embedding", "attention", "loss"} <= kinds
    assert graph.batch_size == BATCH
    for n in graph:
        if n.kind in ("linear", "attention"):  # not the position embedding: [1, T, C]
            assert n.sample_dim is not None and n.dims[n.sample_dim].size in (BATCH, BATCH * SEQ), n.name
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(w.spec.numel for w in {w.name: w for n in graph for w in n.weights if w.trainable}.values()) == n_params
    with torch.no_grad():
        expected = model(ids, labels)
        got = _graph_loss(graph, module, (ids, labels))
    assert got.shape == () and math.isclose(got.item(), expected.item(), rel_tol=1e-5), (got, expected)


def test_llama_attention_reads_its_mask_and_key_value_heads():
    torch.manual_seed(0)
    model = LossOf(_llama())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    graph, _ = trace_with_module(model, (ids, ids))
    attention = [n for n in graph if n.kind == "attention"]
    assert len(attention) == 2
    for n in attention:
        assert n.attrs["has_mask"] and len(n.inputs) == 4
        assert n.input_specs[3].shape == (BATCH, 1, SEQ, SEQ) and n.input_specs[3].dtype == "bool"
        assert n.flops == 4 * BATCH * 4 * SEQ * SEQ * 8  # 4·B·H·L·S·E (sdpa_flop_count)
