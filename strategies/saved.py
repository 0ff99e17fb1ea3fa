"""What an op's backward reads, per op kind: autograd's saved tensors (the tensors
``torch.autograd.graph.saved_tensors_hooks`` sees an op's forward save;
``tests/strategies/test_saved.py`` checks each rule against them), the per-op rule behind
Korthikanti et al. 2022 §4's count of a GPT layer (eq. 1–6): a linear saves its input, not its
output; an add saves nothing; softmax its output; dropout its mask (1 byte an element); GELU
and layer norm their input (and its row statistics: ``saved_extra``); a mul an operand only
for the other's gradient (``reads_from``); a view nothing of its own. A kind not listed here
reads every input and its output back (an upper bound). ``benchmarks/saved_bytes.py`` prints
the bytes op by op against autograd's (``tests/strategies/test_saved_bytes.py``)."""

from __future__ import annotations

import math

from strategies.graph import OpNode

__all__ = ["KIND_READS", "INPUT", "OUTPUT", "NOTHING", "ALIAS", "backward_reads", "reads_input", "reads_from",
           "saves_output", "aliases", "saved_extra", "mask_bytes"]

INPUT, OUTPUT, NOTHING, ALIAS = "input", "output", "nothing", "alias"
"""What a backward reads: its inputs (not its output), its output only, nothing, or nothing of
its own (a view: its output is its input's storage, needed where its own output is)."""

KIND_READS = {
    "linear": INPUT,  # addmm / mm: saves the input and the weight
    "matmul": INPUT,  # bmm: saves both operands
    "mul": INPUT,  # saves the other operand of each
    "layernorm": INPUT,  # native_layer_norm: the input, its mean and rstd (saved_extra)
    "rms_norm": INPUT,
    "embedding": INPUT,  # the indices
    "loss": INPUT,  # cross-entropy's log-softmax, the input's size
    "add": NOTHING,  # ∂(a + b) passes the output's gradient on
    "concat": NOTHING,  # the gradient is cut into the inputs' sizes
    "softmax": OUTPUT,  # _softmax_backward_data(grad, output)
    "log_softmax": OUTPUT,
    "reshape": ALIAS,  # view / _unsafe_view: sizes only
    "permute": ALIAS,
    "flatten": ALIAS,
    "slice": ALIAS,
}

_FUNCTIONS = {
    **dict.fromkeys(("F.gelu", "F.silu", "F.mish", "F.elu", "F.selu", "F.celu", "F.leaky_relu", "F.softplus",
                     "F.hardswish", "F.hardsigmoid", "F.hardtanh", "F.relu6", "F.logsigmoid",
                     "torch.sin", "torch.cos", "torch.log", "torch.sqrt", "torch.rsqrt"), INPUT),
    # relu / sigmoid / tanh / exp: threshold_backward / sigmoid_backward / tanh_backward read the result
    **dict.fromkeys(("F.relu", "torch.relu", "Tensor.relu", "F.sigmoid", "torch.sigmoid", "Tensor.sigmoid",
                     "F.tanh", "torch.tanh", "Tensor.tanh", "torch.exp", "Tensor.exp"), OUTPUT),
    **dict.fromkeys(("operator.neg", "operator.add", "operator.sub", "operator.pos", "torch.neg"), NOTHING),
}


def _identity_dropout(node: OpNode) -> bool:
    return float(node.attrs["p"]) == 0.0 or not node.attrs["training"]


def backward_reads(node: OpNode) -> str | None:
    """``INPUT``, ``OUTPUT``, ``NOTHING`` or ``ALIAS`` for ``node``'s kind (an elementwise op's
    by its function: a scalar operand saves nothing of it); None: not known, everything. A
    dropout that drops saves its mask only (``saved_extra``); one that does not (p = 0 or
    eval) returns its input: an alias."""
    kind = node.kind
    if kind == "dropout":
        return ALIAS if _identity_dropout(node) else NOTHING
    if kind == "elementwise":
        return _FUNCTIONS.get(node.attrs.get("fn"))
    return KIND_READS.get(kind)


def reads_input(node: OpNode) -> bool:
    """Its backward reads its inputs (every input slot; a kind not listed does)."""
    return backward_reads(node) in (INPUT, None)


OPERANDS = frozenset({"mul", "matmul"})
"""Kinds whose backward reads each operand for the other's gradient only (derivatives.yaml
``mul.Tensor``: self's gradient is grad·other, other's grad·self; ``bmm`` alike): autograd saves
an operand only where another one needs a gradient (x·cos with a constant cos saves cos alone)."""


def reads_from(graph, node: OpNode, producer: str) -> bool:
    """Its backward reads the output of ``producer`` (one of its inputs): ``reads_input``, and
    for ``OPERANDS`` only where another operand needs a gradient (an input of another slot, a
    trainable weight), or ``producer`` fills two slots (x·x)."""
    if not reads_input(node):
        return False
    if node.kind not in OPERANDS:
        return True
    slots = sum(1 for s in node.inputs if s == producer)
    return (any(graph.needs_grad[s] for s in node.inputs if s != producer) or any(w.trainable for w in node.weights)
            or (slots > 1 and graph.needs_grad[producer]))


def saves_output(node: OpNode) -> bool:
    """Its backward reads its own output (a kind not listed does)."""
    return backward_reads(node) in (OUTPUT, None)


def aliases(node: OpNode) -> bool:
    """Its output is a view of its input: the input is read back where the output is."""
    return backward_reads(node) == ALIAS


def mask_bytes(node: OpNode, numel: int) -> int:
    """A dropout that drops keeps its mask for ``numel`` output elements, one byte an element
    (a bool tensor; Korthikanti et al. 2022 §4.1's sbh); 0 for any other op."""
    return numel if node.kind == "dropout" and not _identity_dropout(node) else 0


def _stat_bytes(node: OpNode) -> int:
    """Bytes of one row statistic in the accumulate type torch keeps (float32; float64 for a
    float64 tensor)."""
    return 8 if node.output.dtype == "float64" else 4


def saved_extra(node: OpNode, numel: int) -> int:
    """Bytes its backward keeps besides inputs and output for ``numel`` output elements: a
    dropout's mask (``mask_bytes``); layer norm's mean and rstd per row (derivatives.yaml
    ``native_layer_norm``: input, mean, rstd), RMSNorm's rstd per row (``_fused_rms_norm``:
    input, rstd), scaled-dot-product attention's logsumexp per query row and head (``_scaled_
    dot_product_flash_attention``: q, k, v, output, logsumexp), each in the accumulate type."""
    kind = node.kind
    if kind == "dropout":
        return mask_bytes(node, numel)
    if kind in ("layernorm", "rms_norm"):
        row = math.prod(node.attrs["normalized_shape"])
        return (2 if kind == "layernorm" else 1) * (numel // row) * _stat_bytes(node)
    if kind == "attention":  # output [.., heads, queries, head dim]: a logsumexp per (.., head, query)
        return numel // node.output.shape[-1] * _stat_bytes(node)
    return 0
