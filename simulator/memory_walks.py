"""The activations' walk of a plan's memory (``simulator.memory``): per device, the peak of the
activations, collective buffers and gradient buckets it holds over its run order, from the ops'
rows (``simulator.memory_rows``), the collectives' (``simulator.memory_collectives``) and its
passes (``strategies.schedule``)."""

from __future__ import annotations

import itertools
import operator
from typing import NamedTuple

import numpy as np

from simulator.memory_collectives import bucket_rows, collective_rows
from simulator.memory_rows import Columns, columns_of, dropped_rows, held_rows, piece_rows
from strategies.chunks import pipeline_chunks
from strategies.lowering import Lowered
from strategies.drops import drop_positions, key_readers
from strategies.schedule import chunk_of, rank_passes, warmups

__all__ = ["activation_peaks", "device_warmups", "Walked", "Walks"]

_dropped = operator.attrgetter("dropped")
_POSITIONS: dict[int, tuple[object, dict[str, int]]] = {}


def _positions(graph) -> dict[str, int]:
    """Op -> its index in graph order, kept for the last few graphs (a search asks for one)."""
    hit = _POSITIONS.get(id(graph))
    if hit is None or hit[0] is not graph:
        if len(_POSITIONS) > 8:
            _POSITIONS.clear()
        hit = _POSITIONS[id(graph)] = (graph, {node.name: i for i, node in enumerate(graph)})
    return hit[1]


def activation_peaks(lowered: Lowered, ws: dict[int, int] | None = None, collectives: bool = True,
                     buckets: bool = True) -> list[int]:
    """Per device, the peak of the activations it holds over its run order
    (``strategies.schedule.passes``: w warm-up forwards, then backward and forward in turn).
    A forward pass of a micro-batch adds, op by op in graph order, what each op keeps
    (``OpPieces.activations``) and its dropped or transient outputs (``OpPieces.dropped``),
    each freed after its last consumer's forward there; a backward pass, in reverse, adds a
    dropped output back where it is recomputed (a transient one never comes back) and frees
    what each op kept (and its recomputed output) after its backward
    (``strategies.drops.drop_points``). With ``collectives``, the collectives' buffers walk
    alike (``simulator.memory_collectives``: each call's result, kept or transient, and its
    readers' gradients until the dual). Every
    micro-batch's passes are alike, so with K kept per micro-batch, r_f the forward pass's
    highest rise and r_b the backward pass's, the peak is max((w − 1)·K + r_f, w·K + r_b);
    without dropped outputs or collectives r_f = K and r_b = 0: w·K. With ``buckets``, the
    last backward pass (the last micro-batch's, one in flight) also holds the level-0/1
    gradient buckets' flat tensors from each one's issue to the step's sync
    (``simulator.memory_collectives.bucket_rows``): K + r_last (``_last_rise``). ``ws``:
    ``warmups(lowered)``, where the caller has it. Under the interleaved schedule a pass is one
    chunk's (``_interleaved_peaks``)."""
    return Walks(lowered, ws).peaks(collectives, buckets)


class Walked(NamedTuple):
    """One set of rows (without or with the collectives) and what its walk reads of them."""

    rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """held, freed, redone, gone (``_rows``)."""
    kept: list[int]
    """Per column (``memory_rows.Columns``; a device's where not folded), K: the bytes kept per micro-batch in flight."""
    rise_f: list[int]
    """Per column, a forward pass's highest rise over its start (``_rises``)."""
    rise_b: list[int]
    """Per column, a backward pass's highest rise over its start."""


class _LastDrops(NamedTuple):
    """The last plan ``_drop_positions`` saw for a graph."""

    graph: object
    configs: tuple
    """Its (name, config) pairs."""
    recompute: bool
    """Whether one of them recomputes (no patch from such a plan)."""
    positions: dict
    """Its ``drop_positions`` (shared: read only)."""


class Walks:
    """``activation_peaks``'s walks of one lowering, what they share made once: the ops' rows
    (``simulator.memory_rows.piece_rows`` per device, patched, shared and read-only, which
    ``_rows(base=...)`` relies on; ``dropped_rows`` where folded), with the collectives' added
    (``_rows``), each set's kept bytes and rises (``memory_breakdown`` walks without the
    collectives, with them, and with the buckets). Under the interleaved schedule each walk is
    ``_interleaved_peaks``' own: nothing is shared."""

    def __init__(self, lowered: Lowered, ws: dict[int, int] | None) -> None:
        self.lowered, self.ws = lowered, device_warmups(lowered) if ws is None else ws
        self.columns = columns_of(lowered, len(lowered.device_bytes.kept))
        self.walked: dict[bool, Walked] = {}  # collectives -> its walk

    def walk(self, collectives: bool) -> Walked:
        got = self.walked.get(collectives)
        if got is None:
            base = self.walk(False).rows if collectives else None
            rows = _rows(self.lowered, collectives, base, self.columns)
            kept = (rows[0].sum(axis=0) - rows[1].sum(axis=0)).tolist()  # b.kept, and the kept collective results
            got = self.walked[collectives] = Walked(rows, kept, *(x.tolist() for x in _rises(*rows)))
        return got

    def peaks(self, collectives: bool, buckets: bool) -> list[int]:
        """``activation_peaks(lowered, ws, collectives, buckets)``."""
        lowered, ws = self.lowered, self.ws
        if lowered.strategy.schedule == "interleaved":
            return _interleaved_peaks(lowered, collectives, buckets)
        b, columns = lowered.device_bytes, self.columns
        n = len(b.kept)
        of = range(n) if columns is None else columns.of
        issued = _issued(lowered, columns, n) if buckets else None
        if not any(map(_dropped, lowered.pieces.values())) and not (collectives and lowered.collectives):
            out = [ws.get(d, 0) * k for d, k in enumerate(b.kept)]  # the search's hot path: one C-level pass
            if issued is None:
                return out
            # the last pass only frees, so it rises over w·K only where K + the buckets' bytes do
            total = issued.sum(axis=0).tolist()
            if all(p >= k + total[c] for p, k, c in zip(out, b.kept, of)):
                return out
        rows, kept, rise_f, rise_b = self.walk(collectives)
        last = _last_rise(rows[2], rows[3], issued).tolist() if issued is not None else None
        out = []
        for d, c in enumerate(of):
            w, k = ws.get(d, 0), kept[c]
            peak = max((w - 1) * k + rise_f[c], w * k + rise_b[c]) if w else 0
            out.append(max(peak, k + last[c]) if w and last is not None else peak)
        return out


def _issued(lowered: Lowered, columns: Columns | None, n: int) -> np.ndarray | None:
    """``bucket_rows`` with every device's columns, or the representatives' (``columns``, of
    copy 0's lowering: the copies run alike); None without level-0/1 buckets."""
    return bucket_rows(lowered, _positions(lowered.graph), n, columns)


def _last_rise(redone: np.ndarray, gone: np.ndarray, issued: np.ndarray) -> np.ndarray:
    """Per device, the last backward pass's highest rise over its start: the backward walk of
    ``_rises`` with the buckets issued after each op's backward (``issued``) held from there on,
    and their sum at the pass's end (everything kept freed, every bucket held to the sync)."""
    level = np.cumsum(redone[::-1], axis=0)
    level[1:] -= np.cumsum(gone[::-1], axis=0)[:-1]
    level[1:] += np.cumsum(issued[::-1], axis=0)[:-1]
    end = redone.sum(axis=0) - gone.sum(axis=0) + issued.sum(axis=0)
    return np.maximum(np.maximum(level.max(axis=0), end), 0)


def _rows(lowered: Lowered, collectives: bool = True, base: tuple | None = None, columns: Columns | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ops in graph order) x devices: the bytes each op's forward adds (what it keeps and its
    dropped or transient outputs), the dropped and transient bytes freed after each op's
    forward, those recomputed at each op's backward (``strategies.drops.drop_points``) and
    those freed after it (what it keeps and its recomputed output: a transient one, read by no
    backward, was freed in the forward, ``strategies.drops.transient``); with ``collectives``,
    the collectives' buffers besides (``simulator.memory_collectives``). ``base``: the rows
    without the collectives, where made already (read only). ``columns``: of a folded lowering,
    the representatives' columns only (``memory_rows.Columns``, ``columns_of``)."""
    n = len(lowered.device_bytes.kept)
    rows = _op_rows(lowered, columns) if base is None else base
    extra = collective_rows(lowered, _positions(lowered.graph), n, columns) if collectives else None
    if extra is None:
        return rows
    return tuple(a + b for a, b in zip(rows, extra))


def _op_rows(lowered: Lowered, columns: Columns | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_rows`` without the collectives. Every device's rows are patched from the last
    plan's (``simulator.memory_rows.piece_rows``): read them only."""
    graph, pieces = lowered.graph, lowered.pieces
    position = _positions(graph)
    ops = list(map(pieces.__getitem__, position))
    n = len(lowered.device_bytes.kept)
    drops = _drop_positions(graph, lowered.strategy, position)
    if lowered.copies is None:
        return piece_rows(lowered, ops, position, drops)
    held, at = held_rows(ops, n, columns)  # the representatives' stand for every device (a weight op keeps nothing)
    return dropped_rows(lowered, ops, held, at, columns, drops, position)


def _drop_positions(graph, strategy, position: dict[str, int]) -> dict[str, list[tuple[tuple[int, ...], int, int]]]:
    """``strategies.drops.drop_positions``, patched from the last one of ``graph`` (a search's
    last plan): where neither plan recomputes, an op's entry reads its own and its consumers'
    devices only, so the entries found again are those of the ops whose devices changed and of
    their producers (``key_readers``); else every entry. The plans' (name, config) pairs are
    compared by identity first (``Strategy.replace`` keeps the unchanged ones). The result is
    shared: read it only."""
    configs = strategy.configs
    last = _DROPS.get(id(graph))
    if last is None or last.graph is not graph or len(last.configs) != len(configs) or last.recompute:
        out, recompute = drop_positions(graph, strategy, position), any(c.recompute for _, c in configs)
    else:
        pairs = [(configs[i], last.configs[i]) for i in
                 itertools.compress(range(len(configs)), map(operator.is_not, configs, last.configs))]
        recompute = any(new[1].recompute for new, _ in pairs)
        if recompute:
            out = drop_positions(graph, strategy, position)
        else:
            changed = {name for pair in pairs if _drop_key(pair[0]) != _drop_key(pair[1]) for name, _ in pair}
            again = changed.union(*(key_readers(graph, name) for name in changed))
            out = {name: groups for name, groups in last.positions.items() if name not in again}
            out.update(drop_positions(graph, strategy, position, again))
    if len(_DROPS) > 8:
        _DROPS.clear()
    _DROPS[id(graph)] = _LastDrops(graph, configs, recompute, out)
    return out


def _drop_key(pair: tuple) -> tuple:
    """What an op's drop entries read of its (name, config) pair."""
    return pair[0], pair[1].devices, pair[1].recompute


_DROPS: dict[int, _LastDrops] = {}
"""Graph id -> the last plan ``_drop_positions`` saw for it."""


def _rises(held: np.ndarray, freed: np.ndarray, redone: np.ndarray, gone: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Per device, a forward pass's highest rise over its start and a backward pass's."""
    fwd = np.cumsum(held, axis=0)  # the level after op i's adds: Σ adds to i − Σ frees before i
    fwd[1:] -= np.cumsum(freed, axis=0)[:-1]
    bwd = np.cumsum(redone[::-1], axis=0)  # reverse order: Σ recomputed to i − Σ freed before i
    bwd[1:] -= np.cumsum(gone[::-1], axis=0)[:-1]
    return np.maximum(fwd.max(axis=0), 0), np.maximum(bwd.max(axis=0), 0)


def _interleaved_peaks(lowered: Lowered, collectives: bool = True, buckets: bool = True) -> list[int]:
    """Per device, the activations' peak over its interleaved run order (Narayanan et al.
    SC'21, section 2.2.2: more passes in flight than 1F1B): each (micro-batch, chunk) pass adds
    or frees its chunk's K_c, the chunk's ops' rows of ``_rows`` giving its rises, walked over
    ``strategies.schedule.rank_passes``; with ``buckets``, a backward pass of the last
    micro-batch issues its chunk's gradient buckets (``_last_rise``), held from there to the end.
    The walk is a function of the pipeline rank's passes and the device's per-chunk figures:
    devices of one pipeline rank with the same figures (a fold's copies and members) are walked once."""
    chunk = chunk_of(lowered)
    n = len(lowered.device_bytes.kept)
    columns = columns_of(lowered, n)
    held, freed, redone, gone = _rows(lowered, collectives, None, columns)
    issued = _issued(lowered, columns, n) if buckets else None
    if issued is None:
        issued = np.zeros_like(held)
    last_mb = lowered.strategy.microbatches - 1
    kept = held - freed  # a chunk's dropped outputs are freed at ops of the chunk (one pipeline rank runs it)
    of = np.fromiter((chunk[node.name] for node in lowered.graph), np.int64, len(lowered.graph))
    per = []  # per chunk: K_c, r_f, r_b, r_last and the buckets issued, each per device
    for c in range(int(of.max()) + 1):
        mask = (of == c)[:, None]
        f, r = _rises(held * mask, freed * mask, redone * mask, gone * mask)
        last = _last_rise(redone * mask, gone * mask, issued * mask)
        per.append(np.stack(((kept * mask).sum(axis=0), f, r, last, (issued * mask).sum(axis=0))))
    figures = np.stack(per, axis=1)  # (figure, chunk, column)
    ranks = pipeline_chunks(lowered.graph, lowered.strategy)
    order = rank_passes(lowered.graph, lowered.strategy)
    walked: dict[tuple[int, bytes], int] = {}  # a device's peak: its pipeline rank's passes and its figures
    out = [0] * n
    for d in lowered.strategy.devices_used:
        rank = ranks.rank[d]
        c = d if columns is None else columns.of[d]
        key = (rank, figures[:, :, c].tobytes())
        if key not in walked:
            walked[key] = _interleaved_walk(order[rank], figures[:, :, c].tolist(), last_mb)
        out[d] = walked[key]
    return out


def _interleaved_walk(passes: list[tuple[bool, int, int]], figures: list[list[int]], last_mb: int) -> int:
    """One device's peak over its interleaved ``passes`` given its per-chunk ``figures``
    (K_c, r_f, r_b, r_last, the buckets issued: ``_interleaved_peaks``)."""
    k, rise_f, rise_b, last, total = figures
    level = peak = synced = 0  # synced: the buckets issued so far, held to the step's sync
    for backward, j, c in passes:
        if backward and j == last_mb:
            peak = max(peak, level + synced + last[c])
            synced += total[c]
        else:
            peak = max(peak, level + synced + (rise_b if backward else rise_f)[c])
        level += -k[c] if backward else k[c]
    return peak


def device_warmups(lowered: Lowered) -> dict[int, int]:
    """``strategies.schedule.warmups`` of every device; of copy 0's lowering (``Lowered.copies``),
    a device of copy r has its copy-0 image's (the copies run alike)."""
    ws = warmups(lowered)
    if lowered.copies is None:
        return ws
    image = lowered.copies.representative
    return {d: ws[image.get(d, d)] for d in ws}
