"""Time to trace each zoo model at paper scale, and peak memory against the model's weights.

Each model is traced in a fresh process, first its tiny variant (the baseline, which also warms
up torch), then at paper scale on the meta device with fake tensors: no weight is allocated, so
the peak RSS grows by a small fraction of the weights' size. Prints a table; asserts nothing.

    python benchmarks/trace_time.py [--models resnet101,inception_v3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

ZOO = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "mlp", "gpt"]


def one(name: str) -> dict:
    import torch  # noqa: F401

    from soapsearch import trace, zoo

    # baseline in the same process: the tiny variant of the same model, which also warms up
    # torch's fake-tensor machinery as any process that traces twice would
    m, x = zoo.build(name, "tiny")
    trace(m, x)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    model, inputs = zoo.build(name, "default", device="meta")
    t1 = time.perf_counter()
    graph = trace(model, inputs, name=name)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model": name, "ops": len(graph), "batch": graph.batch_size,
            "gflops": graph.total_flops / 1e9, "weight_bytes": graph.weight_bytes,
            "build_s": t1 - t0, "trace_s": t2 - t1, "rss_before": base_rss, "rss_peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    print(f"{'model':14s} {'ops':>5s} {'batch':>5s} {'GFLOPs':>9s} {'weights MiB':>11s} "
          f"{'trace s':>8s} {'peak RSS MiB':>12s} {'growth MiB':>10s} {'growth / weights':>16s}")
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        growth = max(r["rss_peak"] - r["rss_before"], 0)
        print(f"{r['model']:14s} {r['ops']:5d} {r['batch']:5d} {r['gflops']:9.1f} "
              f"{r['weight_bytes'] / 2**20:11.1f} {r['trace_s']:8.2f} {r['rss_peak'] / 2**20:12.0f} "
              f"{growth / 2**20:10.1f} {growth / r['weight_bytes']:16.3f}")


if __name__ == "__main__":
    main()
