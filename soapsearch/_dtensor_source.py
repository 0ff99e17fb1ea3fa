"""The Python file ``soapsearch export --format dtensor`` writes: ``TP_PLAN``, the mesh
helper and ``parallelize(model, mesh)``, the shape of torchtitan's ``parallelize_llama``."""

from __future__ import annotations

from soapsearch.export_dtensor import DTensorPlan

__all__ = ["python_source"]

_CPU_ATTENTION = '''

def _register_cpu_attention() -> None:
    """DTensor has sharding rules for the CUDA attention kernels, not the CPU one: heads
    (Shard(1)), batch (Shard(0)) or whole, the same for every input and output."""
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten

    def rules(n_in: int, n_out: int, n_none: int):
        return [([p] * n_out, [p] * n_in + [None] * n_none) for p in (Shard(1), Shard(0), Replicate())]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return rules(3, 2, 2)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
        return rules(6, 3, 2)
'''


_LOSS_PARALLEL_USAGE = """
    with loss_context():              # loss_parallel(): forward and backward both inside
        loss = model(*batch)          # or loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
"""
_LOCAL_LOSS_USAGE = """
    with loss_context():              # nothing to enter for this plan; kept so code fits any export
        loss = model(*batch)
        loss.backward()
"""


def python_source(plan: DTensorPlan, plan_path: str) -> str:
    """The generated module's text."""
    styles = "\n".join(f"    {s.fqn!r}: {s.source()},  # op {s.op}" for s in plan.styles)
    used = sorted({s.name for s in plan.styles})
    params = "".join(f"{p!r}, " for p in plan.replicated_parameters)
    cpu = _CPU_ATTENTION if plan.sharded_attention else ""
    register = ("    if tp_mesh.device_type == \"cpu\":\n        _register_cpu_attention()\n"
                if plan.sharded_attention else "")
    if plan.loss_parallel:
        usage = _LOSS_PARALLEL_USAGE
        loss = ("the cross-entropy is cut on its classes: the lm_head's logits stay a DTensor "
                "Shard(-1)\nand loss_parallel() computes it without gathering them (max and sum-exp "
                "all-reduced over the\ntp ranks); the loss it returns is a Replicate DTensor "
                "(loss.full_tensor() to log it).")
    else:
        usage = _LOCAL_LOSS_USAGE
        loss = "the loss reads whole logits: loss_context() enters nothing."
    return f'''"""Tensor parallelism for {plan.model}, exported by soapsearch from {plan_path}: the plan's
Megatron-shaped configs as torch.distributed.tensor.parallel styles (torchtitan's
parallelize_llama shape). TP = {plan.tp} tensor-parallel ranks per data-parallel group, DP = {plan.dp} groups;
rank i·TP + j is tp rank j of group i, as the plan numbers its devices.

    mesh = make_mesh("cuda")          # (dp, tp) = ({plan.dp}, {plan.tp}); one process per device
    model = parallelize(model, mesh)  # tensor parallelism over mesh["tp"]
    # data parallelism over mesh["dp"] as your training code does it (each group reads its
    # 1/DP of the batch; torchtitan: fully_shard(model, mesh=mesh["dp"]))
{usage}
LOSS_PARALLEL = {plan.loss_parallel}: {loss}
"""

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ({", ".join(used)},
                                             loss_parallel, parallelize_module)

TP = {plan.tp}
DP = {plan.dp}
LOSS_PARALLEL = {plan.loss_parallel}
"""Whether the cross-entropy runs under loss_parallel() on logits Shard(-1) on the classes."""

TP_PLAN = {{
{styles}
}}
"""Module FQN -> ParallelStyle, applied over the tp mesh."""

REPLICATED_PARAMETERS = ({params})
"""Parameters the model reads outside any module where sequence-parallel ops use them:
Replicate DTensors on the tp mesh, so the sum with a sequence shard shards too."""
{cpu}

def loss_context():
    """Where the loss and its backward run: loss_parallel() when LOSS_PARALLEL (torch's
    vocab-parallel cross-entropy over the tp ranks), else nothing."""
    return loss_parallel() if LOSS_PARALLEL else contextlib.nullcontext()


def make_mesh(device_type: str = "cuda") -> DeviceMesh:
    """The (dp, tp) mesh of DP·TP ranks (torch.distributed initialized)."""
    return init_device_mesh(device_type, (DP, TP), mesh_dim_names=("dp", "tp"))


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Apply TP_PLAN over ``mesh["tp"]`` (or ``mesh`` itself when it is 1-D of TP ranks)."""
    tp_mesh = mesh["tp"] if mesh.ndim == 2 else mesh
    if tp_mesh.size() != TP:
        raise ValueError(f"the tp mesh has {{tp_mesh.size()}} ranks; this plan is for TP = {{TP}}")
{register}    parallelize_module(model, tp_mesh, TP_PLAN)
    for name in REPLICATED_PARAMETERS:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        value = getattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(distribute_tensor(value.data, tp_mesh, [Replicate()]),
                                                 requires_grad=value.requires_grad))
    return model
'''
