"""Strategy JSON, version 3 (docs/design.md, "Plan JSON"): plain JSON, no pickle, no code; written atomically."""

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
from strategies.strategy import PRECISIONS, REDUCE_DTYPES, Strategy

__all__ = ["FORMAT", "VERSION", "PlanFile", "check_writable", "parse_plan", "strategy_to_json", "save_strategy", "load_strategy",
           "read_plan", "atomic_open", "atomic_write_text"]

FORMAT = "soapsearch.strategy"
VERSION = 6
READS = (1, 2, 3, 4, 5, 6)
"""The versions this soapsearch reads: version 1 (no ``precision`` field) loads as "model"
precision; versions 1 and 2 (no per-op ``zero`` / ``recompute``) as "Replicate, keep";
versions 1 to 3 (no ``bucket_cap_mb``, ``fsdp_unit``) with DDP's 25 MiB gradient buckets and
ZeRO-3 units of one op; versions 1 to 4 (no ``reduce_dtype``) reduce in their compute dtype;
versions 1 to 5 (no ``overlap_grad_reduce``) sync each gradient bucket as soon as it is final."""


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


def check_writable(path: str | os.PathLike, flag: str = "-o") -> None:
    """ValueError, before the work, where ``path`` cannot be written (``atomic_open`` makes
    missing folders): it is a directory, a folder on its way is a file, or the nearest existing
    folder is not writable. ``flag`` names the option in the message."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name, e.g. {p / 'out.json'}")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise ValueError(f"{flag} {path}: cannot write in {parent}")
            return


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
        "model": {"name": graph.name, "fingerprint": graph.fingerprint(), "batch_size": graph.batch_size,
                  "capture": graph.capture},
        "topology": topo,
        "microbatches": strategy.microbatches, "schedule": strategy.schedule, "precision": strategy.precision,
        "bucket_cap_mb": strategy.bucket_cap_mb, "fsdp_unit": strategy.fsdp_unit,
        "reduce_dtype": strategy.reduce_dtype, "overlap_grad_reduce": strategy.overlap_grad_reduce,
        "ops": [{"name": n.name, "kind": n.kind, "dims": [d.name for d in n.dims],
                 "shape": list(n.output.shape), "dtype": n.output.dtype,
                 "degrees": list(strategy[n.name].degrees), "devices": list(strategy[n.name].devices),
                 "zero": strategy[n.name].zero, "recompute": strategy[n.name].recompute}
                for n in graph],
    }
    if predicted:
        out["predicted"] = dict(predicted)
    return out


def save_strategy(path: str | os.PathLike, strategy: Strategy, graph: OpGraph, **kw: Any) -> None:
    """Validate and write ``strategy`` as JSON (``VERSION``), atomically."""
    atomic_write_text(path, json.dumps(strategy_to_json(strategy, graph, **kw), indent=1) + "\n")


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}


def _need(obj: Mapping[str, Any], key: str, types: type | tuple, where: str, op: str | None = None) -> Any:
    if key not in obj:
        raise PlanError(op, key, None, "this field is missing", where)
    v = obj[key]
    if not isinstance(v, types) or isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        want = "/".join(_JSON_TYPES.get(t, t.__name__) for t in (types if isinstance(types, tuple) else (types,)))
        raise PlanError(op, key, v, f"must be a JSON {want}", where)
    return v


def parse_plan(source: str | os.PathLike | Mapping[str, Any], devices_in_range: bool = True
               ) -> tuple[Mapping[str, Any], str, Strategy]:
    """A plan file (or its parsed JSON) checked as far as it can be without the model: format,
    version, the model and topology objects, every op's name, degrees and devices (each device
    below the plan's device count unless not ``devices_in_range``: ``read_plan`` checks it
    with the op's degrees), micro-batches and schedule. Returns (the JSON object, where it came
    from, the plan); PlanError names op, field, value and rule."""
    if not isinstance(source, (str, os.PathLike, Mapping)):
        raise PlanError(None, "path", source, "a plan is a file path or its parsed JSON object")
    where = "<plan>" if isinstance(source, Mapping) else str(source)
    if isinstance(source, Mapping):
        obj = source
    else:
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise PlanError(None, "path", where, f"cannot read the plan file: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise PlanError(None, "path", where, f"not a text file: {e.reason}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(None, "json", f"line {e.lineno} column {e.colno}",
                            f"not valid JSON: {e.msg}", where) from None
    if not isinstance(obj, Mapping):
        raise PlanError(None, "json", type(obj).__name__, "a plan is a JSON object", where)
    if obj.get("format") != FORMAT:
        raise PlanError(None, "format", obj.get("format"), f"must be {FORMAT!r}", where)
    version = obj.get("version")
    if version not in READS or isinstance(version, bool):
        raise PlanError(None, "version", version,
                        f"this soapsearch reads versions {', '.join(map(str, READS))}", where)
    model = _need(obj, "model", dict, where)
    if model.get("capture", "fx") not in ("fx", "export"):
        raise PlanError(None, "model.capture", model.get("capture"),
                        "the front end that captured the model: 'fx' or 'export' (absent: fx)", where)
    topology = _need(obj, "topology", dict, where)
    num_devices = _need(topology, "num_devices", int, where)
    if num_devices < 1:
        raise PlanError(None, "topology.num_devices", num_devices, "must be >= 1", where)
    microbatches = _need(obj, "microbatches", int, where)
    schedule = _need(obj, "schedule", str, where)
    precision = _need(obj, "precision", str, where) if version >= 2 else "model"
    if precision not in PRECISIONS:
        raise PlanError(None, "precision", precision, f"must be one of {list(PRECISIONS)}", where)
    cap = obj.get("bucket_cap_mb", Strategy.bucket_cap_mb) if version >= 4 else Strategy.bucket_cap_mb
    unit = obj.get("fsdp_unit", Strategy.fsdp_unit) if version >= 4 else Strategy.fsdp_unit
    reduce = obj.get("reduce_dtype", Strategy.reduce_dtype) if version >= 5 else Strategy.reduce_dtype
    if reduce not in REDUCE_DTYPES:
        raise PlanError(None, "reduce_dtype", reduce, f"must be one of {list(REDUCE_DTYPES)}", where)
    overlap = obj.get("overlap_grad_reduce", Strategy.overlap_grad_reduce) if version >= 6 else True
    ops = _need(obj, "ops", list, where)
    if not ops:
        raise PlanError(None, "ops", ops, "a plan has a config for every op of its model", where)
    configs: dict[str, ParallelConfig] = {}
    for i, op in enumerate(ops):
        if not isinstance(op, dict):
            raise PlanError(None, f"ops[{i}]", op, "each op is a JSON object", where)
        name = _need(op, "name", str, where)
        if name in configs:
            raise PlanError(name, "name", name, "the op appears twice in the plan", where)
        degrees = _need(op, "degrees", list, where, name)
        devices = _need(op, "devices", list, where, name)
        zero = _need(op, "zero", int, where, name) if version >= 3 and "zero" in op else 0
        recompute = _need(op, "recompute", bool, where, name) if version >= 3 and "recompute" in op else False
        try:
            configs[name] = ParallelConfig(tuple(degrees), tuple(devices), zero, recompute)
        except PlanError as e:
            raise PlanError(name, e.field, e.value, e.rule, where) from None
        bad = [d for d in devices if not 0 <= d < num_devices] if devices_in_range else []
        if bad:
            raise PlanError(name, "devices", devices, f"device {bad[0]} is out of range for "
                            f"{num_devices} devices (0-{num_devices - 1})", where)
    try:
        strategy = Strategy(tuple(configs.items()), num_devices, microbatches, schedule, precision, cap, unit, reduce, overlap)
    except PlanError as e:
        raise PlanError(e.op, e.field, e.value, e.rule, where) from None
    return obj, where, strategy


def read_plan(source: str | os.PathLike | Mapping[str, Any], graph: OpGraph) -> PlanFile:
    """Load a plan file (or its parsed JSON) for ``graph``: ``parse_plan``'s checks, then the
    fingerprint, every op against the model's, every degree and device; PlanError names op,
    field, value and rule."""
    obj, where, strategy = parse_plan(source, devices_in_range=False)
    made_for = obj["model"]
    fp = made_for.get("fingerprint")
    if fp != graph.fingerprint():
        raise PlanError(None, "model.fingerprint", fp,
                        f"the plan was made for another model, variant or batch size: "
                        f"{made_for.get('name', '?')} (batch {made_for.get('batch_size', '?')}), the model "
                        f"given is {graph.name} (batch {graph.batch_size}, fingerprint {graph.fingerprint()!r}); "
                        f"{_first_difference(obj['ops'], graph)}", where)
    for op in obj["ops"]:
        name = op["name"]
        if name not in graph:
            raise PlanError(name, "name", name, "the model has no op of this name", where)
        node = graph[name]
        for key, want in (("kind", node.kind), ("dims", [d.name for d in node.dims])):
            if key in op and op[key] != want:
                raise PlanError(name, key, op[key], f"the model's op has {key} {want!r}", where)
    strategy.validate(graph, where)
    return PlanFile(strategy, dict(obj["model"]), dict(obj["topology"]), dict(obj.get("predicted") or {}))


_RECORDED = ("name", "kind", "dims", "shape", "dtype")
"""What a plan records of each op (``strategy_to_json``), compared in this order."""


def _first_difference(ops: list, graph: OpGraph) -> str:
    """Where a plan's ops and ``graph``'s first differ, in words: the first op whose recorded
    name, kind, dims, output shape or dtype is not the model's (a plan without shapes compares
    the rest), else the op counts."""
    for i, (op, node) in enumerate(zip(ops, graph)):
        model = (node.name, node.kind, [d.name for d in node.dims], list(node.output.shape), node.output.dtype)
        for key, want in zip(_RECORDED, model):
            if key in op and op[key] != want:
                return f"first difference: op {i} ({op['name']!r}) has {key} {op[key]!r} in the plan, {want!r} in the model"
    if len(ops) != len(graph):
        return f"first difference: the plan has {len(ops)} ops, the model {len(graph)}"
    if all("shape" in op for op in ops):
        return "every op's name, kind, dims, output shape and dtype agree: a weight's shape or an op's inputs differ"
    return "every op's recorded name, kind and dims agree (the plan records no output shapes)"


def load_strategy(source: str | os.PathLike | Mapping[str, Any], graph: OpGraph) -> Strategy:
    """``read_plan(source, graph).strategy``."""
    return read_plan(source, graph).strategy
