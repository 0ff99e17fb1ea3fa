"""A gloo process group for each process a test spawns, and the launch that collects what each
rank saved: the setup every multi-process test shares."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from soapsearch.calibrate._spawn import leave

TIMEOUT_S = 60
"""A collective that waits longer than this fails the test instead of hanging it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """Join a ``world``-rank gloo group on localhost:``port`` with one torch thread (the ranks
    share the machine's cores); the group is destroyed on leaving, whatever happened inside."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, fn: Callable, *args) -> None:
    """``fn(rank, *args)`` in a spawned process, then leave it without the interpreter's
    finalization (``soapsearch.calibrate._spawn.leave``: a finalized gloo process sometimes aborts
    after its work is done); an exception ends it as mp.spawn reports one."""
    fn(rank, *args)
    leave()


def spawn_ranks(fn: Callable, world: int, *args) -> list:
    """Run ``fn(rank, world, port, *args, out_dir)`` on ``world`` processes; each rank saves its
    result as ``out_dir/<rank>.pt``: the ranks' results in rank order."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(fn, world, free_port(), *args, d), nprocs=world, join=True)
        return [torch.load(Path(d) / f"{r}.pt") for r in range(world)]
