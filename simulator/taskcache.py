"""The state ``simulator.tasks.build_tasks`` keeps between task graphs of one op graph (delta
simulation, see ``simulator.tasks``): each op's task block of the last graph and the ``KNOWN``
blocks built before it, by their pieces, and the blocks' arrays joined (``_Joined``), patched
where blocks changed; bounded by bytes as well as counts (``KNOWN_BYTES``, ``STATE_BYTES``), and
as a whole between graphs (``CACHE_BYTES``, ``TaskCache.trim``) by what its blocks keep alive
(``simulator.block_bytes``: their lists and pieces besides their arrays, each object once)."""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np

from simulator.block_bytes import HeldBytes, Uncounted, block_items
from simulator.cost import CostModel
from simulator.taskgraph import INDEX, Recorded, join
from simulator.topology import Topology
from strategies.graph import OpGraph, OpNode
from strategies.lowered import OpPieces

__all__ = ["CACHE_BYTES", "KNOWN", "KNOWN_BYTES", "STATE_BYTES", "TASK_BYTES", "TaskCache", "block_key", "block_bytes"]


class TaskCache:
    """Task blocks of one graph's ops on one topology timed by one cost model, reused while an
    op's lowered pieces are the same object (see ``simulator.tasks``' docstring)."""

    def __init__(self, topology: Topology, cost: CostModel, counted: bool = True):
        self.topology, self.cost = topology, cost
        self.wires: dict[tuple[int, int, int], tuple] = {}
        """(source, target, bytes) -> ``simulator.wires.Wire``: times and resources (a pure function of them)."""
        self.held = HeldBytes() if counted else Uncounted()
        """Every block the cache holds (the states' current and known blocks), what they keep
        alive counted once (``counted`` False: a cache for one call, never trimmed, counts
        nothing)."""
        self.gathers = Recorded()
        """Level-2/3 groups' tasks, recorded (``simulator.zero3._Chunk``: no block held)."""
        self._states: dict[frozenset[int] | None, list] = {}
        """Devices simulated (a folded plan's copy 0, ``simulator.fold``; None: all) -> [graph,
        its ``_layout``, the last ``_Joined``]: a search moving between folded and per-device
        plans keeps the blocks of both."""
        self.buckets: dict = {}
        """The graph's gradient buckets' ready steps (``strategies.overlap.bucket_plan``'s memo)."""
        self.step_tasks = Recorded()
        """Gradient buckets' step-end tasks, recorded (``simulator.step.link_step``'s memo)."""
        self._current: list = [None, ([], {}, [], [], []), None]
        self.known_bytes = 0
        """``HeldBytes.size`` of every state's known blocks (``_layout``), each block apart; past
        ``KNOWN_BYTES`` they are all dropped (``hold``)."""

    def hold(self, mine: dict, key: tuple, block: Any) -> None:
        """``block`` the most recently used of an op's known blocks ``mine`` (``KNOWN`` of them,
        the least recently used going first); past ``KNOWN_BYTES`` of known blocks in all, every
        state's known blocks dropped (a block built again is the same: speed, never results)."""
        was = mine.pop(key, None)
        mine[key] = block
        self.held.add(block)
        self.known_bytes += self.held.size(block)
        if was is not None:
            self._forget(was)
        while len(mine) > KNOWN:
            self._forget(mine.pop(next(iter(mine))))
        if self.known_bytes > KNOWN_BYTES:
            self._clear_known()

    def _forget(self, block: Any) -> None:
        """A known ``block`` let go."""
        self.known_bytes -= self.held.size(block)
        self.held.release(block)

    def _clear_known(self) -> None:
        """Every state's known blocks let go."""
        for state in self._states.values():
            for known in state[1][3]:
                for b in known.values():
                    self.held.release(b)
                known.clear()
        self.known_bytes = 0

    def nbytes(self) -> int:
        """What the cache holds, counted: what its blocks keep alive (``held``: the states'
        current and known blocks, with their lists and pieces, each object once), every state's
        joined arrays, and ``TASK_BYTES`` a task of the recorded gathers and step-end tasks."""
        held = self.held.nbytes + TASK_BYTES * (self.gathers.tasks + self.step_tasks.tasks)
        return held + sum(map(_state_bytes, self._states.values()))

    def trim(self, limit: int | None = None) -> bool:
        """Past ``limit`` (``CACHE_BYTES``) of ``nbytes``: the known blocks and every state but the
        current one dropped, and where the recorded gathers and step-end tasks still hold more
        than half of it, they and the buckets' memo too (the current graph's blocks stay: the
        next proposal's delta reads them). Each is built again the same when asked: speed, never
        results. Between graphs only. Whether anything was dropped."""
        limit = CACHE_BYTES if limit is None else limit
        if self.nbytes() <= limit:
            return False
        self._clear_known()
        for kept in [k for k, s in self._states.items() if s is not self._current]:
            self._drop(kept)
        if TASK_BYTES * (self.gathers.tasks + self.step_tasks.tasks) > limit // 2:
            self.gathers.clear()
            self.step_tasks.clear()
            self.buckets.clear()
        return True

    def reuse(self, mine: dict, key: tuple) -> Any:
        """The known block of ``mine`` under ``key``, taken out (None: none)."""
        b = mine.pop(key, None)
        if b is not None:
            self._forget(b)
        return b

    def layout(self, graph: OpGraph, kept: frozenset[int] | None = None) -> _Layout:
        """``_layout(graph)`` for the devices ``kept``, its blocks kept from the graphs built
        before for them; a new graph empties every state."""
        state = self._states.get(kept)
        if state is None or state[0] is not graph:
            if any(s[0] is not graph for s in self._states.values()):
                for kept_ in list(self._states):
                    self._drop(kept_)
                self.buckets.clear()
            held = sum(_state_bytes(s) for s in self._states.values())
            while self._states and (len(self._states) >= _STATES or held > STATE_BYTES):
                held -= self._drop(next(iter(self._states)))
            state = self._states[kept] = [graph, _layout(graph), None]
        self._current = state
        return state[1]

    def _drop(self, kept: frozenset[int] | None) -> int:
        """The state of the devices ``kept`` dropped; its ``_state_bytes``."""
        state = self._states.pop(kept)
        for known in state[1][3]:
            for b in known.values():
                self._forget(b)
        if state[2] is not None:
            for b in state[2].blocks:
                self.held.release(b)
        return _state_bytes(state)

    def join(self, blocks: list[Any]) -> "_Joined":
        """``blocks``' arrays joined, from the last graph's of the same devices (``_Joined``)."""
        state = self._current
        if state[2] is None:
            state[2] = _Joined(blocks)
            for b in blocks:
                self.held.add(b)
        else:
            was = state[2].blocks
            for i in state[2].update(blocks):
                self.held.add(blocks[i])
                self.held.release(was[i])
        return state[2]


_STATES = 8
"""Sets of simulated devices a ``TaskCache`` keeps blocks for (the oldest goes first)."""

STATE_BYTES = 128 << 20
"""The joined arrays (``_Joined``) of the states a ``TaskCache`` keeps besides the one it
starts: past them the oldest states go first. A state's arrays grow with the devices simulated
(a per-device plan of GPT-3 175B on 128 devices: 27 MB, its blocks with the pieces they hold
about 3.7x that), so a count alone does not bound a search's memory."""

CACHE_BYTES = 512 << 20
"""What a ``TaskCache`` holds in all (``TaskCache.nbytes``: what its blocks keep alive, each
object once, ``simulator.block_bytes``; the joined arrays; the recorded tasks) before ``trim``
drops the known blocks and the other states (and the recorded tasks where they hold half of
it): the bounds above are by part. The current state's blocks stay: at 1,024 devices one plan
simulated on its copies keeps 0.7-1.1 GiB alive alone, so the bound then fires after each
such simulation."""

TASK_BYTES = 200
"""Bytes one recorded task holds (``Columns``: six list slots, its duration float, its
resources tuple and label, about ``sys.getsizeof`` of each)."""

KNOWN_BYTES = 64 << 20
"""What the blocks a ``TaskCache`` keeps besides the last graphs' keep alive (``HeldBytes.size``,
each block apart), all states together: past it every known block is dropped."""


def block_bytes(block: Any) -> int:
    """What a block keeps alive, alone (``simulator.block_bytes.block_items``: its arrays, its
    columns' lists, its step lists, its pieces; a twin's shared lists counted again)."""
    return sum(size for _, size in block_items(block))


def _state_bytes(state: list) -> int:
    """What a state's joined arrays hold (0 before its first graph)."""
    return 0 if state[2] is None else _nbytes(state[2].arrays)


def _nbytes(arrays: tuple[np.ndarray, ...]) -> int:
    return sum(a.nbytes for a in arrays)


class _Joined:
    """The blocks of the last task graph built and their ``arrays`` joined block after block.
    A search's next graph has mostly the same blocks: the changed blocks' slices are replaced
    (one concatenation of 2k + 1 pieces per field for k changed blocks) rather than every
    block's arrays joined again, and what a graph reads of every block is kept beside them
    (patched at the changed blocks), so no pass over the blocks visits each one."""

    def __init__(self, blocks: list[Any]):
        self.blocks = blocks
        self.arrays = join([b.arrays for b in blocks])
        self.sizes = np.array([[a.shape[-1] for a in b.arrays] for b in blocks], dtype=np.int64)
        """Block x field: the length of the block's slice."""
        self.segments = [b.segment for b in blocks]
        self.summing = [i for i, b in enumerate(blocks) if b.step_reductions]
        """The positions of the blocks with sums only the end of the step waits on."""
        self.first = self._first()

    def _first(self) -> np.ndarray:
        """Each block's first task id (its tasks' place in the graph), and the task count last."""
        first = np.zeros(len(self.sizes) + 1, dtype=INDEX)
        np.cumsum(self.sizes[:, 2], dtype=INDEX, out=first[1:])  # field 2: durations, one per task
        return first

    def update(self, blocks: list[Any]) -> list[int]:
        """The joined arrays of ``blocks``; the positions whose block changed."""
        changed = list(itertools.compress(range(len(blocks)), map(operator.is_not, blocks, self.blocks)))
        if not changed:
            return changed
        bounds = np.zeros((len(blocks) + 1, self.sizes.shape[1]), dtype=np.int64)
        np.cumsum(self.sizes, axis=0, out=bounds[1:])
        starts, stops = bounds[changed].T.tolist(), bounds[[i + 1 for i in changed]].T.tolist()
        joined = []
        for f, whole in enumerate(self.arrays):
            pieces, at = [], 0
            for i, start, stop in zip(changed, starts[f], stops[f]):
                pieces += (whole[..., at:start], blocks[i].arrays[f])
                at = stop
            joined.append(np.concatenate(pieces + [whole[..., at:]], axis=-1))
        for i in changed:
            self.sizes[i] = [a.shape[-1] for a in blocks[i].arrays]
            self.segments[i] = blocks[i].segment
            if (i in self.summing) != bool(blocks[i].step_reductions):
                self.summing = sorted(set(self.summing) ^ {i})
        self.blocks, self.arrays, self.first = blocks, tuple(joined), self._first()
        return changed


_Layout = tuple[list[OpNode], dict[str, int], list[Any], list[dict[tuple, Any]], list[Any]]


def block_key(pieces: OpPieces) -> tuple:
    """What an op's block is built from of its pieces (``simulator.tasks._op_block``): its
    partitions, the transfers into them and its reductions (by identity: a kept block holds its
    pieces, so the ids stay theirs), and whether it recomputes. Pieces that differ in the weight
    reads' sharding levels alone share these records (``strategies.lowering_memo``) and so the block."""
    return id(pieces.partitions), id(pieces.transfers), id(pieces.reductions), pieces.recompute

KNOWN = 12
"""Blocks a ``TaskCache`` keeps per op besides the last graph's, the least recently used going
first: a chain's replicas (``soapsearch.search.mcmc.REPLICAS``) walk plans of their own in
turn, and a rejected proposal is followed by its current plan's ops again."""


def _layout(graph: OpGraph) -> _Layout:
    """``graph``'s nodes in order, op name -> its index (its block's position), and for each op
    the last graph's block, the blocks built before it by their pieces' ``block_key`` (each block
    holds its pieces, so an id stays theirs while kept; ``KNOWN`` of them, oldest first), and
    the pieces of the last graph's blocks (compared with a new lowering's in one C-level
    pass). Partition times are the cost model's (``CostModel.partition_time``'s memo)."""
    nodes = list(graph)
    return (nodes, {node.name: i for i, node in enumerate(nodes)}, [None] * len(nodes),
            [{} for _ in nodes], [None] * len(nodes))
