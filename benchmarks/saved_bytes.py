"""saved_bytes.py: what autograd saves for backward against what the memory model keeps, op by
op (issue 24). Each op of a zoo model's graph runs its rule's forward on its whole box, in graph
order with autograd on, under ``torch.autograd.graph.saved_tensors_hooks``; every saved tensor's
storage is counted once (a view shares its base's storage), weights and constants left out. A
storage that is an op's output is that op's row ("torch"); what an op saves that is no op's
output (a norm's rstd, attention's logsumexp, a dropout's mask, a copy made inside) is the
saving op's row. "model" is ``OpPieces.activations`` of the one-device plan
(``strategies.saved``, ``strategies.pieces``). Units: bytes, and per layer s·b·h elements.

    python benchmarks/saved_bytes.py                         # tiny gpt and llama, float32
    python benchmarks/saved_bytes.py --model llama --variant small --all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soapsearch.executor import build_model  # noqa: E402
from strategies import data_parallel  # noqa: E402
from strategies.lowered import WEIGHT_KINDS  # noqa: E402
from strategies.lowering import lower  # noqa: E402
from strategies.region import full_box, slice_box  # noqa: E402
from strategies.rules import get_rule  # noqa: E402

__all__ = ["torch_saved", "model_kept", "saved_table"]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def torch_saved(built) -> dict[str, int]:
    """Op -> bytes of the storages autograd saves that are its output or, being no op's
    output, that it saved; each storage once, weights and constants left out."""
    graph, state = built.graph, built.state
    values: dict[str, torch.Tensor] = {}
    saved: list[tuple[str, torch.Tensor]] = []
    for node in graph:
        if node.kind == "input":
            x = built.inputs[node.attrs["index"]]
            values[node.name] = x
            continue
        if node.kind in WEIGHT_KINDS:
            w = state[node.weights[0].name]
            values[node.name] = w.detach().requires_grad_() if w.is_floating_point() and graph.needs_grad[node.name] \
                else w
            continue
        box = full_box(node.shape)
        rule = get_rule(node.kind)
        ins = [None if r is None else values[i][slice_box(r)]
               for i, r in zip(node.inputs, rule.input_regions(node, box))]
        weights = {}
        for role, r in rule.weight_regions(node, box).items():
            w = state[node.weight(role).name]
            weights[role] = (w.detach().requires_grad_() if w.is_floating_point() else w)[slice_box(r)]

        def pack(t, name=node.name):
            saved.append((name, t))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            values[node.name] = rule.forward(node, box, ins, weights)
    owner = {}
    for node in graph:  # an output's storage is its producer's: the first op in graph order
        if node.kind not in WEIGHT_KINDS and node.kind != "input" or graph.needs_grad[node.name]:
            owner.setdefault(_ptr(values[node.name]), node.name)
    constant = {_ptr(values[n.name]) for n in graph if n.kind in WEIGHT_KINDS}
    constant |= {_ptr(t) for t in state.values()}
    out: dict[str, int] = {}
    seen: set[int] = set()
    for name, t in saved:
        p = _ptr(t)
        if p in seen or p in constant or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(p)
        who = owner.get(p, name)
        out[who] = out.get(who, 0) + t.untyped_storage().nbytes()
    return out


def model_kept(built) -> dict[str, int]:
    """Op -> bytes the memory model keeps for it per micro-batch on one device (its output
    where a backward reads it, a dropout's mask): ``OpPieces.activations``."""
    low = lower(built.graph, data_parallel(built.graph, 1))
    return {n.name: low.pieces[n.name].activations[0] for n in built.graph
            if n.kind not in WEIGHT_KINDS and low.pieces[n.name].activations[0]}


def saved_table(built) -> list[tuple[str, str, int, int]]:
    """(op, kind, model bytes, torch bytes) of every op either counts, in graph order."""
    ours, theirs = model_kept(built), torch_saved(built)
    return [(n.name, n.kind, ours.get(n.name, 0), theirs.get(n.name, 0)) for n in built.graph
            if ours.get(n.name) or theirs.get(n.name)]


def _layer_unit(built) -> int:
    """Bytes of one s·b·h tensor of the residual stream (the embedding's output)."""
    emb = next(n for n in built.graph if n.kind == "embedding")
    return emb.output.numel * torch.empty((), dtype=getattr(torch, emb.output.dtype)).element_size()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="zoo model (repeatable); default gpt and llama")
    ap.add_argument("--variant", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--all", action="store_true", help="every op, not only those where the two differ")
    args = ap.parse_args(argv)
    for model in args.model or ["gpt", "llama"]:
        built = build_model(model, args.variant, dtype=args.dtype)
        rows, unit = saved_table(built), _layer_unit(built)
        layers = sum(1 for n in built.graph if n.kind in ("layernorm", "rms_norm")) // 2
        print(f"{model} {args.variant} {args.dtype}: s·b·h = {unit} bytes, {layers} layers")
        print("| op | kind | model B | torch B | model − torch (s·b·h) |\n| --- | --- | ---: | ---: | ---: |")
        for name, kind, ours, theirs in rows:
            if args.all or ours != theirs:
                print(f"| {name} | {kind} | {ours} | {theirs} | {(ours - theirs) / unit:+.2f} |")
        ours, theirs = sum(r[2] for r in rows), sum(r[3] for r in rows)
        print(f"| total | | {ours} | {theirs} | {(ours - theirs) / unit:+.2f} |")


if __name__ == "__main__":
    main()
