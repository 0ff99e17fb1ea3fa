"""Run a benchmark body on N local gloo processes and return rank 0's result."""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, body: Callable, args: Any, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    result = body(rank, world, args)
    if rank == 0:
        torch.save(result, Path(out) / "result.pt")
    dist.destroy_process_group()


def spawn_gloo(body: Callable[[int, int, Any], Any], args: Any, world: int = 2) -> Any:
    """``body(rank, world, args)`` on ``world`` processes (process group initialized); rank 0's
    return value."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, port, body, args, d), nprocs=world, join=True)
        return torch.load(Path(d) / "result.pt")
