"""The two front ends of ``trace``: torch.fx and torch.export capture the same zoo model as the
same OpGraph (up to op names), ``auto`` falls back to export, and a model neither captures gets
one message naming both failures."""

import pytest
import torch
import torch.nn as nn

from soapsearch import TraceError, trace, zoo
from soapsearch.trace import CAPTURES


def _signature(graph):
    """Every op as (kind, dims, weights, input edges by position, FLOPs, output spec)."""
    at = {n.name: i for i, n in enumerate(graph)}
    return [(n.kind, tuple((d.name, d.size, d.role) for d in n.dims),
             tuple((w.role, w.name, w.spec.shape, w.trainable) for w in n.weights),
             tuple(at[i] for i in n.inputs), n.flops, n.output)
            for n in graph]


@pytest.mark.parametrize("name", ["mlp", "gpt", "alexnet", "resnet101"])
def test_fx_and_export_give_the_same_ops(name):
    model, inputs = zoo.build(name, "tiny")
    by_fx = trace(model, inputs, capture="fx")
    by_export = trace(model, inputs, capture="export")
    assert (by_fx.capture, by_export.capture) == ("fx", "export")
    assert _signature(by_export) == _signature(by_fx)
    assert [by_export.users(n.name) != () for n in by_export] == [by_fx.users(n.name) != () for n in by_fx]
    assert [by_fx[o].kind for o in by_fx.outputs] == [by_export[o].kind for o in by_export.outputs] == ["loss"]
    assert by_export.total_flops == by_fx.total_flops > 0


@pytest.mark.slow
def test_fx_and_export_agree_on_inception():
    model, inputs = zoo.build("inception_v3", "tiny")
    assert _signature(trace(model, inputs, capture="export")) == _signature(trace(model, inputs, capture="fx"))


def test_export_finds_the_sample_dim_through_hard_coded_views():
    """GPT's view(B, T, H, C // H) reads B from the input: exported with a dynamic batch, the
    graph propagates at 2B and every op that has a batch gets its sample dim."""
    g = trace(*zoo.build("gpt", "tiny"), capture="export")
    b = g.batch_size
    assert b == 4
    for n in g:
        if n.kind in ("input", "linear", "attention", "layernorm", "reshape", "permute"):
            assert n.sample_dim is not None, n.name
            assert n.dims[n.sample_dim].size in (b, b * 8), n.name  # [B, ...] or [B*T, ...]


def test_export_of_a_meta_model_allocates_no_weights():
    model, inputs = zoo.build("gpt", "small", device="meta")
    g = trace(model, inputs, capture="export")
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(w.spec.numel for n in g for w in n.weights if w.trainable) == n_params
    assert all(p.is_meta for p in model.parameters())
    assert g.batch_size == 16


def test_a_batch_of_one_still_gets_a_sample_dim():
    """export specializes a size of 1; the graph is exported at 2 and propagated at 1 and 2."""
    model, inputs = zoo.build("mlp", "tiny", batch_size=1)
    g = trace(model, inputs, capture="export")
    assert g.batch_size == 1
    assert [d.role for d in g[[n.name for n in g if n.kind == "linear"][0]].dims] == ["sample", "parameter", "reduction"]


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # a value, not a shape, decides: neither front end can capture it
            x = self.fc(x)
        return x.sum()


def test_a_model_neither_captures_names_both_failures():
    with pytest.raises(TraceError) as err:
        trace(DataDependent(), (torch.randn(2, 4),))
    lines = str(err.value).splitlines()
    assert lines[0] == "neither torch.fx nor torch.export can capture DataDependent:"
    assert lines[1].startswith("  torch.fx: ") and "test_capture.py" in lines[2]
    assert "if x.sum() > 0" in lines[2]
    assert lines[3].startswith("  torch.export: ") and len(lines) == 5
    assert "torch.where" in lines[4] and "draft_export" in lines[4]


def test_capture_export_alone_names_export_only():
    with pytest.raises(TraceError) as err:
        trace(DataDependent(), (torch.randn(2, 4),), capture="export")
    msg = str(err.value)
    assert msg.startswith("torch.export cannot capture DataDependent: ") and "torch.fx" not in msg
    assert "--capture fx" in msg


def test_capture_fx_alone_does_not_fall_back():
    with pytest.raises(TraceError, match="torch.fx cannot trace DataDependent") as err:
        trace(DataDependent(), (torch.randn(2, 4),), capture="fx")
    assert "torch.export" not in str(err.value)


class ShapeBranch(nn.Module):
    """Python control flow over a shape: fx cannot trace it (a Proxy in an ``if``), export can."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        h = self.fc(x)
        if h.shape[-1] == 3:
            h = torch.relu(h)
        return nn.functional.cross_entropy(h, y)


def test_auto_falls_back_to_export():
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with pytest.raises(TraceError):
        trace(ShapeBranch(), (x, y), capture="fx")
    g = trace(ShapeBranch(), (x, y))
    assert g.capture == "export"
    assert [n.kind for n in g] == ["input", "input", "linear", "elementwise", "loss"]
    assert [w.name for w in g[[n.name for n in g if n.kind == "linear"][0]].weights] == ["fc.weight", "fc.bias"]
    assert g.batch_size == 6


def test_unknown_capture_is_refused():
    with pytest.raises(ValueError, match="capture 'jit' is not one of fx, export, auto"):
        trace(*zoo.build("mlp", "tiny"), capture="jit")
    assert CAPTURES == ("fx", "export", "auto")


def test_show_names_the_front_end_and_plans_record_it(tmp_path, capsys):
    from soapsearch.cli import main
    from strategies.serialize import parse_plan, read_plan

    assert main(["show", "mlp", "--variant", "tiny", "--capture", "export"]) == 0
    assert "ops captured by torch.export, batch 4" in capsys.readouterr().out
    out = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--capture", "export", "--baseline",
                 "data_parallel", "--topology", "local-cpu-2", "-o", str(out)]) == 0
    obj = parse_plan(out)[0]
    assert obj["model"]["capture"] == "export"
    graph = trace(*zoo.build("mlp", "tiny"), name="mlp-tiny", capture="export")
    assert read_plan(out, graph).strategy.num_devices == 2
    del obj["model"]["capture"]  # a plan written before the field: fx
    assert parse_plan(obj)[0]["model"].get("capture", "fx") == "fx"
    obj["model"]["capture"] = "jit"
    with pytest.raises(Exception, match="model.capture"):
        parse_plan(obj)
