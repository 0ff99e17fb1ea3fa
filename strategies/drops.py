"""What an op's output lives for: whether its partitions drop it after the forward and where
(``drop_points``), whether a later step reads it back (``output_needed``, ``reads_back``), and
whether recompute on an op may drop anything (``check_recompute``). The lowering, the memory
model and the executor read the same answers (docs/design.md, "Recompute")."""

from __future__ import annotations

from typing import Collection, NamedTuple

from strategies.errors import PlanError
from strategies.graph import OpGraph, OpNode
from strategies.lowered import WEIGHT_KINDS
from strategies.saved import aliases, reads_from, saves_output
from strategies.strategy import Strategy

__all__ = ["drops_output", "check_recompute", "recomputable", "drop_points", "drop_positions", "DropPoints",
           "recompute_key", "key_readers", "reads_back", "output_needed", "transient"]


def reads_back(graph: OpGraph, strategy: Strategy, user: str, producer: str) -> bool:
    """Consumer ``user``'s backward reads what it reads of ``producer`` (``strategies.saved.
    reads_from``: x·cos reads x back only where cos needs a gradient): a view's where its own
    output is needed after its forward (``output_needed``)."""
    node = graph[user]
    return output_needed(graph, strategy, user) if aliases(node) else reads_from(graph, node, producer)


def output_needed(graph: OpGraph, strategy: Strategy, name: str) -> bool:
    """Op ``name``'s output is read after its forward: its own backward reads it
    (``strategies.saved.saves_output``), a consumer recomputes (its recomputation reads it
    again) or a consumer's backward reads it (``reads_back``); a graph output, an input, a
    weight or an op with no backward keeps it (as autograd holds what no backward frees)."""
    node = graph[name]
    if (node.kind in WEIGHT_KINDS or node.kind == "input" or not graph.needs_grad[name] or name in graph.outputs
            or saves_output(node)):
        return True
    return any(strategy[u].recompute or reads_back(graph, strategy, u, name) for u in graph.users(name))


def transient(graph: OpGraph, strategy: Strategy, name: str) -> bool:
    """Op ``name``'s partitions let go of their outputs after the last consumer's forward and
    never need them again: it does not recompute and its output is not needed
    (``output_needed``: autograd saves it nowhere). A row-parallel linear's Partial output
    before its reduce-scatter, a GELU's input's consumer's output: Korthikanti et al. 2022 §4
    count neither."""
    return not strategy[name].recompute and not output_needed(graph, strategy, name)


def drops_output(graph: OpGraph, strategy: Strategy, name: str) -> bool:
    """Op ``name``'s partitions drop their outputs after the forward: the op recomputes and
    every consumer op recomputes too or reads nothing back in its backward (``reads_back``:
    a residual add; docs/design.md, "Recompute"). A consumer that does not recompute saves
    what it reads for its own backward, so the output stays kept; a recompute consumer
    recomputes it (the chain back to the nearest kept output: Chen et al. 2016's segments),
    so a transformer layer recomputed up to its closing residual add keeps its input only
    (Korthikanti et al. 2022, §4.1: 2sbh bytes a layer at 16 bits)."""
    return strategy[name].recompute and all(strategy[u].recompute or not reads_back(graph, strategy, u, name)
                                            for u in graph.users(name))


class DropPoints(NamedTuple):
    """Where a dropped output (``drops_output``) of one op lives on one device, per micro-batch:
    from the op's forward step to the end of the forward step of ``free_after`` (its last
    consumer op there, graph order; the op itself where none is), and again from the start of
    the backward step of ``recompute_at`` (where a recompute consumer first needs it; the op
    itself where none does) to the end of the op's own backward step. A transient output
    (``transient``) lives the first span only (``recompute_at``: the op itself, unused). The
    executor frees and recomputes there; ``simulator.memory_walks`` walks the same spans."""

    free_after: str
    recompute_at: str


def drop_points(graph: OpGraph, strategy: Strategy) -> dict[tuple[str, int], DropPoints]:
    """(op, device) -> ``DropPoints`` of every dropped or transient output. On device d the consumers of op X
    with a partition there read it (or not) in their forward; X is needed again by its consumer
    C's recomputation: at C's backward step if C keeps its output, else where C is recomputed
    (its own ``recompute_at``), so a chain is recomputed at its last op's backward, from the
    nearest kept outputs (docs/design.md, "Recompute")."""
    names = [node.name for node in graph]
    return {(name, d): DropPoints(names[f], names[r])
            for name, groups in drop_positions(graph, strategy).items() for devices, f, r in groups for d in devices}


def drop_positions(graph: OpGraph, strategy: Strategy, position: dict[str, int] | None = None,
                   only: Collection[str] | None = None) -> dict[str, list[tuple[tuple[int, ...], int, int]]]:
    """``drop_points`` as graph positions, for the memory model's walk (``position``: op -> its
    index in graph order, where the caller has it): dropped op -> [(devices, free_after,
    recompute_at)], one entry for all its devices where they agree (every consumer on all of
    them, the common case), else one per device. ``only``: these ops' entries alone, exact
    where no op recomputes (an entry then reads its op's and its consumers' devices only; with
    recompute it reads its consumers' entries)."""
    position = {node.name: i for i, node in enumerate(graph)} if position is None else position
    config = strategy.__getitem__
    out: dict[str, list[tuple[tuple[int, ...], int, int]]] = {}
    at_device: dict[tuple[str, int], int] = {}  # (dropped op, device) -> recompute_at, where not one for all
    same: dict[str, int | None] = {}  # dropped op -> its recompute_at where one for all its devices
    names = (node.name for node in reversed(graph.nodes)) if only is None else \
        sorted((n for n in only if n in position), key=position.__getitem__, reverse=True)  # those alone
    for name in names:
        cfg = config(name)
        if not (drops_output(graph, strategy, name) if cfg.recompute else transient(graph, strategy, name)):
            continue
        users = graph.users(name)
        ucfg = [config(u) for u in users]
        mine = position[name]
        # a consumer that reads nothing back frees the output after its forward and never
        # needs it again (its recompute point: the op itself, the earliest)
        around = [(u, position[u], c.devices, c.recompute) for u, c in zip(users, ucfg)]
        mine_devices = cfg.devices
        f = r = mine
        for u, at, devices, redone in around:
            again = same.get(u, at) if redone else mine  # a kept consumer: its own backward; a dropped one: its point
            if again is None or (devices != mine_devices and not set(mine_devices).issubset(devices)):
                break
            f, r = max(f, at), max(r, again)
        else:
            out[name] = [(cfg.devices, f, r)]
            same[name] = r
            continue
        same[name] = None
        groups = out[name] = []
        for d in cfg.devices:
            f = r = mine
            for u, at, devices, redone in around:
                if d in devices:
                    if at > f:
                        f = at
                    again = same.get(u, at) if redone else mine
                    again = at_device[(u, d)] if again is None else again
                    if again > r:
                        r = again
            at_device[(name, d)] = r
            groups.append(((d,), f, r))
    return out


def recompute_key(graph: OpGraph, strategy: Strategy, name: str) -> tuple:
    """What an op's pieces read of its consumers' configs: whether it drops its output
    (``drops_output`` where it recomputes, ``transient`` where not), which reads the recompute
    flags of its consumers and, through views, of theirs. Part of the lowering cache's key:
    ops of one shape share pieces wherever this agrees (``strategies.lowering_shared``)."""
    return (drops_output(graph, strategy, name) if strategy[name].recompute else transient(graph, strategy, name),)


def key_readers(graph: OpGraph, name: str) -> list[str]:
    """The ops whose ``recompute_key`` reads op ``name``'s config: its producers and, through
    each view among them, theirs (the lowering re-lowers them when it changes)."""
    out, stack = [], list(graph[name].inputs)
    while stack:
        p = stack.pop()
        out.append(p)
        if aliases(graph[p]):
            stack.extend(graph[p].inputs)
    return out


def recomputable(graph: OpGraph, node: OpNode) -> bool:
    """Whether recompute on ``node`` may drop something (``check_recompute`` refuses it
    otherwise): it computes (not a weight read in place) and has a backward."""
    return node.kind not in WEIGHT_KINDS and node.kind != "input" and graph.needs_grad[node.name]


def check_recompute(graph: OpGraph, node: OpNode) -> None:
    """Raise PlanError where recompute on ``node`` would drop nothing: a weight is read in
    place (nothing computed) and an op with no backward keeps nothing for one."""
    if node.kind in WEIGHT_KINDS:
        raise PlanError(node.name, "recompute", True, f"a {node.kind!r} op is a weight read in place: "
                        "it computes and keeps nothing to recompute")
    if not graph.needs_grad[node.name]:
        raise PlanError(node.name, "recompute", True, "nothing it computes needs a gradient: it has no "
                        "backward, so it keeps nothing for one to drop")
