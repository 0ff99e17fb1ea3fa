"""Which models go in unchanged: for each model (the Hugging Face families of ``soapsearch.hf``,
hand-written transformer blocks and the zoo's llama), the front end that captured it, its ops
and opaque ops, the plan a search finds on local-cpu-2 and on a100-1x8 (simulated iteration ms,
with the best expert baseline's beside it), and one SGD step of the local-cpu-2 plan on 2 gloo
processes against one device in float64 (the largest error over the loss and every weight
after the step, relative to that tensor's largest value, or to 1e-8 where all its values are
smaller). The trace column is the seconds of the capture alone. Then the zoo's llama at
LLaMA-3 8B's shape traced on the meta device (no weight allocated), against the tiny variant
in the same process. Prints a table; asserts nothing.

    python benchmarks/model_coverage.py [--models gpt2,llama,...] [--budget-s 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the hand-written blocks in tests/

from _gloo import spawn_gloo  # benchmarks/_gloo.py: the process-group boilerplate
from soapsearch import search, trace
from soapsearch.executor import Executor, TrainConfig, build_model, make_optimizer
from strategies.rules import OPAQUE

HF = ["gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "opt", "bert", "t5", "bart"]
OTHERS = {"nanogpt-fused-qkv": "tests.executor.models_multi:nanogpt_split",
          "nn.MultiheadAttention": "tests.executor.models_multi:mha_causal",
          "zoo llama": "llama"}


def spec_of(name: str) -> str:
    return OTHERS.get(name, f"soapsearch.hf:{name}")


FLOOR = 1e-8
"""The parity tests' ATOL: a tensor whose values are all below it (an attention key's bias
after one step: its gradient is exactly zero in exact arithmetic, rounding noise here) is
compared absolutely."""


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got - ref).abs().max().item() / max(ref.abs().max().item(), FLOOR)


def _parity(rank: int, world: int, args: tuple[str, Any]) -> float | None:
    """One SGD step of ``plan`` on this process group vs one device: max relative error."""
    spec, plan = args
    built = build_model(spec, "tiny", dtype="float64")
    config = TrainConfig("sgd")
    ex = Executor(built.graph, plan, built.state, built.inputs, config)
    loss = ex.step(seed=0)
    state = ex.state_dict()
    if rank != 0:
        return None
    ref = build_model(spec, "tiny", dtype="float64")
    opt = make_optimizer([p for p in ref.model.parameters() if p.requires_grad], config)
    ref_loss = ref.model(*ref.inputs)
    ref_loss.backward()
    opt.step()
    errs = [abs(loss - ref_loss.item()) / abs(ref_loss.item())]
    errs += [_rel_err(state[k], v) for k, v in ref.model.state_dict().items() if v.is_floating_point()]
    return max(errs)


def one(name: str, budget_s: float) -> dict:
    spec = spec_of(name)
    built = build_model(spec, "tiny", dtype="float64")  # the model the parity step trains
    t0 = time.perf_counter()
    graph = trace(built.model, built.inputs)
    row: dict[str, Any] = {"model": name, "capture": getattr(graph, "capture", "fx"),
                           "trace_s": time.perf_counter() - t0, "ops": len(graph),
                           "opaque": sum(n.kind == OPAQUE for n in graph)}
    for topo in ("local-cpu-2", "a100-1x8"):
        found = search(graph, topology=topo, budget_s=budget_s, seed=0)
        best = min(found.baselines, key=found.baselines.get)
        row[topo] = (found.predicted_ms, found.baselines[best], best)
        if topo == "local-cpu-2":
            plan = found.strategy
    row["max_rel_err"] = spawn_gloo(_parity, (spec, plan), world=2)
    return row


def llama_8b_on_meta() -> tuple[float, float, int]:
    """Seconds to trace zoo llama tiny, then default (LLaMA-3 8B's shape) on the meta device,
    and the default's op count."""
    from soapsearch import zoo

    times = []
    for variant, device in (("tiny", "cpu"), ("default", "meta")):
        model, inputs = zoo.build("llama", variant, device=device)
        t0 = time.perf_counter()
        graph = trace(model, inputs)
        times.append(time.perf_counter() - t0)
    return times[0], times[1], len(graph)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(HF + list(OTHERS)))
    p.add_argument("--budget-s", type=float, default=4.0, help="search seconds per topology")
    args = p.parse_args()
    head = (f"{'model':22s} {'capture':7s} {'ops':>4s} {'opaque':>6s} {'local-cpu-2 found / best':>30s} "
            f"{'a100-1x8 found / best':>30s} {'parity err':>10s} {'trace s':>7s}")
    print(head)
    for name in args.models.split(","):
        try:
            r = one(name, args.budget_s)
        except Exception as e:  # a model that does not go in is a row of the table, not a crash
            print(f"{name:22s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        cells = [f"{r[t][0]:.3f} / {r[t][1]:.3f} {r[t][2]}" for t in ("local-cpu-2", "a100-1x8")]
        print(f"{r['model']:22s} {r['capture']:7s} {r['ops']:4d} {r['opaque']:6d} {cells[0]:>30s} "
              f"{cells[1]:>30s} {r['max_rel_err']:10.1e} {r['trace_s']:7.2f}")
    tiny_s, default_s, ops = llama_8b_on_meta()
    print(f"\nzoo llama at LLaMA-3 8B's shape on meta: {ops} ops traced in {default_s:.1f} s "
          f"(tiny: {tiny_s:.2f} s)")


if __name__ == "__main__":
    main()
