"""fx adapters of the recurrent modules: nn.LSTM, nn.GRU, nn.RNN called on a sequence alone."""

from __future__ import annotations

import torch
import torch.nn as nn

from soapsearch._fx.base import FxOp, arg, for_modules, val


@for_modules(nn.LSTM, nn.GRU, nn.RNN)
def _recurrent(node, mod) -> FxOp | None:
    x = arg(node, 0, "input")
    if not isinstance(val(x), torch.Tensor) or arg(node, 1, "hx") is not None:
        return None  # a PackedSequence, or an initial state given
    if mod.dropout > 0 and mod.num_layers > 1:
        return None  # dropout between layers is random: a split run could not equal one device
    attrs = {"input_size": mod.input_size, "hidden_size": mod.hidden_size,
             "num_layers": mod.num_layers, "bias": mod.bias, "batch_first": mod.batch_first,
             "bidirectional": mod.bidirectional}
    if isinstance(mod, nn.LSTM):
        kind, attrs["proj_size"] = "lstm", mod.proj_size
    elif isinstance(mod, nn.GRU):
        kind = "gru"
    else:
        kind, attrs["nonlinearity"] = "rnn", mod.nonlinearity
    weights = [(name, f"{node.target}.{name}") for name, _ in mod.named_parameters(recurse=False)]
    return FxOp(kind, [x], attrs, weights=weights)
