"""Strategy JSON, version 1 (DESIGN.md): plain JSON, no pickle, no code; written atomically."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

from strategies.config import ParallelConfig
from strategies.errors import PlanError
from strategies.graph import OpGraph
from strategies.strategy import Strategy

__all__ = ["FORMAT", "VERSION", "PlanFile", "strategy_to_json", "save_strategy", "load_strategy",
           "read_plan", "atomic_open", "atomic_write_text"]

FORMAT = "soapsearch.strategy"
VERSION = 1


@dataclass(frozen=True)
class PlanFile:
    """A loaded plan and what the file says about it."""

    strategy: Strategy
    model: Mapping[str, Any] = field(default_factory=dict)
    topology: Mapping[str, Any] = field(default_factory=dict)
    predicted: Mapping[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A file beside ``path`` to write; when the block ends without error it is flushed,
    fsynced and renamed over ``path``, otherwise removed: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; the result is an ordinary file
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (``atomic_open``)."""
    with atomic_open(path) as f:
        f.write(text)


def strategy_to_json(strategy: Strategy, graph: OpGraph, *, topology: str | Mapping[str, Any] = "local",
                     predicted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object of ``strategy`` for ``graph`` (validated first)."""
    strategy.validate(graph)
    topo = {"name": topology} if isinstance(topology, str) else dict(topology)
    topo["num_devices"] = strategy.num_devices
    out: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "model": {"name": graph.name, "fingerprint": graph.fingerprint(), "batch_size": graph.batch_size},
        "topology": topo,
        "microbatches": strategy.microbatches, "schedule": strategy.schedule,
        "ops": [{"name": n.name, "kind": n.kind, "dims": [d.name for d in n.dims],
                 "degrees": list(strategy[n.name].degrees), "devices": list(strategy[n.name].devices)}
                for n in graph],
    }
    if predicted:
        out["predicted"] = dict(predicted)
    return out


def save_strategy(path: str | os.PathLike, strategy: Strategy, graph: OpGraph, **kw: Any) -> None:
    """Validate and write ``strategy`` as JSON v1, atomically."""
    atomic_write_text(path, json.dumps(strategy_to_json(strategy, graph, **kw), indent=1) + "\n")


def _need(obj: Mapping[str, Any], key: str, types: type | tuple, where: str, op: str | None = None) -> Any:
    if key not in obj:
        raise PlanError(op, key, None, "this field is missing", where)
    v = obj[key]
    if not isinstance(v, types) or isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        want = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise PlanError(op, key, v, f"must be a JSON {want}", where)
    return v


def read_plan(source: str | os.PathLike | Mapping[str, Any], graph: OpGraph) -> PlanFile:
    """Load a plan file (or its parsed JSON) for ``graph``, checking format, version,
    fingerprint, every op, degree and device; PlanError names op, field, value and rule."""
    where = "<plan>" if isinstance(source, Mapping) else str(source)
    if isinstance(source, Mapping):
        obj = source
    else:
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise PlanError(None, "path", where, f"cannot read the plan file: {e.strerror}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(None, "json", f"line {e.lineno} column {e.colno}",
                            f"not valid JSON: {e.msg}", where) from None
    if not isinstance(obj, Mapping):
        raise PlanError(None, "json", type(obj).__name__, "a plan is a JSON object", where)
    if obj.get("format") != FORMAT:
        raise PlanError(None, "format", obj.get("format"), f"must be {FORMAT!r}", where)
    if obj.get("version") != VERSION:
        raise PlanError(None, "version", obj.get("version"),
                        f"this soapsearch reads version {VERSION} only", where)
    model = _need(obj, "model", dict, where)
    fp = model.get("fingerprint")
    if fp != graph.fingerprint():
        raise PlanError(None, "model.fingerprint", fp,
                        f"the plan was made for another model or batch size: the model given "
                        f"({graph.name}, batch {graph.batch_size}) has fingerprint "
                        f"{graph.fingerprint()!r}", where)
    topology = _need(obj, "topology", dict, where)
    num_devices = _need(topology, "num_devices", int, where)
    microbatches = _need(obj, "microbatches", int, where)
    schedule = _need(obj, "schedule", str, where)
    ops = _need(obj, "ops", list, where)
    configs: dict[str, ParallelConfig] = {}
    for i, op in enumerate(ops):
        if not isinstance(op, dict):
            raise PlanError(None, f"ops[{i}]", op, "each op is a JSON object", where)
        name = _need(op, "name", str, where)
        if name in configs:
            raise PlanError(name, "name", name, "the op appears twice in the plan", where)
        if name not in graph:
            raise PlanError(name, "name", name, "the model has no op of this name", where)
        node = graph[name]
        for key, want in (("kind", node.kind), ("dims", [d.name for d in node.dims])):
            if key in op and op[key] != want:
                raise PlanError(name, key, op[key], f"the model's op has {key} {want!r}", where)
        degrees = _need(op, "degrees", list, where, name)
        devices = _need(op, "devices", list, where, name)
        try:
            configs[name] = ParallelConfig(tuple(degrees), tuple(devices))
        except PlanError as e:
            raise PlanError(name, e.field, e.value, e.rule, where) from None
    try:
        strategy = Strategy(tuple(configs.items()), num_devices, microbatches, schedule)
    except PlanError as e:
        raise PlanError(e.op, e.field, e.value, e.rule, where) from None
    strategy.validate(graph, where)
    return PlanFile(strategy, dict(model), dict(topology), dict(obj.get("predicted") or {}))


def load_strategy(source: str | os.PathLike | Mapping[str, Any], graph: OpGraph) -> Strategy:
    """``read_plan(source, graph).strategy``."""
    return read_plan(source, graph).strategy
