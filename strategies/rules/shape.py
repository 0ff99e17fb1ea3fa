"""Rules of the ops that move data without computing: reshape/flatten, permute, slice, concat,
and the graph's leaves (input, parameter, constant).

Reshape groups the input and output dims into runs of equal product (the usual view
algorithm); within a group both sides are the same row-major run of elements, so an output box
maps to an input box exactly when its flat range is a box of the group's input dims.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import torch

from strategies.graph import Dim, OpNode
from strategies.region import Box, box_shape
from strategies.rules.base import Reduce, SplitAll, dim_named, no_reduce, register

__all__ = ["view_groups", "flat_to_box"]

Group = tuple[tuple[int, ...], tuple[int, ...]]  # (input dims, output dims)


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[Group]:
    """Input and output dims in runs of equal product; a size-1 dim at a run's edge is a run
    of its own (with no dim on the other side)."""
    if 0 in src or 0 in dst or math.prod(src) != math.prod(dst):
        return [(tuple(range(len(src))), tuple(range(len(dst))))]
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(((i,), ()))
            i += 1
        elif j < len(dst) and dst[j] == 1:
            groups.append(((), (j,)))
            j += 1
        else:
            gi, gj, pi, pj = [i], [j], src[i], dst[j]
            i, j = i + 1, j + 1
            while pi != pj:
                if pi < pj:
                    gi.append(i)
                    pi *= src[i]
                    i += 1
                else:
                    gj.append(j)
                    pj *= dst[j]
                    j += 1
            groups.append((tuple(gi), tuple(gj)))
    return groups


def flat_to_box(start: int, stop: int, sizes: Sequence[int]) -> Box | None:
    """The box of a row-major tensor of ``sizes`` holding exactly the flat range [start, stop),
    or None when that range is not a box."""
    for k in range(len(sizes) - 1, -1, -1):
        inner = math.prod(sizes[k + 1:])
        if start % inner or stop % inner:
            continue
        a, b, n = start // inner, stop // inner, sizes[k]
        if a // n != (b - 1) // n:
            continue  # crosses a row of the outer dims
        outer, idx = a // n, []
        for s in reversed(sizes[:k]):
            idx.append(outer % s)
            outer //= s
        return (tuple((c, c + 1) for c in reversed(idx)) + ((a % n, (b - 1) % n + 1),)
                + tuple((0, s) for s in sizes[k + 1:]))
    return None


def _flat_range(ranges: Sequence[tuple[int, int]], sizes: Sequence[int]) -> tuple[int, int] | None:
    """The flat range a box of a row-major run covers, or None when it is not contiguous."""
    t = next((t for t, (a, b) in enumerate(ranges) if b - a > 1), len(ranges) - 1)
    if any(r != (0, s) for r, s in zip(ranges[t + 1:], sizes[t + 1:])):
        return None
    start = sum(a * math.prod(sizes[u + 1:]) for u, (a, _) in enumerate(ranges))
    return start, start + (ranges[t][1] - ranges[t][0]) * math.prod(sizes[t + 1:])


def _group_region(src: Sequence[int], dst: Sequence[int], group: Group, box: Box) -> Box | None:
    gi, gj = group
    if not gi:
        return ()
    flat = _flat_range([box[j] for j in gj], [dst[j] for j in gj]) if gj else (0, 1)
    return None if flat is None else flat_to_box(*flat, [src[i] for i in gi])


@functools.lru_cache(maxsize=1024)
def _view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[Group, ...]:
    return tuple(view_groups(src, dst))


@functools.lru_cache(maxsize=1 << 16)
def _group_box(src: tuple[int, ...], dst: tuple[int, ...], ranges: Box) -> Box | None:
    """``_group_region`` of a group whose input dims have sizes ``src``, output dims ``dst`` and
    ``ranges`` of the box: it reads nothing else, so a partition of another micro-batch or
    sample block with the same ranges in this group reuses it."""
    return _group_region(src, dst, (tuple(range(len(src))), tuple(range(len(dst)))), ranges)


@functools.lru_cache(maxsize=4096)
def _reshape_problem(src: tuple[int, ...], dst: tuple[int, ...], degrees: tuple[int, ...]) -> str | None:
    """Why cutting the output of a reshape ``src`` -> ``dst`` by ``degrees`` gives a piece
    that is not a box of the input, or None."""
    for group in view_groups(src, dst):
        gi, gj = group
        if not gj or all(degrees[j] == 1 for j in gj) or (len(gi) == 1 and len(gj) == 1):
            continue  # untouched, or a dim kept 1:1
        what = (f"of the reshape of input dims {list(gi)} {[src[i] for i in gi]} into output "
                f"dims {list(gj)} {[dst[u] for u in gj]}")
        for j in gj[1:]:
            if degrees[j] > 1:
                return (f"output dim {j} ({dst[j]}) is an inner dim {what}: its pieces are not "
                        "boxes of the input")
        j, d = gj[0], degrees[gj[0]]
        for c in range(d):
            chunk = (c * dst[j] // d, (c + 1) * dst[j] // d)
            box = tuple(chunk if u == j else (0, dst[u]) for u in range(len(dst)))
            if _group_region(src, dst, group, box) is None:
                return (f"degree {d} on output dim {j} ({dst[j]}) {what}: piece {c} "
                        f"[{chunk[0]}, {chunk[1]}) does not fall on whole rows of the input")
    return None


@functools.lru_cache(maxsize=1024)
def _reshape_splittable(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[bool, ...]:
    def alone(j: int, d: int) -> tuple[int, ...]:
        return tuple(d if u == j else 1 for u in range(len(dst)))
    return tuple(any(_reshape_problem(src, dst, alone(j, d)) is None for d in _divisors(s))
                 for j, s in enumerate(dst))


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` greater than 1, smallest first."""
    small = [d for d in range(2, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n] + ([n] if n > 1 else [])


@register("reshape", "flatten")
class Reshape(SplitAll):
    """view/reshape/flatten: a dim splits where each chunk of it is a box of the input (a dim kept
    1:1, or the outermost dim of a run whose chunks are whole rows of the input)."""

    def splittable(self, node: OpNode) -> tuple[bool, ...]:
        return _reshape_splittable(node.input_specs[0].shape, node.shape)

    def check_degrees(self, node: OpNode, degrees: Sequence[int]) -> str | None:
        why = _reshape_problem(node.input_specs[0].shape, node.shape, tuple(degrees))
        return None if why is None else f"op {node.name!r}: {why}"

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        src, dst = node.input_specs[0].shape, node.shape
        region: list[tuple[int, int]] = [(0, s) for s in src]
        for group in _view_groups(src, dst):
            gi, gj = group
            sub = _group_box(tuple(src[i] for i in gi), tuple(dst[j] for j in gj), tuple(box[j] for j in gj))
            if sub is None:
                raise ValueError(f"op {node.name!r}: box {box} of a reshape {list(src)} -> "
                                 f"{list(dst)} is not a box of its input")
            for i, r in zip(group[0], sub):
                region[i] = r
        return (tuple(region),)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return inputs[0].reshape(box_shape(box))


@register("permute")
class Permute(SplitAll):
    """out = x.permute(perm): output dim i is input dim perm[i]; every dim splits."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        perm = node.attrs["perm"]
        region = [None] * len(perm)
        for i, p in enumerate(perm):
            region[p] = box[i]
        return (tuple(region),)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return inputs[0].permute(*node.attrs["perm"])


@register("slice")
class Slice(SplitAll):
    """x[index] with ints, slices and None: ``attrs["index"]`` has one entry per input dim (an
    int, or [start, stop, step] normalized) plus None for each new size-1 dim; output rows
    [a, b) of a slice read input rows [start + a*step, start + (b-1)*step + 1)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        region, j = [], 0
        for item in node.attrs["index"]:
            if item is None:
                j += 1
            elif isinstance(item, int):
                region.append((item, item + 1))
            else:
                start, _, step = item
                a, b = box[j]
                region.append((start + a * step, start + (b - 1) * step + 1) if b > a
                              else (start, start))
                j += 1
        return (tuple(region),)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        index = tuple(None if it is None else 0 if isinstance(it, int) else slice(None, None, it[2])
                      for it in node.attrs["index"])
        return inputs[0][index]


@register("concat")
class Concat(SplitAll):
    """torch.cat(xs, dim): every dim splits; on the concat dim an input reads only its rows
    that fall in the box (None when none do)."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box | None, ...]:
        dim, offset, out = node.attrs["dim"], 0, []
        a, b = box[dim]
        for spec in node.input_specs:
            n = spec.shape[dim]
            lo, hi = max(a, offset), min(b, offset + n)
            out.append(box[:dim] + ((lo - offset, hi - offset),) + box[dim + 1:] if lo < hi else None)
            offset += n
        return tuple(out)

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor | None],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return torch.cat([x for x in inputs if x is not None], dim=node.attrs["dim"])


@register("input")
class Input(SplitAll):
    """A model input (placeholder): every dim splits; it reads nothing."""

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return ()

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        raise RuntimeError(f"op {node.name!r} is a model input: it is not computed, the executor "
                           "slices the user's batch to the partition's box itself")


@register("parameter", "constant")
class Leaf(SplitAll):
    """A parameter or buffer read whole (get_attr): every dim splits, its weight region is the box."""

    def dims(self, node: OpNode, sample: int | None) -> tuple[Dim, ...]:
        return tuple(dim_named(i, sample, f"d{i}", "parameter", s) for i, s in enumerate(node.shape))

    def input_regions(self, node: OpNode, box: Box) -> tuple[Box, ...]:
        return ()

    def weight_regions(self, node: OpNode, box: Box) -> dict[str, Box]:
        return {w.role: box for w in node.weights}

    def forward(self, node: OpNode, box: Box, inputs: Sequence[torch.Tensor],
                weights: Mapping[str, torch.Tensor], reduce: Reduce = no_reduce) -> torch.Tensor:
        return weights["value"]

