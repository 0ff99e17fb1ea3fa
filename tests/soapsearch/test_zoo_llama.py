"""The zoo's LLaMA traces with no opaque op in every variant (the default on the meta device),
and a tied weight (GPT-2's ``lm_head.weight is wte.weight``) is one weight of the plan."""

from __future__ import annotations

import collections
import time

import pytest

from soapsearch import zoo
from soapsearch.trace import trace
from strategies.baselines import data_parallel
from strategies.lowering import lower
from tests.executor.models_llm import tied_gpt, tied_matmul

LLAMA_KINDS = {"input", "constant", "embedding", "rms_norm", "linear", "reshape", "permute",
               "slice", "elementwise", "concat", "mul", "add", "attention", "loss"}


@pytest.mark.parametrize("variant", ["tiny", "small", "default"])
def test_llama_traces_with_no_opaque_op(variant: str) -> None:
    model, (x, y) = zoo.build("llama", variant, device="meta" if variant == "default" else None)
    start = time.perf_counter()
    graph = trace(model, (x, y))
    seconds = time.perf_counter() - start
    kinds = collections.Counter(n.kind for n in graph)
    cfg = zoo.config("llama", variant)
    assert set(kinds) == LLAMA_KINDS, kinds
    assert kinds["attention"] == cfg.n_layer and kinds["rms_norm"] == 2 * cfg.n_layer + 1
    assert kinds["linear"] == 7 * cfg.n_layer + 1  # wq wk wv wo w1 w3 w2, lm_head
    attn = next(n for n in graph if n.kind == "attention")
    assert dict(attn.attrs) == {"is_causal": True, "scale": None, "enable_gqa": True, "has_mask": False}
    assert attn.input_specs[1].shape[1] == cfg.n_kv_head and attn.shape[1] == cfg.n_head
    assert graph.batch_size == x.shape[0]
    if variant == "default":
        print(f"llama default: {len(graph)} ops traced on meta in {seconds:.1f} s")
        assert graph.weight_bytes == 4 * (8_030_261_248 + 2 * 8192 * 128)  # + the RoPE tables


def test_llama_default_shape() -> None:
    cfg = zoo.config("llama")
    assert (cfg.n_layer, cfg.d_model, cfg.ffn_hidden, cfg.n_head, cfg.n_kv_head, cfg.vocab_size,
            cfg.rope_theta, cfg.seq_len) == (32, 4096, 14336, 32, 8, 128256, 500000.0, 8192)
    with pytest.raises(ValueError, match=r"n_head \(32\) must be divisible by n_kv_head \(6\)"):
        zoo.config("llama", n_kv_head=6)


def test_tied_weight_is_one_weight_of_the_plan() -> None:
    model, inputs = tied_gpt()
    graph = trace(model, inputs)
    wte, head = graph["wte"], graph["lm_head"]
    assert wte.weights[0].name == head.weights[0].name == "wte.weight"
    names = {w.name for n in graph for w in n.weights}
    assert "lm_head.weight" not in names
    assert graph.weight_bytes == sum(p.numel() * 4 for p in model.parameters())  # listed once
    shards = [s for s in lower(graph, data_parallel(graph, 2)).weight_shards if s.name == "wte.weight"]
    assert len(shards) == 1 and shards[0].ops == ("wte", "lm_head") and shards[0].devices == (0, 1)


def test_tied_weight_read_through_get_attr() -> None:
    model, inputs = tied_matmul()
    graph = trace(model, inputs)
    readers = [n.name for n in graph if any(w.name == "emb.weight" for w in n.weights)]
    assert readers == ["emb", "emb_weight"] and graph["emb_weight"].kind == "parameter"
    assert graph.weight_bytes == 12 * 8 * 4


def test_untied_gpt_keeps_both_names() -> None:
    model, inputs = zoo.build("gpt", "tiny")
    graph = trace(model, inputs)
    assert graph["lm_head"].weights[0].name == "lm_head.weight"
    assert graph.weight_bytes == sum(p.numel() * 4 for p in model.parameters())
