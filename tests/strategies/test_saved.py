"""The per-kind backward rules of ``strategies.saved`` against autograd's saved tensors: each op
of the tiny gpt, llama and mlp whose kind has a rule runs its rule's forward on its whole box
under ``torch.autograd.graph.saved_tensors_hooks``, and what the hooks see saved must be what
the rule says — an input's storage (INPUT), the output's (OUTPUT), neither (NOTHING, a dropout's
bool mask of one byte an element besides), or neither with the output a view of the input
(ALIAS)."""

from __future__ import annotations

import pytest
import torch

from soapsearch.executor import build_model
from strategies.lowered import WEIGHT_KINDS
from strategies.region import full_box, slice_box
from strategies.rules import get_rule
from strategies.saved import ALIAS, INPUT, NOTHING, OUTPUT, backward_reads, mask_bytes


def _values(built) -> dict[str, torch.Tensor]:
    """Every op's output on the model's batch, each op run whole from its rule."""
    graph, state, values = built.graph, built.state, {}
    for node in graph:
        if node.kind == "input":
            values[node.name] = built.inputs[node.attrs["index"]]
        elif node.kind in WEIGHT_KINDS:
            values[node.name] = state[node.weights[0].name]
        else:
            values[node.name] = _run(node, [values[i] for i in node.inputs], state)[0]
    return values


def _run(node, inputs, state, grad: bool = False):
    """(output, inputs) of ``node``'s rule on its whole box; ``grad``: float inputs are leaves."""
    box = full_box(node.shape)
    rule = get_rule(node.kind)
    regions = rule.input_regions(node, box)
    ins = [None if r is None else x[slice_box(r)] for x, r in zip(inputs, regions)]
    weights = {role: state[node.weight(role).name][slice_box(r)] for role, r in rule.weight_regions(node, box).items()}
    if grad:  # trainable weights: a linear saves its input for its weight's gradient
        ins = [x.detach().requires_grad_() if x is not None and x.is_floating_point() else x for x in ins]
        weights = {k: w.detach().requires_grad_() if w.is_floating_point() else w for k, w in weights.items()}
    return rule.forward(node, box, ins, weights), ins


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("model", [pytest.param("gpt", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow), "mlp"])
def test_each_rule_is_what_autograd_saves(model):
    built = build_model(model, "tiny", dtype="float64")
    graph, values = built.graph, _values(built)
    seen = set()
    for node in graph:
        what = backward_reads(node)
        if what is None or node.kind in WEIGHT_KINDS or not graph.needs_grad[node.name]:
            continue
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, ins = _run(node, [values[i] for i in node.inputs], built.state, grad=True)
        inputs = {_storage(x) for x in ins if x is not None}
        ptrs = {_storage(t) for t in saved}
        reads_in, reads_out = bool(ptrs & inputs), _storage(out) in ptrs and _storage(out) not in inputs
        masks = sum(t.numel() for t in saved if t.dtype == torch.bool)
        if node.kind == "loss":  # cross-entropy saves its log-softmax: the input's bytes, not its storage
            x = ins[0]
            assert sum(t.numel() * t.element_size() for t in saved if t.shape == x.shape) >= x.numel() * x.element_size()
        else:
            assert reads_in == (what == INPUT), (node.name, what)
        assert reads_out == (what == OUTPUT), (node.name, what)
        assert masks == mask_bytes(node, out.numel()), node.name
        assert (_storage(out) in inputs) == (what == ALIAS), (node.name, what)
        seen.add(what)
    want = {"gpt": {INPUT, NOTHING, ALIAS}, "llama": {INPUT, NOTHING, ALIAS}, "mlp": {INPUT, OUTPUT}}[model]
    assert want <= seen, seen
