"""The memory model's kept bytes against what autograd saves (``benchmarks/saved_bytes.py``):
the tiny gpt and llama in float32, each op's rule run whole with autograd on, every saved
storage counted once. gpt: equal but the cross-entropy's few bytes of scalars; llama: equal but
RMSNorm, whose CPU kernel is torch's composite (it saves x·rstd, one output's bytes, besides
the input and rstd that ``_fused_rms_norm`` saves)."""

from __future__ import annotations

import pytest

from benchmarks.saved_bytes import saved_table
from soapsearch.executor import build_model


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_kept_bytes_are_what_torch_saves(model):
    built = build_model(model, "tiny", dtype="float32")
    rows = saved_table(built)
    ours, theirs = sum(r[2] for r in rows), sum(r[3] for r in rows)
    norms = sum(4 * n.output.numel for n in built.graph if n.kind == "rms_norm")
    assert 0 <= theirs - norms - ours <= 16, (ours, theirs, norms)
    views = [r for r in rows if r[1] in ("reshape", "permute") and r[2]]
    assert not views  # a view keeps its input's storage, nothing of its own
