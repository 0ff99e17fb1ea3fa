"""Per-rank entry point of the executor, for torchrun (single node or many):

    torchrun --standalone --nproc-per-node 4 -m soapsearch.run plan.json --model alexnet --steps 10

Reads RANK / WORLD_SIZE / LOCAL_RANK as every torchrun program does (rank = device of the
plan), builds the model with the same seed on every rank, checks the plan against it (the
fingerprint, the world size, runnable ops) before any work, then trains: rank 0 prints each
step's loss and iteration time; ``--save`` writes the full state_dict atomically from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from soapsearch.executor import OPTIMIZERS, Executor, ExecutorError, TrainConfig
from soapsearch.executor.launch import prepare
from soapsearch.zoo import VARIANTS
from strategies.errors import PlanError
from strategies.serialize import atomic_open, atomic_write_text
from strategies.strategy import DTYPE_FLAGS, REDUCE_DTYPES, REDUCE_HELP, check_bucket_cap

__all__ = ["add_arguments", "to_argv", "check_backend", "precision_flag", "main", "MODEL_DTYPES"]

_DEFAULTS = TrainConfig()
MODEL_DTYPES = ("float32", "float64", "bfloat16", "float16")
"""``--model-dtype``: what the model's floating weights and inputs are cast to before the run."""


def precision_flag(dtype: str | None) -> str | None:
    """``--dtype`` -> the plan precision it gives (None: the plan's own); ValueError in one line
    for anything else, naming ``--model-dtype`` for a model cast's spelling."""
    if dtype is None:
        return None
    if dtype in DTYPE_FLAGS:
        return DTYPE_FLAGS[dtype]
    flags = "|".join(DTYPE_FLAGS)
    if dtype in MODEL_DTYPES:
        raise ValueError(f"--dtype {dtype}: --dtype is the plan's precision ({flags}, as on plan/simulate/"
                         f"search); to cast the model give --model-dtype {dtype}")
    raise ValueError(f"--dtype {dtype}: must be one of {flags} (the plan's precision)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a run (shared by ``python -m soapsearch.run`` and ``soapsearch run``)."""
    p.add_argument("plan", help="strategy JSON (soapsearch plan / search)")
    p.add_argument("--model", required=True, help="zoo name, path/to/file.py:factory or package.module:factory")
    p.add_argument("--variant", default="default", choices=VARIANTS, help="zoo variant")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (must match the plan)")
    p.add_argument("--steps", type=int, default=10, help="training iterations")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=_DEFAULTS.optimizer)
    p.add_argument("--lr", type=float, default=_DEFAULTS.lr)
    p.add_argument("--momentum", type=float, default=_DEFAULTS.momentum, help="SGD momentum")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--dtype", default=None, metavar="{fp32,bf16,fp16}",
                   help="the plan's precision, as on plan/simulate/search, replacing the plan's: fp32 computes "
                        "in the model's dtype, bf16/fp16 in mixed precision (torch.autocast, float32 master "
                        "weights and optimizer state; fp16 with a dynamic loss scaler); default: the plan's")
    p.add_argument("--reduce-dtype", default=None, choices=REDUCE_DTYPES,
                   help=REDUCE_HELP.format("the plan's"))
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="cap of the gradient buckets in MiB, replacing the plan's (DDP's bucket_cap_mb; "
                        "plans default to its 25)")
    p.add_argument("--model-dtype", choices=MODEL_DTYPES, default=None,
                   help="cast the model's floating weights and inputs to this dtype (default: as built)")
    p.add_argument("--loss-scale", type=float, default=_DEFAULTS.loss_scale,
                   help="fp16: the dynamic loss scaler's initial scale (a power of two; GradScaler's init_scale)")
    p.add_argument("--seed", type=int, default=0, help="weights, batch and dropout seed (same on every rank)")
    p.add_argument("--timeout", type=float, default=_DEFAULTS.timeout_s,
                   help="seconds any receive or collective may wait before the run fails")
    p.add_argument("--save", default=None, help="write the trained state_dict here (rank 0, atomically)")
    p.add_argument("--capture", default=None, choices=("fx", "export", "auto"),
                   help="front end that captures the model (default: the one the plan records)")
    p.add_argument("--trace", default=None,
                   help="Chrome trace of each rank's steps: out.json -> out.rank<R>.json")


def to_argv(args: argparse.Namespace) -> list[str]:
    """``args`` (parsed by ``add_arguments``) back into the flags of ``soapsearch.run``."""
    out = [str(args.plan), "--model", args.model]
    for flag in ("variant", "batch_size", "steps", "optimizer", "lr", "momentum", "backend", "dtype",
                 "reduce_dtype", "bucket_cap_mb", "model_dtype", "loss_scale", "seed", "timeout", "save", "trace", "capture"):
        v = getattr(args, flag)
        if v is not None:
            out += [f"--{flag.replace('_', '-')}", str(v)]
    return out


def check_backend(backend: str, nproc: int | None = None) -> None:
    """ValueError for a backend this machine cannot run (checked by the launcher before torchrun
    starts, and by each rank): NCCL needs CUDA, and ``nproc`` local processes one GPU each."""
    if backend != "nccl":
        return
    if not torch.cuda.is_available():
        raise ValueError("--backend nccl: NCCL needs CUDA and torch.cuda.is_available() is False on this "
                         "machine; use --backend gloo")
    gpus = torch.cuda.device_count()
    if nproc is not None and nproc > gpus:
        raise ValueError(f"--backend nccl: {nproc} processes need {nproc} GPUs (one each) and "
                         f"torch.cuda.device_count() = {gpus} on this machine; use --backend gloo")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The run's training config from its flags; ValueError for a step count or a config no run
    can use (checked by the launcher too, before any process starts)."""
    if args.steps < 1:
        raise ValueError(f"--steps = {args.steps}: must be >= 1 (training iterations)")
    precision_flag(args.dtype)
    if args.bucket_cap_mb is not None:
        check_bucket_cap(args.bucket_cap_mb, "--bucket-cap-mb")
    return TrainConfig(args.optimizer, lr=args.lr, momentum=args.momentum, timeout_s=args.timeout,
                       loss_scale=args.loss_scale)


def _save(path: str, state: dict) -> None:
    """torch.save, atomically (a temporary file beside ``path`` renamed over it)."""
    with atomic_open(path, "wb") as f:
        torch.save(state, f)


def _single_process_env() -> None:
    """Without torchrun: a world of one on this machine."""
    if "MASTER_ADDR" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soapsearch.run", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    try:
        check_backend(args.backend)
        config = train_config(args)
        built, strategy = prepare(args.plan, args.model, args.variant, args.batch_size, args.seed,
                                  args.model_dtype, world, capture=args.capture,
                                  precision=precision_flag(args.dtype), bucket_cap_mb=args.bucket_cap_mb,
                                  reduce_dtype=args.reduce_dtype)
    except (PlanError, ExecutorError, ValueError) as e:
        print(f"soapsearch run (rank {rank}): {e}", file=sys.stderr)
        return 2
    if world == 1:
        _single_process_env()
    device = torch.device(f"cuda:{local_rank}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        ex = Executor(built.graph, strategy, built.state, built.inputs, config, device,
                      trace=bool(args.trace))
        for step in range(args.steps):
            t0 = time.perf_counter()
            loss = ex.step(seed=args.seed * 1_000_003 + step)
            ms = (time.perf_counter() - t0) * 1e3
            if rank == 0:
                print(f"step {step + 1}/{args.steps}  loss {loss:.6f}  time {ms:.1f} ms", flush=True)
        if args.save:
            state = ex.state_dict()
            if rank == 0:
                state = built.saved(state)
                _save(args.save, state)
                print(f"saved {len(state)} tensors to {args.save}", flush=True)
        if args.trace:
            out = Path(args.trace)
            out = out.with_name(f"{out.stem}.rank{rank}{out.suffix or '.json'}")
            t0 = min((e["ts"] for e in ex.events), default=0.0)
            events = [dict(e, ts=e["ts"] - t0) for e in ex.events]
            atomic_write_text(out, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    except ExecutorError as e:
        print(f"soapsearch run: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
