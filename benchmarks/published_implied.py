"""published_implied.py: the rate a row's matrix products must reach for its published
iteration, against the rate the cost model charges them (issue 24: why Korthikanti et al.'s
rows are predicted slower, more so with scale).

Device 0's predicted iteration T splits into its products G, its other compute C (attention,
the other ops, the optimizer update), its exposed communication X and its idle time I
(``published_breakdown.breakdown``). Hold the idle share I/T (the pipeline bubble is
(p − 1)/(v·m) of a device's passes, Narayanan et al. SC'21 §2.2, and the waits for the
slowest stage, the last with the logits, are a share of them too) and C and X as predicted:
the published seconds P then leave the products G' = P·(1 − I/T) − C − X, so they must run
G/G' times faster than charged. The charged rate is what the cost model charges one layer's
linears (``layer_gemm_efficiency``: each product at its shape's rate on a preset with SMs,
``simulator.gemm_shape``, else Hockney's r∞·m/(m + n½) of its smallest dimension m;
``simulator.cost.gemm_efficiency``); the implied rate is that times G/G'.

    python benchmarks/published_implied.py --sweep korthikanti-22B --sweep korthikanti-175B
    python benchmarks/published_implied.py --row "530B full" --row "1T full" --max-gpus 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published_breakdown import Breakdown, breakdown  # noqa: E402
from benchmarks.published_data import ROWS, Run  # noqa: E402
from benchmarks.published_runs import (build_graph, build_plan, layer_products, layer_shares,  # noqa: E402
                                       published_seconds, reachable, row_cost, row_topology)
from simulator.presets import get_topology  # noqa: E402

__all__ = ["Implied", "implied", "layer_gemm_efficiency"]


class Implied(NamedTuple):
    """What the published seconds leave device 0's products: ``allowed`` seconds (G'), the
    ``speedup`` G/G' they need over the predicted ``charged`` seconds (G)."""

    charged: float
    allowed: float
    speedup: float


def implied(got: Breakdown, published: float) -> Implied:
    """G' = P·(1 − I/T) − C − X and G/G' (module docstring) of device 0's breakdown ``got``
    against the published seconds ``published``; the products are ``got.compute["gemm"]``."""
    gemm = got.compute.get("gemm", 0.0)
    other = sum(v for k, v in got.compute.items() if k != "gemm") + sum(got.exposed.values())
    allowed = published * (1 - got.idle / got.iteration) - other
    if allowed <= 0:
        raise ValueError(f"published {published:.3f} s · (1 − idle {got.idle:.3f} / {got.iteration:.3f}) − "
                         f"other compute and exposed communication {other:.3f} = {allowed:.3f} s leaves the "
                         "products no time")
    return Implied(gemm, allowed, gemm / allowed)


def layer_gemm_efficiency(run: Run) -> float:
    """Share of the bf16 peak the cost model charges one layer's linears on device 0 for one
    micro-batch: their FLOPs, forward and both backward products (``layer_products``: 2·rows·out·in
    each), over the seconds ``published_runs.layer_shares`` charges them (their shapes' rates,
    ``simulator.cost.gemm_efficiency``; a kernel's launch)."""
    _, forward, backward = layer_shares(run)["linear"]
    flops = 3 * sum(2 * rows * out * inner for rows, out, inner in layer_products(run))
    return flops / ((forward + backward) * get_topology(run.topology).devices[0].flops_for("bfloat16"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="append", help="only this sweep's rows (repeatable)")
    ap.add_argument("--row", action="append", help="only the row of this name (repeatable)")
    ap.add_argument("--max-gpus", type=int, default=128, help="rows of more devices are skipped")
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if r.plan == "megatron" and (args.sweep is None or r.sweep in args.sweep)
            and (args.row is None or r.name in args.row)]
    print(f"{'row':14s} {'pub s':>7s} {'pred s':>7s} {'idle':>6s} {'comm':>6s} {'gemm s':>8s} {'allowed':>8s} "
          f"{'speedup':>7s} {'charged':>8s} {'implied':>8s}  (rates: TFLOP/s, share of r∞)", flush=True)
    for run in rows:
        if (why := reachable(run, args.max_gpus)) is not None:
            print(f"{run.name:14s} {why}")
            continue
        graph = build_graph(run)
        got = breakdown(graph, build_plan(run, graph), row_topology(run), row_cost(run))
        found = implied(got, published_seconds(run))
        device = get_topology(run.topology).devices[0]
        eff = layer_gemm_efficiency(run)
        peak = device.flops_for("bfloat16") / 1e12
        print(f"{run.name:14s} {published_seconds(run):7.2f} {got.iteration:7.2f} {got.idle / got.iteration:6.1%} "
              f"{sum(got.exposed.values()):6.2f} {found.charged:8.2f} {found.allowed:8.2f} {found.speedup:7.3f} "
              f"{eff * peak:4.0f} {eff / device.gemm_rate:.2f} {eff * found.speedup * peak:4.0f} "
              f"{eff * found.speedup / device.gemm_rate:.2f}", flush=True)


if __name__ == "__main__":
    main()
