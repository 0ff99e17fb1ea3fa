"""Rules of the sliding-window ops on NCHW tensors: conv2d, pool2d and adaptive_pool2d.

Spatial splits read a halo: output rows [h0, h1) of a window op (kernel k, stride s, padding p
before the first row, dilation d) read input rows [h0*s - p, (h1-1)*s - p + d*(k-1) + 1). A
partition reads that range clipped to [0, H), pads the rows the clip dropped itself (zeros for
a conv or an average, -inf for a max) and runs the op with padding 0, which is exact.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from strategies.graph import Dim, OpNode
from strategies.region import Box, box_shape
from strategies.rules.base import Reduce, SplitAll, dim_named, no_reduce, register

__all__ = ["halo", "param_tensors", "param_shape"]

_NAMES = ("n", "channel", "height", "width")


def halo(lo: int, hi: int, size: int, k: int, s: int, p: int, d: int
         ) -> tuple[tuple[int, int] | None, tuple[int, int]]:
    """Input rows [lo*s - p, (hi-1)*s - p + d*(k-1) + 1) that output rows [lo, hi) read, as the
    range clipped to [0, size) (None: only padding) and the (before, after) rows the clip dropped."""
    a, b = lo * s - p, (hi - 1) * s - p + d * (k - 1) + 1
    start, stop = max(a, 0), min(b, size)
    if start >= stop:
        return None, (b - a, 0)
    return (start, stop), (start - a, b - stop)


def param_tensors(node: OpNode, inputs: Sequence[torch.Tensor | None],
                  weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An op's parameters by role: its module weights, plus the tensors a functional call got
    as inputs after the first (their roles listed in ``attrs["param_inputs"]``)."""
    out = dict(weights)
    out.update(zip(node.attrs.get("param_inputs", ()), inputs[1:]))
    return out


def param_shape(node: OpNode, role: str) -> tuple[int, ...] | None:
    """Shape of the parameter ``role``, whether a module weight or a functional input."""
    w = node.weight(role)
    if w is not None:
        return w.spec.shape
    roles = tuple(node.attrs.get("param_inputs", ()))
    return node.input_specs[1 + roles.index(role)].shape if role in roles else None


def _spatial(node: OpNode, box: Box, kernel: Sequence[int]):
    """Per spatial dim: the input range read (None: only padding) and the padding it needs."""
    a = node.attrs
    return [halo(*box[2 + i], node.input_specs[0].shape[2 + i], kernel[i], a["stride"][i],
                 a["padding"][i], a["dilation"][i]) for i in range(2)]


def _read_padded(x: torch.Tensor | None, shape: Sequence[int], spatial, value: float,
                 like: torch.Tensor | None) -> torch.Tensor:
    """The halo region with the clipped rows and columns padded back (value ``value``)."""
    if x is None:  # every row (or column) this partition reads is padding
        sizes = [0 if r is None else r[1] - r[0] for r, _ in spatial]
        x = torch.zeros(*shape, *sizes, dtype=like.dtype if like is not None else torch.float32)
    (_, (ph0, ph1)), (_, (pw0, pw1)) = spatial
    return F.pad(x, (pw0, pw1, ph0, ph1), value=value) if ph0 or ph1 or pw0 or pw1 else x


class _Window(SplitAll):
    """NCHW dims: sample, channel, height, width."""

    channel_role = "attribute"

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        return tuple(dim_named(i, sample, _NAMES[i], self.channel_role if i == 1 else "attribute", s)
                     for i, s in enumerate(node.shape))

    def exact(self, node: OpNode) -> bool:
        """Whether a spatial split with explicit padding reproduces the op exactly."""
        return True

    def unsplittable(self, node: OpNode) -> set[int]:
        return set() if self.exact(node) else {2, 3}


@register("conv2d")
class Conv2d(_Window):
    """Conv2d: output rows [h0,h1) read input rows [h0*s - p, (h1-1)*s - p + d*(k-1) + 1) ∩ [0, H);
    out channels [c0,c1) read W[c0:c1] and the in channels of their groups.

    y[n, o] = Σ_i W[o, i] ⋆ x[n, i] + b[o]: the input channels are an R dim (``in_channels``,
    after the output's four). A cut of it (groups == 1 only: a grouped conv's partition reads the
    in channels of its out channels' groups) reads its channels [i0, i1) of x and W and holds
    a Partial sum of its output box; the bias is added by the partitions whose range starts at
    0 only, so it is summed once (as a row-parallel linear's).

    attrs: stride, padding (before the first row/col; the after side follows from the output
    size, it differs only for a resolved 'same'), padding_hi, dilation, groups, padding_mode;
    ``param_inputs`` when weight/bias came as tensors to F.conv2d."""

    channel_role = "parameter"

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        return super().dims(node, sample) + (Dim("in_channels", node.input_specs[0].shape[1], "reduction"),)

    def exact(self, node: OpNode) -> bool:
        return node.attrs["padding_mode"] == "zeros"

    def _groups(self, node: OpNode, c0: int, c1: int) -> tuple[tuple[int, int], int]:
        g = node.attrs["groups"]
        og, ig = node.shape[1] // g, node.input_specs[0].shape[1] // g
        if c0 % og == 0 and c1 % og == 0:
            return (c0 // og * ig, c1 // og * ig), (c1 - c0) // og
        if c0 // og == (c1 - 1) // og:
            return (c0 // og * ig, (c0 // og + 1) * ig), 1
        raise ValueError(f"op {node.name!r}: out channels [{c0}, {c1}) are neither whole groups "
                         f"nor inside one group ({g} groups of {og})")

    def _in_channels(self, node: OpNode, box: Box) -> tuple[tuple[int, int], int]:
        """The in channels the partition computing ``box`` reads, and the groups of its call."""
        if node.attrs["groups"] == 1:
            return box[4], 1
        return self._groups(node, *box[1])

    def check_degrees(self, node: OpNode, degrees: Sequence[int]) -> str | None:
        g, c, dc = node.attrs["groups"], node.shape[1], degrees[1]
        if g > 1 and degrees[4] > 1:
            return (f"op {node.name!r}: degree {degrees[4]} on dim 'in_channels'({node.shape[4]}) of a conv "
                    f"with {g} groups: only a conv with groups=1 sums over all its input channels "
                    "(a grouped conv's partition reads the in channels of its out channels' groups)")
        if g > 1 and dc > 1 and g % dc and dc % g:
            return (f"op {node.name!r}: degree {dc} on dim 'channel'({c}) cuts its {g} groups of "
                    f"{c // g} out channels unevenly: {c // dc} channels per partition must be "
                    f"whole groups or part of one group (the degree must divide {g} or be a "
                    f"multiple of it)")
        return None

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box | None, ...]:
        cin, _ = self._in_channels(node, box)
        k = param_shape(node, "weight")[2:]
        if self.exact(node):
            spatial = _spatial(node, box, k)
            x = None if any(r is None for r, _ in spatial) else (box[0], cin) + tuple(r for r, _ in spatial)
        else:
            x = (box[0], cin) + tuple((0, s) for s in node.input_specs[0].shape[2:])
        return (x,) + tuple(self._param_region(node, role, box) for role in node.attrs.get("param_inputs", ()))

    def gemm_size(self, node: OpNode, box: Box) -> int | None:
        """min(batch·pixels, out channels per group, in channels per group · kernel) of the
        products a convolution lowers to (im2col); None for a depthwise one (one channel per
        group: a direct, memory-bound kernel, not a product)."""
        shape, w = box_shape(box), param_shape(node, "weight")
        per_group = node.shape[1] // node.attrs["groups"]
        if per_group == 1 or w[1] == 1:
            return None
        cin = shape[4] if node.attrs["groups"] == 1 else w[1]
        return min(shape[0] * math.prod(shape[2:4]), min(shape[1], per_group), cin * math.prod(w[2:]))

    def gemm_shape(self, node: OpNode, box: Box) -> tuple[int, int, int, int] | None:
        """cuDNN's implicit GEMM (Chetlur et al. 2014): per group of the call one product
        [batch·pixels, in channels per group · kernel] × [.., out channels per group]; None for a
        depthwise conv (``gemm_size``)."""
        if self.gemm_size(node, box) is None:
            return None
        shape, w = box_shape(box), param_shape(node, "weight")
        if node.attrs["groups"] == 1:
            groups, cin = 1, shape[4]
        else:
            groups, cin = self._groups(node, *box[1])[1], w[1]
        return groups, shape[0] * math.prod(shape[2:4]), shape[1] // groups, cin * math.prod(w[2:])

    def _param_region(self, node: OpNode, role: str, box: Box) -> Box | None:
        """W[c0:c1, i0:i1] (a grouped conv: every in channel of its groups); the bias where the
        in channels start at 0 only (None elsewhere: it is added once)."""
        if role == "bias":
            return (box[1],) if box[4][0] == 0 else None
        cin = box[4] if node.attrs["groups"] == 1 else (0, param_shape(node, role)[1])
        return (box[1], cin) + tuple((0, s) for s in param_shape(node, role)[2:])

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        regions = {w.role: self._param_region(node, w.role, box) for w in node.weights}
        return {role: r for role, r in regions.items() if r is not None}

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        p = param_tensors(node, inputs, weights)
        w = p["weight"]
        cin, groups = self._in_channels(node, box)
        if self.exact(node):
            spatial = _spatial(node, box, w.shape[2:])
            x = _read_padded(inputs[0], (box[0][1] - box[0][0], cin[1] - cin[0]), spatial, 0.0, w)
        else:
            (ph, pw), (qh, qw) = a["padding"], a["padding_hi"]
            x = F.pad(inputs[0], (pw, qw, ph, qh), mode=a["padding_mode"])
        return F.conv2d(x, w, p.get("bias"), tuple(a["stride"]), 0, tuple(a["dilation"]), groups)


@register("pool2d")
class Pool2d(_Window):
    """Max/avg pool2d: output rows [h0,h1) read input rows [h0*s - p, (h1-1)*s - p + d*(k-1) + 1)
    ∩ [0, H), padded with -inf (max) or zeros (avg counting the padding); every channel apart.

    attrs: mode (max|avg), kernel, stride, padding, dilation, ceil_mode, count_include_pad,
    divisor_override, return_indices (the indices are not an output of the op)."""

    def exact(self, node: OpNode) -> bool:
        a = node.attrs
        if a["return_indices"]:
            return False  # indices are flat over the whole plane
        if a["mode"] == "max" or a["divisor_override"] is not None:
            return True  # -inf padding / a fixed divisor: a partial window computes the same
        if not a["count_include_pad"] and any(a["padding"]):
            return False  # the divisor counts only the real elements of each window
        # with ceil_mode, a window that runs past H + p divides by fewer than k*k
        return not any(
            (o - 1) * s - p + k > n + p
            for o, n, k, s, p in zip(node.shape[2:], node.input_specs[0].shape[2:], a["kernel"],
                                     a["stride"], a["padding"]))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box | None, ...]:
        if not self.exact(node):
            return (box[:2] + tuple((0, s) for s in node.input_specs[0].shape[2:]),)
        spatial = _spatial(node, box, node.attrs["kernel"])
        return (None if any(r is None for r, _ in spatial) else box[:2] + tuple(r for r, _ in spatial),)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        a = node.attrs
        k, s, d = tuple(a["kernel"]), tuple(a["stride"]), tuple(a["dilation"])
        x = inputs[0]
        if not self.exact(node):
            if a["mode"] == "max":
                return F.max_pool2d(x, k, s, tuple(a["padding"]), d, a["ceil_mode"])
            return F.avg_pool2d(x, k, s, tuple(a["padding"]), a["ceil_mode"], a["count_include_pad"],
                                a["divisor_override"])
        spatial = _spatial(node, box, k)
        lead = (box[0][1] - box[0][0], box[1][1] - box[1][0])
        if a["mode"] == "max":
            x = _read_padded(x, lead, spatial, float("-inf"), x)
            return F.max_pool2d(x, k, s, 0, d)
        x = _read_padded(x, lead, spatial, 0.0, x)
        return F.avg_pool2d(x, k, s, 0, False, True, a["divisor_override"])


@register("adaptive_pool2d")
class AdaptivePool2d(_Window):
    """Adaptive max/avg pool2d: bin i of n over H is [floor(i*H/n), ceil((i+1)*H/n)); when n
    divides H the bins are regular and output rows [h0,h1) read input rows [h0*H/n, h1*H/n).

    attrs: mode (max|avg), return_indices."""

    def unsplittable(self, node: OpNode) -> set[int]:
        if node.attrs["return_indices"]:
            return {2, 3}
        return {i for i in (2, 3) if node.input_specs[0].shape[i] % node.shape[i]}

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        fixed = self.unsplittable(node)
        spatial = tuple((0, n) if i in fixed else (lo * (n // o), hi * (n // o))
                        for i, (lo, hi), n, o in zip((2, 3), box[2:], node.input_specs[0].shape[2:],
                                                      node.shape[2:]))
        return (box[:2] + spatial,)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        size = tuple(hi - lo for lo, hi in box[2:])
        if node.attrs["mode"] == "max":
            return F.adaptive_max_pool2d(inputs[0], size)
        return F.adaptive_avg_pool2d(inputs[0], size)
