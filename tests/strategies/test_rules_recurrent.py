import pytest
import torch
import torch.nn as nn

from soapsearch.trace import trace
from strategies.region import partition_boxes, slice_box
from strategies.rules import get_rule
from tests.strategies.rulecheck import adapt, check_model


class Seq(nn.Module):
    """An RNN layer as models call it: ``out, _ = rnn(x)``; seq-first ones transpose around it."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):  # [B, T, F]
        if self.rnn.batch_first:
            return self.rnn(x)[0]
        out, _ = self.rnn(x.transpose(0, 1))
        return out.transpose(0, 1)


CASES = [  # (kind, constructor arguments)
    ("lstm", dict(batch_first=True)),
    ("lstm", dict(num_layers=2, bidirectional=True, batch_first=True)),
    ("lstm", dict(num_layers=2)),
    ("lstm", dict(bidirectional=True, bias=False)),
    ("lstm", dict(num_layers=2, batch_first=True, proj_size=3)),
    ("gru", dict(batch_first=True)),
    ("gru", dict(num_layers=2, bidirectional=True)),
    ("rnn", dict(num_layers=2, nonlinearity="relu", batch_first=True, bias=False)),
]


MODULES = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_recurrent_batch_split_reproduces_output(kind, kw):
    torch.manual_seed(0)
    rnn, x = MODULES[kind](5, 6, **kw), torch.randn(8, 4, 5)
    node = next(n for n in trace(Seq(rnn), (x,)) if n.kind == kind)
    assert check_model(Seq(rnn), [x], {kind}) == 3  # the batch cut in 2, 4 and 8
    b = 0 if rnn.batch_first else 1
    hidden = (rnn.proj_size or rnn.hidden_size if kind == "lstm" else 6) * (1 + rnn.bidirectional)
    want = [("seq", 4, "attribute"), ("hidden", hidden, "attribute")]
    want.insert(b, ("sample", 8, "sample"))
    assert [(d.name, d.size, d.role) for d in node.dims] == want
    assert get_rule(kind).splittable(node) == tuple(i == b for i in range(3))
    assert sorted(w.role for w in node.weights) == sorted(n for n, _ in rnn.named_parameters())
    box = ((0, 4), (0, 4), (0, hidden))  # the first half of the batch, whichever dim it is
    assert get_rule(kind).input_regions(node, box) == (box[:2] + ((0, 5),),)
    assert get_rule(kind).weight_regions(node, box)["weight_hh_l0"] == \
        ((0, rnn.weight_hh_l0.shape[0]), (0, rnn.weight_hh_l0.shape[1]))


def test_lstm_stack_of_layers_like_the_zoo():
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 6)
            self.layers = nn.ModuleList(nn.LSTM(6, 6, batch_first=True) for _ in range(3))

        def forward(self, ids):
            x = self.emb(ids)
            for lstm in self.layers:
                x, _ = lstm(x)
            return x

    assert check_model(Stack(), [torch.randint(0, 20, (8, 4))], {"lstm"}) == 9


def test_partition_gradients_sum_to_the_full_gradients():
    """forward is differentiable: the batch partitions' weight gradients add up to one device's."""
    torch.manual_seed(0)
    rnn = nn.LSTM(5, 6, num_layers=2, bidirectional=True).double()
    x = torch.randn(4, 8, 5, dtype=torch.float64)  # [T, B, F]
    node = next(n for n in trace(Seq(rnn), (x.transpose(0, 1),)) if n.kind == "lstm")
    out, _ = rnn(x)
    out.square().sum().backward()
    ws = {n: p.detach().clone().requires_grad_() for n, p in rnn.named_parameters()}
    xs = x.clone().requires_grad_()
    rule = get_rule("lstm")
    for box in partition_boxes(node.shape, (1, 4, 1)):
        (region,) = rule.input_regions(node, box)
        rule.forward(node, box, [xs[slice_box(region)]], ws).square().sum().backward()
    for n, p in rnn.named_parameters():
        torch.testing.assert_close(ws[n].grad, p.grad, atol=1e-10, rtol=1e-9)
    assert xs.grad is not None and xs.grad.abs().sum() > 0


def _adapt(model, inputs, target):
    return adapt(model, inputs, target)[0]


def test_opaque_cases():
    x = torch.randn(8, 4, 5)

    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(5, 6, batch_first=True)

        def forward(self, x):
            h = torch.zeros(1, x.shape[0], 6)
            return self.rnn(x, (h, h))[0]

    assert _adapt(WithState(), [x], "rnn") is None
    assert _adapt(Seq(nn.GRU(5, 6, num_layers=2, dropout=0.5, batch_first=True)), [x], "rnn") is None
    assert _adapt(Seq(nn.GRU(5, 6, batch_first=True)), [x], "rnn").kind == "gru"
    rnn = Seq(nn.GRU(5, 6, batch_first=True))  # batch_first is moot for an unbatched [T, F]
    unbatched = next(n for n in trace(rnn, (torch.randn(4, 5),)) if n.kind == "gru")
    assert get_rule("gru").splittable(unbatched) == (False, False)
