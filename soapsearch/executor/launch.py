"""Start a plan on this machine: torchrun (``torch.distributed.run``) with ``--standalone``
and one process per device of the plan, each running ``python -m soapsearch.run``. For many
nodes, run torchrun yourself with its rendezvous flags and ``-m soapsearch.run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["launch", "plan_devices"]


def plan_devices(plan_path: str | os.PathLike) -> int:
    """The number of devices a plan file is for (``topology.num_devices``)."""
    return int(json.loads(Path(plan_path).read_text())["topology"]["num_devices"])


def launch(plan_path: str | os.PathLike, argv: Sequence[str], nproc: int | None = None) -> int:
    """Run ``soapsearch.run plan_path *argv`` on ``nproc`` local processes (default: the plan's
    device count); returns torchrun's exit status."""
    nproc = plan_devices(plan_path) if nproc is None else nproc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "soapsearch.run", str(plan_path), *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)
