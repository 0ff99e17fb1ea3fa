"""Rules of the normalizations: batchnorm2d, layernorm, softmax and log_softmax."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import Dim, OpNode
from strategies.region import Box, full_box
from strategies.rules.base import Reduce, Reduction, SplitAll, dim_named, no_reduce, register
from strategies.rules.conv import param_shape, param_tensors

_STATS_DIMS = (0, 2, 3)  # N, H, W of an NCHW batchnorm: the dims its batch statistics cover


def uses_batch_stats(node: OpNode) -> bool:
    """torch's rule: a batchnorm normalizes with the batch's statistics when training or when it
    tracks no running statistics."""
    return bool(node.attrs["training"] or not node.attrs["track_running_stats"])


@register("batchnorm2d")
class BatchNorm2d(SplitAll):
    """BatchNorm2d (Ioffe & Szegedy 2015): y = (x - mean) / sqrt(var + eps) * w + b per channel,
    with mean = Σx / (N*H*W) and the biased var = Σ(x - mean)² / (N*H*W) over the whole batch,
    summed across the partitions of split sample/height/width dims (two reductions; the first
    also sums the element count N*H*W, so a micro-batch normalizes with its own statistics).

    Forward never touches the running statistics: the executor updates them after the step with
    running_mean = (1-momentum)*running_mean + momentum*mean and running_var = (1-momentum)*
    running_var + momentum*var*n/(n-1) (the unbiased var, n = N*H*W), as torch does.

    attrs: eps, momentum, training, track_running_stats."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        names = ("n", "channel", "height", "width")
        role = "parameter" if node.weights else "attribute"
        return tuple(dim_named(i, sample, names[i], role if i == 1 else "attribute", s)
                     for i, s in enumerate(node.shape))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,)

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        return {w.role: (box[1],) for w in node.weights}

    def reductions(self, node: OpNode, degrees: Sequence[int]) -> tuple[Reduction, ...]:
        over = tuple(i for i in _STATS_DIMS if degrees[i] > 1)
        return (Reduction("batch_stats", over),) if over and uses_batch_stats(node) else ()

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        x, eps = inputs[0], node.attrs["eps"]
        w, b = weights.get("weight"), weights.get("bias")
        if not uses_batch_stats(node):
            return F.batch_norm(x, weights["running_mean"], weights["running_var"], w, b, False,
                                0.0, eps)
        acc = x if x.dtype in (torch.float32, torch.float64) else x.float()  # as torch: fp32 stats
        # the element count travels with the first sum, so a micro-batch counts only itself
        local = acc.new_full((1,), x.numel() // max(x.shape[1], 1))
        total = reduce(torch.cat([acc.sum(dim=_STATS_DIMS), local]))
        mean, count = total[:-1] / total[-1], total[-1]
        centered = acc - mean[None, :, None, None]
        var = reduce((centered * centered).sum(dim=_STATS_DIMS)) / count
        y = centered * torch.rsqrt(var + eps)[None, :, None, None]
        if w is not None:
            y = y * w[None, :, None, None]
        if b is not None:
            y = y + b[None, :, None, None]
        return y.to(x.dtype)


def _named(node: OpNode, sample: int | None, special: Mapping[int, tuple[str, str]]) -> tuple[Dim, ...]:
    """Dims: ``special`` (index -> name, role), the sample dim, and the rest 'seq' when there is
    one of them, else d<i>."""
    rest = [i for i in range(len(node.shape)) if i != sample and i not in special]
    return tuple(
        Dim(special[i][0], s, special[i][1]) if i in special
        else dim_named(i, sample, "seq" if len(rest) == 1 else f"d{i}", "attribute", s)
        for i, s in enumerate(node.shape))


@register("layernorm")
class LayerNorm(SplitAll):
    """LayerNorm (Ba et al. 2016): y = (x - mean) / sqrt(var + eps) * w + b with mean and the
    biased var over the trailing ``normalized_shape`` dims, which therefore stay whole; every
    leading dim may be cut.

    attrs: normalized_shape, eps; ``param_inputs`` when weight/bias came as tensors to
    F.layer_norm."""

    def _normalized(self, node: OpNode) -> range:
        n = len(node.shape)
        return range(n - len(node.attrs["normalized_shape"]), n)

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        norm = self._normalized(node)
        return _named(node, sample, {
            i: ("features" if len(norm) == 1 else f"features{j}", "parameter")
            for j, i in enumerate(norm)})

    def unsplittable(self, node: OpNode) -> set[int]:
        return set(self._normalized(node))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,) + tuple(full_box(param_shape(node, r)) for r in node.attrs.get("param_inputs", ()))

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        return {w.role: full_box(w.spec.shape) for w in node.weights}

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        p = param_tensors(node, inputs, weights)
        return F.layer_norm(inputs[0], tuple(node.attrs["normalized_shape"]), p.get("weight"),
                            p.get("bias"), node.attrs["eps"])


@register("softmax", "log_softmax")
class Softmax(SplitAll):
    """softmax(x)_i = exp(x_i) / Σ_j exp(x_j) along ``dim`` (log_softmax: its log): that dim
    stays whole, every other dim may be cut.

    attrs: dim (non-negative), dtype (the dtype torch computes in, or None)."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        return _named(node, sample, {node.attrs["dim"]: ("softmax", "attribute")}
                      if node.attrs["dim"] != sample else {})

    def unsplittable(self, node: OpNode) -> set[int]:
        return {node.attrs["dim"]}

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return (box,)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        dtype = node.attrs.get("dtype")
        fn = F.log_softmax if node.kind == "log_softmax" else F.softmax
        return fn(inputs[0], node.attrs["dim"], dtype=getattr(torch, dtype) if dtype else None)
