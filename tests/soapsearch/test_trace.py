import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from soapsearch import TraceError, trace, zoo
from tests.conftest import traced
from tests.strategies.rulecheck import reference_values

ZOO = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt", "llama"]
COUNTED = {nn.Conv2d: "conv2d", nn.Linear: "linear", nn.BatchNorm2d: "batchnorm2d",
           nn.LayerNorm: "layernorm", nn.LSTM: "lstm", nn.Embedding: "embedding"}


@pytest.mark.parametrize("name", ZOO)
def test_zoo_traces_with_eager_shapes_and_op_counts(name):
    model, inputs = zoo.build(name, "tiny")
    graph, values = reference_values(model, inputs)
    for node in graph:
        real = values[node.name]
        assert tuple(real.shape) == node.output.shape, node.name
        assert str(real.dtype) == f"torch.{node.output.dtype}", node.name
    for mod_type, kind in COUNTED.items():
        n_modules = sum(type(m) is mod_type for m in model.modules())
        assert sum(n.kind == kind for n in graph) == n_modules, (kind, n_modules)
    assert graph.outputs and graph[graph.outputs[-1]].kind == "loss"
    assert graph.batch_size == inputs[0].shape[0]
    assert [n for n in graph if n.kind == "opaque"] == [], "every zoo op has a rule"


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_zoo_paper_scale_traces_on_fake_tensors(name):
    graph = traced(name, "default")
    model, _ = zoo.build(name, "default", device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(w.spec.numel for n in graph for w in n.weights if w.trainable) == n_params


def test_sample_dim_follows_the_batch_through_reshapes():
    g = traced("gpt")
    b = g.batch_size
    for n in g:
        if n.kind in ("input", "linear", "attention", "layernorm"):
            assert n.sample_dim is not None, n.name
            assert n.dims[n.sample_dim].size in (b, b * 8), n.name  # [B, ...] or [B*T, ...]
    head = g["lm_head"]
    assert [d.role for d in head.dims] == ["sample", "attribute", "parameter", "reduction"]


def test_flops_from_flop_counter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    g = trace(model, (torch.randn(4, 3, 6, 6),))
    conv, lin = g["_0"], g["_2"]
    assert conv.flops == 2 * 4 * 8 * 6 * 6 * 3 * 3 * 3
    assert lin.flops == 2 * 4 * 288 * 5
    assert lin.bytes_read == 4 * (4 * 288 + 5 * 288 + 5) and lin.bytes_written == 4 * 4 * 5
    assert [w.name for w in conv.weights] == ["0.weight", "0.bias"]


def test_flops_do_not_depend_on_where_the_weights_live():
    on_cpu = trace(*zoo.build("gpt", "tiny"), name="gpt")
    on_meta = trace(*zoo.build("gpt", "tiny", device="meta"), name="gpt")
    cpu_flops, meta_flops = ({n.name: n.flops for n in g} for g in (on_cpu, on_meta))
    assert cpu_flops == meta_flops
    attention = [n for n in on_cpu if n.kind == "attention"]
    assert attention
    for n in attention:  # Q·Kᵀ and softmax·V: 2 · 2·B·H·L·L·E, E the head size
        b, h, l, e = n.input_specs[0].shape
        assert n.flops == 4 * b * h * l * l * e, n.name


def test_tracing_allocates_no_weights():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 65536), nn.ReLU(), nn.Linear(65536, 4096))
    g = trace(model, (torch.empty(8, 4096, device="meta"),))
    assert g.weight_bytes > 2 * 2**30  # 2 GiB of weights described, none allocated
    assert g["_0"].flops == 2 * 8 * 4096 * 65536


def test_accepts_graph_module_and_fingerprint_is_stable():
    model, inputs = zoo.build("mlp", "tiny")
    g1 = trace(model, inputs)
    g2 = trace(fx.symbolic_trace(model), inputs)
    assert [n.name for n in g1] == [n.name for n in g2]
    assert g1.fingerprint() == g2.fingerprint() == trace(model, inputs).fingerprint()
    m8, in8 = zoo.build("mlp", "tiny", batch_size=8)
    assert trace(m8, in8).fingerprint() != g1.fingerprint()


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            x = self.fc(x)
        return x


def test_untraceable_model_names_the_source_line():
    with pytest.raises(TraceError) as err:
        trace(DataDependent(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "torch.where" in msg and "Traceback" not in msg


class Unknown(nn.Module):
    def forward(self, x):
        return torch.flip(x, [1]).sum(1).mean()


def test_op_without_rule_is_opaque_not_an_error():
    g = trace(Unknown(), (torch.randn(4, 6),))
    flip = g["flip"]
    assert flip.kind == "opaque" and flip.attrs["target"] == "flip"
    assert "test_trace.py" in flip.source


class CausalMask(nn.Module):
    """nanoGPT's masked attention: a buffer sliced by a traced size, masked_fill, softmax."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8))

    def forward(self, att):
        t = att.size(-1)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return torch.softmax(att, dim=-1)


def test_buffers_trace_as_constants():
    g = trace(CausalMask(), (torch.randn(2, 3, 6, 6),))
    const = next(n for n in g if n.kind == "constant")
    assert const.weights[0].name == "bias" and not const.weights[0].trainable
    assert [n.kind for n in g].count("opaque") == 0


class UsesHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out.sum(1) + h[0]


def test_second_tuple_item_is_a_clear_error():
    with pytest.raises(TraceError, match=r"(?s)reads an item other than the first of 'lstm''s tuple output.*out, \(h, c\) = self.lstm\(x\)"):
        trace(UsesHidden(), (torch.randn(2, 3, 4),))


def test_batchnorm_with_cumulative_average_traces():
    # momentum=None divides by float(num_batches_tracked): the tracer propagates with any
    # momentum (same shapes, same FLOPs), records None and leaves the module as it was
    def net(momentum):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())

    x = torch.randn(2, 3, 8, 8)
    model = net(None)
    graph, reference = trace(model, (x,)), trace(net(0.1), (x,))
    bn = next(n for n in graph if n.kind == "batchnorm2d")
    assert bn.attrs["momentum"] is None and model[1].momentum is None
    assert int(model[1].num_batches_tracked) == 0
    assert [(n.kind, n.shape, n.flops) for n in graph] == [(n.kind, n.shape, n.flops) for n in reference]
