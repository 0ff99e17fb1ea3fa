"""The copy fold against the per-device simulation on random plans: one row per plan with the
per-device and copy-folded iteration time, their relative gap, the largest relative gap of a
device's busy time, the devices whose peak memory differs and the link kinds whose bytes moved
differ (docs/design.md, "Replica folding": all of them 0 where the fold is exact).

Plans: ``tests.strategies.test_lowering_members.random_plan`` (megatron T4 P2, sequence
parallel, each op's ZeRO level 0/1 and recompute drawn, GPipe or 1F1B) on a100-2x8 (16
devices) and a100-8x8 (64).

    python benchmarks/fold_exact.py --seeds 0-15 --devices 16,64 [--overhead 2e-5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.presets import get_topology  # noqa: E402
from simulator.simulate import simulate_plan  # noqa: E402
from simulator.symmetry import find_copies  # noqa: E402
from simulator.topology import Topology  # noqa: E402
from strategies.lowering import lower  # noqa: E402
from tests.conftest import traced  # noqa: E402
from tests.strategies.test_lowering_members import random_plan  # noqa: E402

__all__ = ["compare", "main"]

PRESETS = {16: "a100-2x8", 64: "a100-8x8"}


def compare(graph, plan, topo: Topology) -> tuple:
    """(per-device ms, copy-folded ms, relative gap, largest busy gap, devices whose peak
    differs, link kinds whose bytes differ), the fold on ``find_copies``' copies alone."""
    full = simulate_plan(graph, plan, topo, fold=False)
    folded = simulate_plan(graph, lower(graph, plan, copies=find_copies(graph, plan)), topo, fold=True)
    busy = max((abs(a - b) / b for a, b in zip(folded.busy_time, full.busy_time) if b), default=0.0)
    peak = sum(a != b for a, b in zip(folded.peak_memory_bytes, full.peak_memory_bytes))
    kinds = sorted(k for k in full.bytes_moved.keys() | folded.bytes_moved.keys()
                   if full.bytes_moved.get(k) != folded.bytes_moved.get(k))
    return (full.iteration_time * 1e3, folded.iteration_time * 1e3,
            folded.iteration_time / full.iteration_time - 1, busy, peak, kinds)


def _range(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-7", help="random_plan seeds: 0-7 or 2,4,5")
    ap.add_argument("--devices", default="16,64", help="16 and/or 64")
    ap.add_argument("--overhead", type=float, default=0.0, help="collective_overhead seconds on every device")
    args = ap.parse_args(argv)
    graph = traced("gpt", "small")
    print("| seed | devices | schedule | copies | per device ms | folded ms | rel | busy rel | peak ≠ | bytes ≠ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in _range(args.devices):
        topo = get_topology(PRESETS[n])
        if args.overhead:
            topo = Topology(f"{topo.name}-overhead", tuple(dataclasses.replace(d, collective_overhead=args.overhead)
                                                           for d in topo.devices), topo.links, topo.routes)
        for seed in _range(args.seeds):
            plan = random_plan(graph, n, seed)
            full, folded, rel, busy, peak, kinds = compare(graph, plan, topo)
            print(f"| {seed} | {n} | {plan.schedule} | {find_copies(graph, plan).count} | {full:.4f} | {folded:.4f} "
                  f"| {rel:+.2e} | {busy:.1e} | {peak} | {','.join(kinds) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
