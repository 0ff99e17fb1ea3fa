"""Where soapsearch keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$SOAPSEARCH_CACHE_DIR``, else ``~/.cache/soapsearch``."""
    root = os.environ.get("SOAPSEARCH_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "soapsearch"
