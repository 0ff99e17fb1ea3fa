"""The ``soapsearch run`` subcommand: ``soapsearch run plan.json --model MODEL ...`` starts
torchrun on this machine with one process per device of the plan (``launch``)."""

from __future__ import annotations

import argparse

from soapsearch.executor.launch import launch

__all__ = ["add_run_parser"]


def _cmd_run(args: argparse.Namespace) -> int:
    from soapsearch.run import to_argv

    argv = to_argv(args)
    return launch(args.plan, argv[1:], args.nproc)


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``run`` on ``subparsers`` (its handler is ``args.fn(args) -> int``)."""
    from soapsearch.run import add_arguments

    p = subparsers.add_parser("run", help="train a model with a plan on local processes (torchrun)")
    add_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start (default: the plan's number of devices)")
    p.set_defaults(fn=_cmd_run)
    return p
