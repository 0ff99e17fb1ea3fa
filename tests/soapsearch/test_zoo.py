"""Tests for soapsearch.zoo: tiny models train and trace; paper-scale models build on meta."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx

from soapsearch import zoo

NAMES = zoo.names()

# Known parameter counts of the paper-scale models (torchvision / GPT-2 figures).
KNOWN_PARAMS = {
    "alexnet": 61.1e6,  # torchvision alexnet: 61,100,840
    "resnet101": 44.5e6,  # torchvision resnet101: 44,549,160
    "inception_v3": 23.8e6,  # torchvision inception_v3 (27.16M) minus its AuxLogits head
    "gpt": 163.0e6,  # GPT-2 small 124.4M + untied 768x50257 lm_head
    "llama": 8.03e9,  # LLaMA-3 8B: 8,030,261,248
}
DEFAULT_BATCH = {"gpt": 12, "llama": 1}
"""Default batches other than FlexFlow's 64 per GPU."""


def _loss(module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1234)  # same dropout masks for every call
    return module(inputs, targets)


def test_names_and_describe() -> None:
    assert set(NAMES) == {
        "alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt", "llama"
    }
    for name in NAMES:
        text = zoo.describe(name)
        assert isinstance(text, str) and text and "\n" not in text
    assert zoo.VARIANTS == ("default", "small", "tiny", "gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b")


@pytest.mark.parametrize("variant, params", [("tiny", (0, 1_000_000)), ("small", (300_000, 3_000_000))])
@pytest.mark.parametrize("name", NAMES)
def test_trains_and_traces(name: str, variant: str, params: tuple[int, int]) -> None:
    model, (inputs, targets) = zoo.build(name, variant)
    assert params[0] <= sum(p.numel() for p in model.parameters()) < params[1]
    assert len(inputs) == (16 if variant == "small" else 4)
    loss = _loss(model, inputs, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no grad for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite grad for {pname}"

    traced = torch.fx.symbolic_trace(model)
    ops = {n.op for n in traced.graph.nodes}
    assert {"placeholder", "output"} <= ops
    assert torch.equal(_loss(traced, inputs, targets), _loss(model, inputs, targets))


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_seed(name: str) -> None:
    state = torch.get_rng_state()
    m1, (x1, y1) = zoo.build(name, "tiny", seed=3)
    m2, (x2, y2) = zoo.build(name, "tiny", seed=3)
    m3, (x3, _) = zoo.build(name, "tiny", seed=4)
    assert torch.equal(torch.get_rng_state(), state), "build() must not touch the global RNG"
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not torch.equal(x1, x3) or any(not torch.equal(sd1[k], sd3[k]) for k in sd1)


@pytest.mark.parametrize("name", NAMES)
def test_batch_size(name: str) -> None:
    _, (inputs, targets) = zoo.build(name, "tiny", batch_size=3)
    assert inputs.shape[0] == 3 and targets.shape[0] == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            zoo.build(name, "tiny", batch_size=bad)


def test_overrides() -> None:
    gpt, (x, _) = zoo.build("gpt", "tiny", n_layer=3, seq_len=5)
    assert len(gpt.blocks) == 3 and x.shape[1] == 5 and gpt.wpe.shape[0] == 5
    rnntc, _ = zoo.build("rnntc", "tiny", num_layers=3)
    assert len(rnntc.lstm.layers) == 3
    resnet, _ = zoo.build("resnet101", "tiny", layers=(2, 1, 1, 1))
    assert len(resnet.layers[0]) == 2
    nmt, (x, y) = zoo.build("nmt", "tiny", src_len=3, tgt_len=5, batch_size=2)
    assert x.shape == (2, 8) and y.shape == (2, 5)
    assert torch.isfinite(nmt(x, y))
    mlp, (x, _) = zoo.build("mlp", "tiny", hidden=(8, 8, 8))
    assert len([m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]) == 4
    cfg = zoo.config("gpt", "tiny", n_embd=32)
    assert dataclasses.is_dataclass(cfg) and cfg.n_embd == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_embd = 8  # type: ignore[misc]


def test_bad_names_raise_helpful_errors() -> None:
    with pytest.raises(ValueError, match=r"'gpt'.*'n_layers'.*n_layer"):
        zoo.build("gpt", "tiny", n_layers=2)
    with pytest.raises(ValueError, match=r"'vgg'.*alexnet.*gpt"):
        zoo.build("vgg")
    with pytest.raises(ValueError, match=r"'huge'.*default.*tiny"):
        zoo.build("mlp", "huge")
    with pytest.raises(ValueError, match="vgg"):
        zoo.describe("vgg")
    with pytest.raises(ValueError, match="divisible"):
        zoo.build("gpt", "tiny", n_head=3)


@pytest.mark.parametrize("name", NAMES)
def test_default_builds_on_meta(name: str) -> None:
    model, (inputs, targets) = zoo.build(name, device="meta")
    tensors = [*model.parameters(), *model.buffers(), inputs, targets]
    assert all(t.device.type == "meta" for t in tensors)
    assert inputs.shape[0] == targets.shape[0] == DEFAULT_BATCH.get(name, 64)
    assert not inputs.is_floating_point() or inputs.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    if name in KNOWN_PARAMS:
        assert n_params == pytest.approx(KNOWN_PARAMS[name], rel=0.03)
    loss = model(inputs, targets)  # shapes of the paper-scale config are consistent
    assert loss.shape == () and loss.device.type == "meta"


def test_default_configs() -> None:
    assert zoo.config("resnet101").layers == (3, 4, 23, 3)
    assert zoo.config("inception_v3").image_size == 299
    assert zoo.config("rnntc").num_layers == 4
    assert zoo.config("rnnlm").num_layers == 2 and zoo.config("rnnlm").vocab_size == 10000
    assert zoo.config("nmt").num_layers == 2
    nmt, (x, y) = zoo.build("nmt", device="meta")
    assert x.shape == (64, 40) and y.shape == (64, 20) and nmt.src_len == 20


# Brown et al. 2020, Table 2.1: n_params, n_layers, d_model, n_heads; context 2048.
GPT3 = {"gpt3-1.3b": (1.3e9, 24, 2048, 16), "gpt3-6.7b": (6.7e9, 32, 4096, 32), "gpt3-13b": (13.0e9, 40, 5120, 40),
        "gpt3-175b": (175.0e9, 96, 12288, 96)}


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v == "gpt3-175b" else v for v in GPT3])
def test_gpt3_shapes_trace_on_meta(variant: str) -> None:
    from soapsearch import trace

    published, layers, width, heads = GPT3[variant]
    cfg = zoo.config("gpt", variant)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.seq_len) == (layers, width, heads, 2048)
    model, (inputs, targets) = zoo.build("gpt", variant, device="meta", batch_size=2)
    assert model.lm_head.weight is model.wte.weight  # tied, as GPT-3 counts them
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == pytest.approx(published, rel=0.02), n_params
    graph = trace(model, (inputs, targets), name=variant)
    assert graph.weight_bytes == 4 * n_params  # the tied weight named once (float32)
    attention = [n for n in graph if n.kind == "attention"]
    assert len(attention) == layers and attention[0].output.shape == (2, heads, 2048, width // heads)
