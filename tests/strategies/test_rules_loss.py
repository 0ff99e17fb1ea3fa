import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.trace import trace
from strategies.rules import Reduction, get_rule
from tests.strategies.rulecheck import adapt, check_model


def _losses(model, inputs):
    return [n for n in trace(model, inputs) if n.kind == "loss"]


def _targets(shape, classes, ignore=-100):
    t = torch.randint(0, classes, shape)
    t.view(-1)[: t.numel() // 4] = ignore  # the first quarter ignored: whole partitions count 0
    t.view(-1)[-1] = ignore
    return t


class Classifier(nn.Module):
    """Logits [N, C] from a linear layer, losses as classifiers write them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.register_buffer("cw", torch.rand(6) + 0.5)
        self.weighted = nn.CrossEntropyLoss(weight=torch.rand(6) + 0.5, ignore_index=2)

    def forward(self, x, t):
        logits = self.fc(x)
        return (F.cross_entropy(logits, t),
                F.cross_entropy(logits, t, reduction="sum"),
                F.cross_entropy(logits, t.clamp(min=0), ignore_index=2),
                F.cross_entropy(logits, t, weight=self.cw),
                self.weighted(logits, t.clamp(min=0)),
                F.cross_entropy(logits, t, label_smoothing=0.1),
                F.cross_entropy(logits, t, weight=self.cw, label_smoothing=0.2))


def test_cross_entropy_classifier_variants():
    torch.manual_seed(0)
    x, t = torch.randn(24, 5), _targets((24,), 6)
    # 24 samples cut in 2, 3, 4, 6, 8; 6 classes in 2, 3, 6 (vocab-parallel; weights, smoothing)
    assert check_model(Classifier(), [x, t], {"loss"}) == 7 * 8
    ops = _losses(Classifier(), (x, t))
    assert [(d.name, d.size, d.role) for d in ops[0].dims] == [("sample", 24, "sample"),
                                                                ("classes", 6, "reduction")]
    assert ops[0].output.shape == () and get_rule("loss").splittable(ops[0]) == (True, True)
    assert dict(ops[0].attrs) == {"fn": "cross_entropy", "reduction": "mean", "ignore_index": -100,
                                  "label_smoothing": 0.0}
    assert [w.name for w in ops[3].weights] == ["cw"]
    assert [w.name for w in ops[4].weights] == ["weighted.weight"]
    assert ops[4].attrs["ignore_index"] == 2 and ops[5].attrs["label_smoothing"] == 0.1
    assert get_rule("loss").input_regions(ops[0], ((8, 16), (0, 6))) == (((8, 16), (0, 6)), ((8, 16),))
    assert get_rule("loss").input_regions(ops[0], ((8, 16), (2, 4))) == (((8, 16), (2, 4)), ((8, 16),))
    assert get_rule("loss").weight_regions(ops[3], ((8, 16), (2, 4))) == {"class_weight": ((2, 4),)}
    assert get_rule("loss").reductions(ops[0], (4, 1)) == (Reduction("loss_sum", (0,), deferred=True),)
    assert get_rule("loss").reductions(ops[0], (1, 1)) == ()
    assert get_rule("loss").reductions(ops[0], (4, 3)) == (
        Reduction("class_max", (1,)), Reduction("class_sum", (1,)), Reduction("loss_sum", (0, 1), deferred=True))


class LanguageModel(nn.Module):
    """Next-token loss of a language model: logits [B, T, V] flattened to [B*T, V]."""

    def __init__(self, vocab=10):
        super().__init__()
        self.vocab, self.emb, self.head = vocab, nn.Embedding(vocab, 4), nn.Linear(4, vocab)

    def forward(self, ids, targets):
        logits = self.head(self.emb(ids))
        flat = F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1), ignore_index=-1)
        return flat, F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction="sum")


def test_cross_entropy_language_model_and_k_dim():
    torch.manual_seed(0)
    ids, t = torch.randint(0, 10, (4, 6)), _targets((4, 6), 10, ignore=-1)
    assert check_model(LanguageModel(), [ids, t], {"loss"}, count=12) == 12 + 10  # every grid of the k-dim one
    flat, kdim = _losses(LanguageModel(), (ids, t))
    assert flat.shape == (24, 10) and kdim.shape == (4, 6, 10)
    assert [(d.name, d.role) for d in kdim.dims] == [("sample", "sample"), ("d1", "attribute"),
                                                     ("classes", "reduction")]
    box = ((2, 4), (3, 6), (5, 10))
    assert get_rule("loss").input_regions(kdim, box) == (((2, 4), (5, 10), (3, 6)), box[:2])
    assert get_rule("loss").reductions(kdim, (2, 3, 1)) == (Reduction("loss_sum", (0, 1), deferred=True),)


def test_cross_entropy_k_dim_mean_with_module():
    torch.manual_seed(0)

    class Seg(nn.Module):  # per-pixel classes: logits [N, C, H, W], targets [N, H, W]
        def __init__(self):
            super().__init__()
            self.conv, self.loss = nn.Conv2d(3, 5, 1), nn.CrossEntropyLoss(ignore_index=4)

        def forward(self, x, t):
            return self.loss(self.conv(x), t)

    x, t = torch.randn(4, 3, 4, 6), torch.randint(0, 5, (4, 4, 6))
    assert check_model(Seg(), [x, t], {"loss"}, count=16) == 16


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.mse = nn.Linear(5, 6), nn.MSELoss(reduction="sum")

    def forward(self, x, y):
        pred = self.fc(x)
        return F.mse_loss(pred, y), self.mse(pred, y)


def test_mse():
    torch.manual_seed(0)
    x, y = torch.randn(4, 6, 5), torch.randn(4, 6, 6)
    assert check_model(Regression(), [x, y], {"loss"}, count=14) == 2 * 14
    mean, total = _losses(Regression(), (x, y))
    assert mean.shape == (4, 6, 6) and get_rule("loss").splittable(mean) == (True,) * 3
    assert dict(total.attrs) == {"fn": "mse_loss", "reduction": "sum"}
    box = ((0, 2), (3, 6), (0, 6))
    assert get_rule("loss").input_regions(mean, box) == (box, box)
    # a micro-batch's mean divides by its own element count: 4·6·6 / m
    assert [get_rule("loss").static_count(mean, m) for m in (1, 2, 4)] == [144.0, 72.0, 36.0]
    assert get_rule("loss").static_count(total, 2) == 1.0


def _adapt(model, inputs, target):
    return adapt(model, inputs, target)


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_opaque_cases():
    class Odd(nn.Module):
        def forward(self, x, t, y):
            return (F.cross_entropy(x, t, reduction="none").sum(),  # per-sample losses
                    F.cross_entropy(x, y.softmax(-1)),  # class-probability targets
                    F.cross_entropy(x, t, weight=y[0].abs()),  # computed class weights
                    F.mse_loss(x, y[:1]),  # broadcast target
                    F.mse_loss(x, y, reduction="none").mean())

    x, y, t = torch.randn(4, 6), torch.randn(4, 6), torch.randint(0, 6, (4,))
    assert _adapt(Odd(), [x, t, y], F.cross_entropy) == [None] * 3
    assert _adapt(Odd(), [x, t, y], F.mse_loss) == [None] * 2
    assert _adapt(Regression(), [torch.randn(4, 5), y], F.mse_loss)[0].kind == "loss"
