"""``nn.MultiheadAttention`` traced through a re-implementation made of ops that have rules, so
it is planned (heads, sequence, batch cuts) instead of running whole on one device.

What ``F.multi_head_attention_forward`` computes (Vaswani et al. 2017, section 3.2.2):

    q, k, v = query·W_qᵀ + b_q, key·W_kᵀ + b_k, value·W_vᵀ + b_v
              (W_q, W_k, W_v: row blocks of in_proj_weight, or q/k/v_proj_weight)
    head_h  = softmax(q_h·k_hᵀ / sqrt(head_dim) + mask)·v_h     (dropout on the softmax)
    out     = concat(head_1, ..., head_H)·W_oᵀ + b_o             (out_proj, a Linear)
    weights = the softmax (after dropout), averaged over heads unless average_attn_weights=False

Each projection is ``torch.matmul(x, w.t()) + b`` on a slice of the parameter read with
get_attr (a ``parameter`` op feeding ``slice``, ``permute``, ``matmul`` and ``add`` ops), so the
weights keep their ``state_dict`` names (``attn.in_proj_weight``, ``attn.out_proj.weight``) and
a plan's weight regions map onto the user's module. Attention is one
``F.scaled_dot_product_attention`` op when nothing needs the softmax itself; with dropout in
training, a mask that is not the causal hint, or attention weights the caller reads, it is
computed explicitly (matmul, softmax, dropout, matmul). Which one the caller needs is known only
once the whole model is traced: ``Inliner.settle`` keeps one and erases what nobody reads.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Inliner"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


@dataclass
class _Call:
    """The nodes one traced call created and the three it may choose between."""

    nodes: list[fx.Node]
    args: list[fx.Node]  # the nodes it was called with (a mask buffer the fused kernel skips)
    fast: fx.Node | None  # scaled_dot_product_attention's output, [.., H, L, head_dim]
    slow: fx.Node | None  # softmax(...)·v, the same value computed explicitly
    weights: fx.Node | None  # the attention weights returned to the caller


class Inliner:
    """Traces calls of ``nn.MultiheadAttention`` for an ``fx.Tracer``: ``forward_for`` gives
    the function to trace instead of the module (None: keep the module a leaf), ``settle`` then
    removes from the finished graph what the caller did not read."""

    def __init__(self, tracer: fx.Tracer) -> None:
        self.tracer = tracer
        self.calls: list[_Call] = []

    def forward_for(self, mod: nn.Module, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
        """A thunk tracing ``mod(*args, **kwargs)`` op by op, or None when ``mod`` is not an
        ``nn.MultiheadAttention`` this re-implementation computes exactly (bias_k/bias_v,
        add_zero_attn, a key_padding_mask, a mask whose dtype the tracer cannot know where
        it is needed)."""
        if (not isinstance(mod, nn.MultiheadAttention)
                or type(mod).forward is not nn.MultiheadAttention.forward):
            return None
        try:
            bound = _SIGNATURE.bind(mod, *args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        a = dict(bound.arguments)
        flags = (a["need_weights"], a["average_attn_weights"], a["is_causal"])
        if (mod.bias_k is not None or mod.bias_v is not None or mod.add_zero_attn
                or a["key_padding_mask"] is not None
                or not all(isinstance(f, bool) for f in flags)):
            return None
        mask, causal = a["attn_mask"], a["is_causal"]
        if causal and mask is None:
            return None  # torch asks for the mask with the hint; the module raises its own error
        dropout = mod.training and mod.dropout > 0.0
        mask_known = mask is None or self._mask_value(mask) is not None
        fast = not dropout and (mask is None or causal)
        if not mask_known and (not fast or a["need_weights"]):
            return None
        return lambda: self._trace(mod, a, fast, dropout)

    def _mask_value(self, mask: Any) -> torch.Tensor | None:
        """The mask itself when the tracer knows it (a tensor, a buffer, a constant), else None."""
        if isinstance(mask, torch.Tensor) and not isinstance(mask, fx.Proxy):
            return mask
        node = getattr(mask, "node", None)
        if isinstance(node, fx.Node) and node.op == "get_attr":  # getattr would give a proxy
            root = self.tracer.root
            return {**dict(root.named_buffers()), **dict(root.named_parameters())}.get(node.target)
        return None

    def _trace(self, mod: nn.MultiheadAttention, a: dict[str, Any], fast_ok: bool,
               dropout: bool) -> tuple[Any, Any]:
        graph = self.tracer.graph
        before = set(graph.nodes)
        H, E = mod.num_heads, mod.embed_dim
        bias = mod.in_proj_bias
        if mod._qkv_same_embed_dim:
            w = mod.in_proj_weight
            ws = (w[0:E], w[E:2 * E], w[2 * E:3 * E])
        else:
            ws = (mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight)
        bs = (None,) * 3 if bias is None else (bias[0:E], bias[E:2 * E], bias[2 * E:3 * E])
        moved: dict[int, Any] = {}  # self-attention moves its one input once
        for x in (a["query"], a["key"], a["value"]):
            moved.setdefault(id(x), _batch_first(x, mod.batch_first))
        q, k, v = (_heads(_project(moved[id(x)], w_, b_), H)
                   for x, w_, b_ in zip((a["query"], a["key"], a["value"]), ws, bs))
        fast = (F.scaled_dot_product_attention(q, k, v, is_causal=a["is_causal"]) if fast_ok
                else None)
        slow = weights = None
        if not fast_ok or a["need_weights"]:
            scores = torch.matmul(q * (1.0 / math.sqrt(mod.head_dim)), k.transpose(-2, -1))
            if a["attn_mask"] is not None:
                scores = self._masked(scores, a["attn_mask"], H)
            probs = torch.softmax(scores, dim=-1)
            if dropout:
                probs = F.dropout(probs, p=mod.dropout, training=True)
            slow = torch.matmul(probs, v)
            if a["need_weights"]:
                weights = probs.mean(dim=-3) if a["average_attn_weights"] else probs
        y = fast if fast is not None else slow
        out = mod.out_proj(y.transpose(-3, -2).flatten(-2))
        out = out if mod.batch_first else out.movedim(-2, 0)
        args = [n for n in map(_node, a.values()) if n is not None]
        self.calls.append(_Call([n for n in graph.nodes if n not in before], args, _node(fast),
                                _node(slow), _node(weights)))
        return out, weights

    def _masked(self, scores: Any, mask: Any, heads: int) -> Any:
        """scores with ``attn_mask`` applied as torch does: a bool mask's True is -inf, a float
        mask is added; an [N·H, L, S] mask is viewed as [N, H, L, S]."""
        m = self._mask_value(mask)
        if m.dim() == 3 and m.shape[0] != 1:
            mask = mask.unflatten(0, (-1, heads))
        return scores.masked_fill(mask, float("-inf")) if m.dtype == torch.bool else scores + mask

    def settle(self, graph: fx.Graph) -> None:
        """For each traced call: when the caller reads the attention weights, the output takes
        the explicit product (the softmax is computed anyway) instead of the fused kernel; then
        every node the call created is erased while nobody reads it, and so is a buffer read
        only to be passed to it."""
        for call in self.calls:
            if call.fast is not None and call.weights is not None and call.weights.users:
                call.fast.replace_all_uses_with(call.slow)
        candidates = [n for call in self.calls
                      for n in call.nodes + [a for a in call.args if a.op == "get_attr"]]
        erased: set[fx.Node] = set()
        while dead := [n for n in dict.fromkeys(candidates) if n not in erased and not n.users]:
            for n in dead:
                graph.erase_node(n)
                erased.add(n)
        self.calls = []


def _node(p: Any) -> fx.Node | None:
    return p.node if isinstance(p, fx.Proxy) else None


def _batch_first(x: Any, batch_first: bool) -> Any:
    """[L, N, E] -> [N, L, E] (a 2-D unbatched [L, E] is left as it is)."""
    return x if batch_first else x.movedim(0, -2)


def _project(x: Any, w: Any, b: Any) -> Any:
    """x·wᵀ + b (``F.linear``) with the weight a tensor the graph computes (a slice)."""
    y = torch.matmul(x, w.t())
    return y if b is None else y + b


def _heads(x: Any, heads: int) -> Any:
    """[.., L, E] -> [.., H, L, E / H]."""
    return x.unflatten(-1, (heads, -1)).transpose(-3, -2)
