"""Start a plan on this machine: torchrun (``torch.distributed.run``) with ``--standalone``
and one process per device of the plan, each running ``python -m soapsearch.run``. For many
nodes, run torchrun yourself with its rendezvous flags and ``-m soapsearch.run``.

``check_plan`` runs, in the launching process, the checks every rank runs before any work
(same model build, same plan reader, same runnability check), so a bad plan or flag is one
error line here instead of one per rank followed by torchrun's traceback."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Any, Sequence

from soapsearch import zoo
from soapsearch.executor.errors import ExecutorError, check_runnable
from soapsearch.executor.model import build_model
from strategies.lowering import lower
from strategies.serialize import parse_plan, read_plan
from strategies.strategy import Strategy

__all__ = ["check_plan", "launch", "plan_devices", "prepare"]


def plan_devices(plan_path: str | os.PathLike) -> int:
    """The number of devices a plan file is for (``topology.num_devices``), the file checked as
    far as it can be without the model (``parse_plan``: PlanError naming the file) and its
    device count against its topology's (``check_plan_topology``)."""
    from simulator.presets import check_plan_topology

    obj, where, plan = parse_plan(plan_path)
    check_plan_topology(obj["topology"], where)
    return plan.num_devices


def prepare(plan_path: str | os.PathLike, model: str, variant: str, batch_size: int | None, seed: int,
            dtype: str | None, devices: int, device: str = "cpu", capture: str | None = None,
            precision: str | None = None, bucket_cap_mb: float | None = None,
            reduce_dtype: str | None = None) -> tuple[Any, Strategy]:
    """What a rank does before any work: the model built (``build_model`` on ``device``), the
    plan read against it (``read_plan``: fingerprint, ops, degrees, devices) and checked
    runnable on ``devices`` processes (``check_runnable``), in ``precision`` when given (a
    ``Strategy.precision``, replacing the plan's; ``reduce_dtype`` likewise) and with gradient buckets capped at
    ``bucket_cap_mb`` when given (``Strategy.bucket_cap_mb``, replacing the plan's). The model is captured by the front end the
    plan records (``model.capture``; absent: fx) unless ``capture`` says otherwise. ``dtype``
    casts the model (``build_model``). Returns (the built model, the plan)."""
    if capture is None:
        capture = parse_plan(plan_path)[0]["model"].get("capture", "fx")
    built = build_model(model, variant, batch_size, seed, dtype, device, capture)
    strategy = read_plan(plan_path, built.graph).strategy
    if precision is not None or reduce_dtype is not None:
        strategy = strategy.with_precision(precision or strategy.precision, reduce_dtype)
    if bucket_cap_mb is not None:
        strategy = strategy.with_bucket_cap(bucket_cap_mb)
    check_runnable(lower(built.graph, strategy), devices)
    return built, strategy


def check_plan(plan_path: str | os.PathLike, model: str, *, variant: str = "default",
               batch_size: int | None = None, seed: int = 0, dtype: str | None = None,
               nproc: int | None = None, capture: str | None = None, precision: str | None = None,
               bucket_cap_mb: float | None = None, reduce_dtype: str | None = None) -> int:
    """What each rank checks before any work, done once here: the plan's device count against
    ``nproc``, then ``prepare``. Returns the number of processes to start; raises PlanError / ModelLoadError / TraceError
    / ValueError naming the file, field and value."""
    devices = plan_devices(plan_path)  # the cheap checks first: no model is built for these
    if nproc is not None and nproc != devices:
        raise ValueError(f"--nproc = {nproc}: the plan {str(plan_path)!r} has topology.num_devices = "
                         f"{devices} and runs one process per device; leave out --nproc or give "
                         f"--nproc {devices}")
    try:
        # a zoo model on the meta device: the same graph and checks without allocating and
        # initializing its weights (every rank builds them anyway)
        built, strategy = prepare(plan_path, model, variant, batch_size, seed, dtype, devices, "meta",
                                  capture, precision, bucket_cap_mb, reduce_dtype)
    except ExecutorError as e:
        raise ValueError(f"{plan_path}: {e}") from None
    # a factory's model has its weights: the traced GraphModule's reference cycles would keep
    # them in this process for the whole run, so a model of over 64 MiB of weights is collected
    big = model not in zoo.names() and built.graph.weight_bytes > 64 * 2**20
    del built, strategy
    if big:
        gc.collect()
    return devices


def launch(plan_path: str | os.PathLike, argv: Sequence[str], nproc: int | None = None) -> int:
    """Run ``soapsearch.run plan_path *argv`` on ``nproc`` local processes (default: the plan's
    device count); returns torchrun's exit status."""
    nproc = plan_devices(plan_path) if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"nproc = {nproc}: start at least 1 process")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "soapsearch.run", str(plan_path), *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)
