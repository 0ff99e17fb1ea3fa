"""The ``soapsearch run`` subcommand: ``soapsearch run plan.json --model MODEL ...`` checks the
flags, the plan and the model once here (``check_plan``), then starts torchrun on this machine
with one process per device of the plan (``launch``)."""

from __future__ import annotations

import argparse

from soapsearch.executor.launch import check_plan, launch
from strategies.serialize import check_writable

__all__ = ["add_run_parser"]


def _check_flags(args: argparse.Namespace) -> None:
    """ValueError for a flag no run can use, before anything is built or started."""
    from soapsearch.run import check_backend, train_config
    check_backend(args.backend)  # before the model is built: CUDA for NCCL
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc = {args.nproc}: must be >= 1 (one process per device of the plan)")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size = {args.batch_size}: must be >= 1 (the global batch)")
    for flag, path in (("--save", args.save), ("--trace", args.trace)):
        if path:
            check_writable(path, flag)  # not after the training
    train_config(args)  # as each rank makes it: steps, optimizer, learning rate, timeout


def _cmd_run(args: argparse.Namespace) -> int:
    from soapsearch.run import check_backend, precision_flag, to_argv

    _check_flags(args)
    nproc = check_plan(args.plan, args.model, variant=args.variant, batch_size=args.batch_size,
                       seed=args.seed, dtype=args.model_dtype, nproc=args.nproc, capture=args.capture,
                       precision=precision_flag(args.dtype), bucket_cap_mb=args.bucket_cap_mb,
                       reduce_dtype=args.reduce_dtype)
    check_backend(args.backend, nproc)  # one GPU per process: torchrun starts them all on this machine
    return launch(args.plan, to_argv(args)[1:], nproc)


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``run`` on ``subparsers`` (its handler is ``args.fn(args) -> int``)."""
    from soapsearch.run import add_arguments

    p = subparsers.add_parser("run", help="train a model with a plan on local processes (torchrun)")
    add_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start (default: the plan's number of devices, the only "
                        "number that runs)")
    p.set_defaults(fn=_cmd_run)
    return p
