"""The single-device truth the executor must equal: plain PyTorch training of the same model
(torch.optim, autograd), with gradient accumulation over the plan's micro-batches, and the
dropout masks the dropout rule draws (the only thing a split run cannot take from torch's
global RNG). A mixed precision plan's truth (``autocast``) is the same training under
``torch.autocast(dtype)`` over the float32 model (its parameters are the master weights), for
float16 with ``torch.amp.GradScaler``: the scaled loss's backward, ``unscale_`` before the
gradients are read, a step skipped on inf/nan, the scale updated."""

from __future__ import annotations

import contextlib
import contextvars

from typing import Any, Sequence

import torch
import torch.fx as fx

from soapsearch.executor.config import TrainConfig, make_optimizer
from soapsearch.trace import _symbolic_trace
from strategies.graph import OpGraph
from strategies.lowering import partition_box_mb
from strategies.rules import get_rule
from strategies.rules.pointwise import set_dropout_seed


class _Run(fx.Interpreter):
    """Runs the traced model; dropout ops take the rule's mask for this micro-batch's rows."""

    def __init__(self, gm: fx.GraphModule, graph: OpGraph, microbatch: int, microbatches: int):
        super().__init__(gm)
        self.ops, self.j, self.m = graph, microbatch, microbatches

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.ops and self.ops[n.name].kind == "dropout":
            node = self.ops[n.name]
            args, _ = self.fetch_args_kwargs_from_env(n)
            box = partition_box_mb(node, (1,) * len(node.dims), 0, self.j, self.m)
            return get_rule("dropout").forward(node, box, [args[0]], {})
        return super().run_node(n)


def reference_train(model: torch.nn.Module, inputs: Sequence[Any], graph: OpGraph, cfg: TrainConfig,
                    steps: int, microbatches: int = 1, autocast: torch.dtype | None = None) -> dict[str, list]:
    """Per step: the loss, every parameter's gradient and the state_dict after the update (and,
    for float16, the loss scale after it: ``scales``). ``autocast``: the forward runs under
    ``torch.autocast(dtype=autocast)`` (float16: with a GradScaler of ``cfg.loss_scale``). Runs
    in a copy of the caller's context, so the dropout seed it sets does not leak into it."""
    return contextvars.copy_context().run(_train, model, inputs, graph, cfg, steps, microbatches, autocast)


def _train(model: torch.nn.Module, inputs: Sequence[Any], graph: OpGraph, cfg: TrainConfig,
           steps: int, microbatches: int, autocast: torch.dtype | None) -> dict[str, list]:
    if graph.capture == "fx":
        gm = _symbolic_trace(model)
        run = lambda j, mb: _Run(gm, graph, j, microbatches).run(*mb)  # noqa: E731
    else:  # a model fx cannot trace runs as it is: its dropouts must draw nothing
        assert all(n.kind != "dropout" or not (n.attrs["p"] and n.attrs["training"]) for n in graph), \
            "a torch.export-captured reference runs the model itself, whose dropout masks differ"
        run = lambda j, mb: model(*mb)  # noqa: E731
    opt = make_optimizer(model.parameters(), cfg)
    device = next(model.parameters()).device.type
    ctx = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device, init_scale=cfg.loss_scale) if autocast is torch.float16 else None
    out: dict[str, list] = {"losses": [], "grads": [], "states": [], "scales": []}
    batch = inputs[0].shape[0]
    span = batch // microbatches
    for step in range(steps):
        set_dropout_seed(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(microbatches):
            mb = [x[j * span:(j + 1) * span] if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                  for x in inputs]
            with ctx():
                loss = run(j, mb)
            scaled = loss / microbatches
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total += loss.item() / microbatches
        if scaler is not None:
            scaler.unscale_(opt)
        out["losses"].append(total)
        out["grads"].append({k: p.grad.detach().clone() for k, p in model.named_parameters()
                             if p.grad is not None})
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            opt.step()
        out["states"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out
