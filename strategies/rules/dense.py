"""Rules of the dense ops: linear, matmul, embedding and attention."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import Dim, OpNode
from strategies.region import Box, box_shape
from strategies.rules.base import (Reduce, SplitAll, broadcast_region, dim_named, no_reduce,
                                   register)


@register("linear")
class Linear(SplitAll):
    """y[..., o] = Σ_i x[..., i] · W[o, i] + b[o]: leading dims as x, out_features a P dim,
    in_features an R dim (a cut of it is Megatron-LM's row-parallel linear, Shoeybi et al. 2019:
    each partition reads its columns of x and W and holds a Partial sum; the bias is added by
    the partitions whose in_features range starts at 0 only, so it is summed once)."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        n = len(node.output.shape)
        return tuple(
            dim_named(i, sample, "out_features" if i == n - 1 else ("seq" if n > 2 else f"d{i}"),
                      "parameter" if i == n - 1 else "attribute", s)
            for i, s in enumerate(node.output.shape)
        ) + (Dim("in_features", node.input_specs[0].shape[-1], "reduction"),)

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        n = len(node.output.shape)
        return (box[:n - 1] + (box[n],),)

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        n = len(node.output.shape)
        out = {"weight": (box[n - 1], box[n])}
        if node.weight("bias") is not None and box[n][0] == 0:
            out["bias"] = (box[n - 1],)
        return out

    def gemm_size(self, node: OpNode, box: Box) -> int | None:
        """min(rows, out_features, in_features) of [rows, in] × [in, out] (its cut's sizes)."""
        shape = box_shape(box)
        return min(math.prod(shape[:-2]), shape[-2], shape[-1])

    def gemm_shape(self, node: OpNode, box: Box) -> tuple[int, int, int, int] | None:
        """One product [rows, in] × [in, out]: rows the leading dims' cut, out and in their cuts."""
        shape = box_shape(box)
        return 1, math.prod(shape[:-2]), shape[-2], shape[-1]

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return F.linear(inputs[0], weights["weight"], weights.get("bias"))


@register("matmul")
class MatMul(SplitAll):
    """C[..., i, j] = Σ_k A[..., i, k] · B[..., k, j] (torch.matmul): batch dims broadcast, no
    weights; k is an R dim (a cut of it leaves each partition a Partial sum of its C region)."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        n = len(node.output.shape)
        names = {n - 2: "rows", n - 1: "cols"}
        return tuple(dim_named(i, sample, names.get(i, f"batch{i}"), "attribute", s)
                     for i, s in enumerate(node.output.shape)
                     ) + (Dim("inner", node.input_specs[0].shape[-1], "reduction"),)

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        a, b = (s.shape for s in node.input_specs)
        n = len(node.output.shape)
        lead, inner = box[:n - 2], box[n]
        return (broadcast_region(lead, a[:-2], len(lead)) + (box[n - 2], inner),
                broadcast_region(lead, b[:-2], len(lead)) + (inner, box[n - 1]))

    def gemm_size(self, node: OpNode, box: Box) -> int | None:
        """min(rows, cols, inner) of each [rows, inner] × [inner, cols] product (its cut's sizes)."""
        shape = box_shape(box)
        return min(shape[-3], shape[-2], shape[-1])

    def gemm_shape(self, node: OpNode, box: Box) -> tuple[int, int, int, int] | None:
        """The batch dims' cut products [rows, inner] × [inner, cols] (torch's batched product);
        an operand without batch (its batch dims missing or of size 1) is folded, as torch.matmul
        does: one product [batch·rows, inner] × [inner, cols], or [rows, ..] × [.., batch·cols]."""
        shape = box_shape(box)
        batch = math.prod(shape[:-3])
        a, b = (math.prod(s.shape[:-2]) for s in node.input_specs)
        if batch > 1 and b == 1:
            return 1, batch * shape[-3], shape[-2], shape[-1]
        if batch > 1 and a == 1:
            return 1, shape[-3], batch * shape[-2], shape[-1]
        return batch, shape[-3], shape[-2], shape[-1]

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return torch.matmul(inputs[0], inputs[1])


@register("embedding")
class Embedding(SplitAll):
    """y[..., e] = W[ids[...], e] (a row gather): embed_dim a P dim, the ids read as the box, the
    vocabulary rows an R dim: Megatron-LM's vocab-parallel embedding (Shoeybi et al. 2019), each
    partition looks up the ids in its row range and outputs zeros for the others, so the
    partitions' outputs are Partial sums whose sum is the lookup."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        n = len(node.output.shape)
        return tuple(
            dim_named(i, sample, "embed_dim" if i == n - 1 else ("seq" if n == 3 else f"d{i}"),
                      "parameter" if i == n - 1 else "attribute", s)
            for i, s in enumerate(node.output.shape)
        ) + (Dim("vocab", node.weight("weight").spec.shape[0], "reduction"),)

    def unsplittable(self, node: OpNode) -> set[int]:
        # scale_grad_by_freq divides each row's gradient by its id count over all the ids (and a
        # vocab cut would count its masked ids as row 0's)
        n = len(node.output.shape)
        return {i for i in range(n + 1) if i != n - 1} if node.attrs.get("scale_grad_by_freq") else set()

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box[:len(node.output.shape) - 1],)

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        n = len(node.output.shape)
        return {"weight": (box[n], box[n - 1])}

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        ids, w = inputs[0], weights["weight"]
        vocab = node.weight("weight").spec.shape[0]
        lo, hi = box[len(node.output.shape)]
        pad = a.get("padding_idx")
        if pad is not None and pad < 0:
            pad += vocab
        if (lo, hi) == (0, vocab):
            return F.embedding(ids, w, padding_idx=pad, scale_grad_by_freq=bool(a.get("scale_grad_by_freq")),
                               sparse=bool(a.get("sparse")))
        mine = (ids >= lo) & (ids < hi)
        local = (ids - lo).masked_fill(~mine, 0)
        out = F.embedding(local, w, padding_idx=pad - lo if pad is not None and lo <= pad < hi else None,
                          sparse=bool(a.get("sparse")))
        return out * mine.unsqueeze(-1).to(out.dtype)


@register("attention")
class Attention(SplitAll):
    """softmax(q·kᵀ·scale + mask)·v (Vaswani et al. 2017, eq. 1; torch
    ``F.scaled_dot_product_attention``, ``aten.scaled_dot_product_attention``). Output dims
    (..., heads, seq, head_dim); head_dim stays whole.

    inputs: (q, k, v) and, with ``has_mask``, ``attn_mask`` 4th. attrs:
      * ``is_causal`` (bool): query i sees keys j <= i (top-left aligned);
      * ``scale`` (float or None: 1/sqrt(head_dim));
      * ``enable_gqa`` (bool): grouped-query attention (Ainslie et al. 2023), q has Hq heads and
        k, v have Hkv, g = Hq / Hkv; q-head h reads kv-head h // g, so a partition of q-heads
        [h0, h1) reads kv-heads [h0 // g, (h1 - 1) // g + 1). ``check_degrees`` requires the
        heads degree to divide Hkv, so every partition holds whole groups and its local call
        (Hq/d q-heads over Hkv/d kv-heads) is the same grouping;
      * ``has_mask`` (bool): a boolean (True: attend) or additive float mask broadcast to
        (..., heads, L, S); a partition reads the region its box needs, rows [t0, t1) of L and
        every key (``broadcast_region``). Never together with ``is_causal`` (torch refuses).
    Every dim but head_dim may be cut: the sample and heads dims, and the queries (seq): a
    causal partition of query rows [t0, t1) reads keys [0, t1)."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        n = len(node.shape)
        names = {n - 2: "seq", n - 1: "head_dim", **({n - 3: "heads"} if n >= 4 else {})}
        return tuple(dim_named(i, sample, names.get(i, f"batch{i}"), "attribute", s)
                     for i, s in enumerate(node.shape))

    def unsplittable(self, node: OpNode) -> set[int]:
        return {len(node.shape) - 1}

    def check_degrees(self, node: OpNode, degrees: Sequence[int]) -> str | None:
        if not node.attrs.get("enable_gqa"):
            return None
        heads, kv = len(node.shape) - 3, node.input_specs[1].shape[-3]
        if kv % degrees[heads]:
            return (f"op {node.name!r}: degree {degrees[heads]} on dim 'heads'({node.shape[heads]}) "
                    f"does not divide the {kv} key/value heads of grouped-query attention "
                    f"({node.shape[heads]} // {kv} = {node.shape[heads] // kv} query heads per "
                    "group): a partition must hold whole groups")
        return None

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        q, k, v = (s.shape for s in node.input_specs[:3])
        lead, (t0, t1) = box[:-2], box[-2]
        keys = (0, min(t1, k[-2])) if node.attrs.get("is_causal") else (0, k[-2])
        k_lead, v_lead = (broadcast_region(lead, k[:-2], len(lead)),
                          broadcast_region(lead, v[:-2], len(lead)))
        if node.attrs.get("enable_gqa"):
            g = q[-3] // k[-3]
            h0, h1 = box[-3]
            kv_heads = (h0 // g, (h1 - 1) // g + 1)
            k_lead, v_lead = k_lead[:-1] + (kv_heads,), v_lead[:-1] + (kv_heads,)
        out = (broadcast_region(lead, q[:-2], len(lead)) + ((t0, t1), (0, q[-1])),
               k_lead + (keys, (0, k[-1])), v_lead + (keys, (0, v[-1])))
        if node.attrs.get("has_mask"):
            out += (broadcast_region(lead + ((t0, t1), keys), node.input_specs[3].shape, len(box)),)
        return out

    def gemm_size(self, node: OpNode, box: Box) -> int | None:
        """min(queries, keys, head_dim) of q·kᵀ and of its product with v."""
        return min(box[-2][1] - box[-2][0], node.input_specs[1].shape[-2], node.shape[-1])

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        q, k, v = inputs[:3]
        mask = inputs[3] if node.attrs.get("has_mask") else None
        causal, scale = bool(node.attrs.get("is_causal")), node.attrs.get("scale")
        gqa = bool(node.attrs.get("enable_gqa"))
        t0, t1 = box[-2]
        if causal and t0 > 0:  # the top-left causal mask of rows [0, t1) is torch's own
            rows = torch.arange(t0, t1, device=q.device)[:, None]
            mask, causal = torch.arange(k.shape[-2], device=q.device)[None, :] <= rows, False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=gqa)
