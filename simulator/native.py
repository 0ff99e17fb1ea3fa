"""The event loop compiled: ``simulator/_events.c``, the same steps as ``engine.run_events``'s
Python loop in the same order, built once per source version with the system C compiler
(``$CC``, else Python's own, else ``cc``) into the cache directory and loaded through ctypes.
Where no compiler works the Python loop runs; ``SOAPSEARCH_NATIVE=0`` asks for it."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from simulator.paths import cache_dir

__all__ = ["library", "SOURCE"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_events.c")
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off")
"""No fused or reordered floating point (-O3 keeps IEEE arithmetic; no -ffast-math): the C loop
must round as Python does."""


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled event loop, or None (no compiler, a failed build, or SOAPSEARCH_NATIVE=0)."""
    if os.environ.get("SOAPSEARCH_NATIVE", "1") == "0" or sys.platform == "win32":
        return None
    source = SOURCE.read_bytes()
    cc = _compiler()
    tag = hashlib.sha256(source + " ".join(cc + list(FLAGS)).encode() + sys.platform.encode()).hexdigest()[:16]
    path = cache_dir() / f"events-{tag}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True,
                               timeout=120)
                os.replace(tmp, path)  # whole or not at all, also when processes race
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.info("no compiled event loop (%s %s); the Python loop runs", e, detail.decode(errors="replace")[:500])
        return None
    lib.run_events.restype = ctypes.c_int64
    # the arrays go as their addresses: numpy's ``ctypes.data_as`` makes a reference cycle per
    # pointer, garbage the cyclic collector would have to find after every call
    lib.run_events.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 7  # int32 indices: taskgraph.INDEX
    return lib
