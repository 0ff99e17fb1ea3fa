"""Run a function on N local torch.distributed processes (torch.multiprocessing spawn, gloo on
127.0.0.1) and collect each rank's picklable result."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["SpawnError", "leave", "rank_threads", "spawn", "threads_per_process"]


class SpawnError(RuntimeError):
    """Processes ``spawn`` started failed; the message has each rank's error."""


def threads_per_process(nproc: int) -> int:
    """Intra-op threads each of ``nproc`` processes gets, as ``soapsearch run`` sets
    OMP_NUM_THREADS: cores // nproc, at least 1 (so more processes than cores share them)."""
    return max(1, (os.cpu_count() or 1) // nproc)


@contextlib.contextmanager
def rank_threads(nproc: int):
    """This process runs with the intra-op threads one of ``nproc`` ranks gets (restored after):
    what a profiled partition is timed with."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(nproc))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, out: str,
           timeout_s: float) -> None:
    torch.set_num_threads(threads_per_process(world))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result: Any = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result = {"__error__": f"rank {rank}:\n{traceback.format_exc()}"}
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    leave()


def leave() -> None:
    """End a spawned rank whose work is done, its results on disk and its process group
    destroyed, as a forked multiprocessing child leaves (its exit function, which runs the
    finalizers, then os._exit), without the interpreter's finalization. Finalized, a gloo process
    sometimes aborts after its work is done ("terminate called without an active exception",
    SIGABRT: a C++ thread still joinable at exit), which mp.spawn reports as the rank failing."""
    mp_util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, nproc: int, args: tuple = (), backend: str = "gloo", timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``nproc`` spawned processes with the default process group
    initialized; their return values in rank order. RuntimeError with every failing rank's
    traceback when one fails."""
    with tempfile.TemporaryDirectory(prefix="soapsearch-calibrate-") as d:
        failure = None
        try:
            mp.spawn(_entry, args=(nproc, _free_port(), backend, fn, args, d, timeout_s), nprocs=nproc, join=True)
        except Exception as e:  # noqa: BLE001
            failure = e
        results = []
        for r in range(nproc):
            p = Path(d, f"{r}.pkl")
            results.append(pickle.loads(p.read_bytes()) if p.exists() else {"__error__": f"rank {r}: no result"})
        errors = [x["__error__"] for x in results if isinstance(x, dict) and "__error__" in x]
        if failure is not None or errors:
            raise SpawnError("calibration processes failed:\n" + "\n".join(errors or [str(failure)]))
        return results
