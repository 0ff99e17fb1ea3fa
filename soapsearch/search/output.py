"""Where ``search`` and ``plan`` write their plan: a plan belongs to one model (its fingerprint:
the ops, their shapes and the batch size), so a file that holds another model's plan, or
anything but a plan, is replaced only when the user says so (``--force``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from strategies.graph import OpGraph

__all__ = ["check_plan_output", "wrote"]


def _made_for(path: Path) -> dict[str, Any] | None:
    """The ``model`` object of the plan file at ``path``; None when it is no plan file."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, dict) and "fingerprint" in model else None


def _model(name: Any, batch: Any, fingerprint: Any, with_fingerprint: bool) -> str:
    return f"{name} (batch {batch}" + (f", fingerprint {fingerprint!r})" if with_fingerprint else ")")


def check_plan_output(path: str | os.PathLike, graph: OpGraph, force: bool, flag: str = "-o") -> str:
    """Before the work: ValueError where ``path`` holds another model's plan or a file that is no
    plan (unless ``force``), naming the file, the model it was made for and the flags that
    resolve it. Returns what the closing line says of the file replaced ('' for a new file)."""
    p = Path(path)
    if not p.exists():
        return ""
    made_for = _made_for(p)
    same = made_for is not None and made_for.get("fingerprint") == graph.fingerprint()
    if same:
        return " (replacing its plan for the same model)"
    if force:
        return " (replacing it: --force)"
    if made_for is None:
        raise ValueError(f"{flag} {path}: the file exists and is not a plan; give another {flag} "
                         "or --force to overwrite it")
    name, batch, fp = made_for.get("name", "?"), made_for.get("batch_size", "?"), made_for.get("fingerprint")
    alike = (name, batch) == (graph.name, graph.batch_size)  # then only the fingerprints tell them apart
    raise ValueError(f"{flag} {path}: holds a plan made for {_model(name, batch, fp, alike)}, not "
                     f"{_model(graph.name, graph.batch_size, graph.fingerprint(), alike)}; give "
                     f"another {flag} or --force to overwrite it")


def wrote(path: str | os.PathLike) -> str:
    """The full path a command wrote, for its closing line."""
    return os.path.abspath(path)
