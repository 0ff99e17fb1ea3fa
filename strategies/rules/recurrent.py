"""Rules of the recurrent ops: lstm, gru and rnn (the output sequence of nn.LSTM / GRU / RNN)."""

from __future__ import annotations

import functools
import threading
from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from strategies.graph import Dim, OpNode
from strategies.region import Box
from strategies.rules.base import OpRule, Reduce, no_reduce, register

_MODULES = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
GATES = {"lstm": 4, "gru": 3, "rnn": 1}
"""Gate blocks of a cell's weight matrices (torch: W_ih is [gates·hidden, in])."""
_CALL = threading.Lock()  # functional_call swaps the shared module's tensors while it runs


@functools.lru_cache(maxsize=None)
def _meta_module(kind: str, config: tuple) -> nn.Module:
    """A weightless module of ``kind`` and ``config`` (sorted attr items) to run with given weights."""
    with torch.device("meta"):
        return _MODULES[kind](**dict(config), dropout=0.0)


def _batch_dim(node: OpNode) -> int | None:
    if len(node.shape) != 3:
        return None  # an unbatched sequence [T, F]
    return 0 if node.attrs.get("batch_first") else 1


@register("lstm", "gru", "rnn")
class Recurrent(OpRule):
    """h_t = cell(x_t, h_{t-1}; all weights) (Hochreiter & Schmidhuber 1997): only the batch may be cut."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        b, n = _batch_dim(node), len(node.shape)
        out = []
        for i, s in enumerate(node.shape):
            if i == b:
                out.append(Dim("sample", s, "sample") if sample == b else Dim("batch", s, "attribute"))
            else:
                out.append(Dim("hidden" if i == n - 1 else "seq", s, "attribute"))
        return tuple(out)

    def splittable(self, node: OpNode) -> tuple[bool, ...]:
        b = _batch_dim(node)
        return tuple(i == b for i in range(len(node.shape)))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box[:-1] + ((0, node.input_specs[0].shape[-1]),),)

    def gemm_size(self, node: OpNode, box: Box) -> int | None:
        """min(batch, hidden, input size) of each step's [batch, in] × [in, gates·hidden] products."""
        b = _batch_dim(node)
        batch = box[b][1] - box[b][0] if b is not None else 1
        return min(batch, node.shape[-1], node.input_specs[0].shape[-1])

    def gemm_shape(self, node: OpNode, box: Box) -> tuple[int, int, int, int] | None:
        """Each step's product [batch, in + hidden] × [in + hidden, gates·hidden] (x_t and h_{t-1}
        against W_ih and W_hh: the FLOPs the op counts, 2·batch·gates·hidden·(in + hidden) a step
        and layer), one at a time (a step waits on the last); the first layer's shape. The input
        product x_t·W_ih is charged per step too, though cuDNN runs it for all steps as one
        [seq·batch, in] product (Appleyard et al. 2016): a known gap, slower for thin batches."""
        b = _batch_dim(node)
        batch = box[b][1] - box[b][0] if b is not None else 1
        hidden = node.attrs["hidden_size"]
        state = node.attrs.get("proj_size") or hidden  # an LSTM with proj_size carries h of that size
        return 1, batch, GATES[node.kind] * hidden, node.input_specs[0].shape[-1] + state

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        config = tuple(sorted((k, v) for k, v in node.attrs.items()))
        module = _meta_module(node.kind, config)
        with _CALL:
            return functional_call(module, dict(weights), (inputs[0],))[0]
