"""In-place writes: torch.export's graph is functionalized when a write lands in a tensor the
model reads (HF BART's and T5's ``shift_tokens_right``: ``shifted[:, 1:] = ids[:, :-1]``), so
the OpGraph computes the model's loss; torch.fx, which would drop such a write, refuses it."""

import math

import pytest
import torch
import torch.nn as nn

from soapsearch import TraceError, trace
from soapsearch.trace import trace_with_module
from tests.soapsearch.test_capture_hf import _graph_loss

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_seq2seq_shift_right_is_kept(family):
    from soapsearch import hf

    torch.manual_seed(0)
    model, inputs = hf.build(family)
    model = model.double()
    graph, module = trace_with_module(model, inputs)
    assert graph.capture == "export"
    assert [n.name for n in graph if n.kind == "opaque"] == []
    writes = [dict(n.attrs) for n in graph if n.kind == "slice_scatter"]
    assert writes == [{"dim": 1, "start": 1, "stop": 16, "select": False},   # [:, 1:] = ids[:, :-1]
                      {"dim": 1, "start": 0, "stop": 1, "select": True}]     # [:, 0] = start token
    with torch.no_grad():
        expected, got = model(*inputs), _graph_loss(graph, module, inputs)
    assert got.dtype == torch.float64
    assert math.isclose(got.item(), expected.item(), rel_tol=1e-10), (got.item(), expected.item())


class Writes(nn.Module):
    """Writes into a slice, a select (a constant, a broadcast row, a cast) and masked_fill_."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)                                     # [B, 6, 8]
        out = torch.zeros_like(h)
        out[:, 1:] = h[:, :-1]                             # copy_ into a slice
        out[:, 0] = 0.5                                    # fill_ into a select
        out[:, 2] = h[:, 0, :1]                            # [B, 1] broadcast to [B, 8]
        out.masked_fill_(out > 0.25, 0.25)
        counts = torch.zeros(x.shape[0], 8, dtype=torch.long)
        counts[:, 2:] = h[:, 0, 2:] > 0                    # bool cast to long
        return (out * out).mean() + counts.sum() / 100


def test_writes_of_an_exported_model_give_its_output():
    torch.manual_seed(0)
    model, x = Writes().double(), torch.randn(4, 6, 8, dtype=torch.float64)
    graph, module = trace_with_module(model, (x,), capture="export")
    kinds = [n.kind for n in graph]
    assert kinds.count("slice_scatter") == 4 and kinds.count("expand") == 2
    assert graph.batch_size == 4
    assert all(n.sample_dim == 0 for n in graph if n.kind == "slice_scatter")
    with torch.no_grad():
        expected, got = model(x), _graph_loss(graph, module, (x,))
    assert math.isclose(got.item(), expected.item(), rel_tol=1e-10), (got.item(), expected.item())


class BatchNormThenWrite(nn.Module):
    """A functionalized graph whose BatchNorm writes its running statistics back."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        h = self.bn(self.conv(x))
        h[:, :, 0] = 0.0
        return h.square().sum()


def test_batch_norm_beside_a_write_stays_a_batch_norm():
    torch.manual_seed(0)
    model, x = BatchNormThenWrite().double(), torch.randn(4, 3, 6, 6, dtype=torch.float64)
    graph, module = trace_with_module(model, (x,), capture="export")
    assert [n.kind for n in graph] == ["input", "conv2d", "batchnorm2d", "constant", "expand",
                                       "slice_scatter", "elementwise", "opaque"]
    with torch.no_grad():
        got, expected = _graph_loss(graph, module, (x,)), model(x)
    assert math.isclose(got.item(), expected.item(), rel_tol=1e-10), (got.item(), expected.item())


class InPlace(nn.Module):
    """``h.add_(1.0)`` or ``h.masked_fill_(h > 0, 0.0)``: results unused, h read after."""

    def __init__(self, masked: bool):
        super().__init__()
        self.fc, self.masked = nn.Linear(8, 8), masked

    def forward(self, x):
        h = self.fc(x)
        if self.masked:
            h.masked_fill_(h > 0, 0.0)
        else:
            h.add_(1.0)
        return h.sum()


@pytest.mark.parametrize("masked, op, line", [
    (False, ".add_()", "h.add_(1.0)"), (True, ".masked_fill_()", "h.masked_fill_(h > 0, 0.0)")])
def test_fx_refuses_a_write_it_would_drop(masked, op, line):
    with pytest.raises(TraceError) as err:
        trace(InPlace(masked), (torch.randn(4, 6, 8),), capture="fx")
    msg = str(err.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith(f"op '{'masked_fill_' if masked else 'add_'}' ({op}) at ")
    assert "test_capture_mutation.py" in msg and line in msg
    assert "write it out of place" in msg and 'capture="export"' in msg


def test_fx_cannot_write_into_a_slice_so_auto_exports():
    """A Proxy takes no item assignment: fx fails to capture, auto falls back to export."""
    with pytest.raises(TraceError, match="'Proxy' object does not support item assignment"):
        trace(Writes(), (torch.randn(4, 6, 8),), capture="fx")
    graph = trace(Writes(), (torch.randn(4, 6, 8),))
    assert graph.capture == "export" and sum(n.kind == "slice_scatter" for n in graph) == 4
