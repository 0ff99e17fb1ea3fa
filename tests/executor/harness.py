"""Launch the parity worker for a batch of cases and compare each with the reference."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from soapsearch.executor import build_model
from tests.executor import _worker
from tests.executor.gloo import free_port, run_rank
from tests.executor.reference import reference_train

RTOL, ATOL = 1e-7, 1e-8
"""float64 parity (unit roundoff u = 2^-53 ≈ 1.1e-16). The executor adds the same terms as one
device in another order (partial sums per partition, then a collective); a reordered sum of n
terms differs by at most (n - 1)·u·Σ|terms| (Higham, Accuracy and Stability of Numerical
Algorithms, §4.2), far below 1e-7 of the result unless the terms cancel. ATOL covers the
elements that are themselves cancellation noise (a batchnorm's gradient over two samples per
partition, where Σ(x - mean) = 0)."""
F32_RTOL, F32_ATOL = 1e-4, 1e-6
"""float32 runs (u = 2^-24 ≈ 6e-8; test_run.py's torchrun test trains the model as built, in
float32, and reads its losses from lines printed to 6 decimals)."""
HF_ATOL = 1e-4
"""Hugging Face models: transformers computes the loss in float32 whatever the model's dtype
(test_parity_hf.py's docstring gives the bound)."""


def launch(cases: list[tuple], world: int, fn: Callable = _worker.run_cases) -> dict[int, dict]:
    """Run every case on ``world`` gloo processes in one launch of ``fn(rank, world, port, cases,
    out_dir)`` (``_worker.run_cases``: the parity worker); case index -> what rank 0 saved as
    ``<index>.pt`` (or {"error": ...} from the ranks' ``<index>.rank<r>.pt``)."""
    with tempfile.TemporaryDirectory() as d:
        failure = None
        try:
            mp.spawn(run_rank, args=(fn, world, free_port(), cases, d), nprocs=world, join=True)
        except Exception as e:  # a failed case stops the batch; later cases report it
            failure = str(e)
        out = {}
        for i in range(len(cases)):
            p = Path(d) / f"{i}.pt"
            errs = sorted(Path(d).glob(f"{i}.rank*.pt"))
            if errs:
                out[i] = {"error": "\n".join(torch.load(e)["error"] for e in errs)}
            elif p.exists():
                out[i] = torch.load(p, weights_only=False)
            else:
                out[i] = {"error": f"not run: the batch stopped earlier ({failure})"}
        return out


_REF: dict = {}


def reference(model_name: str, opt: str, microbatches: int, batch_size: int | None = None) -> dict:
    key = (model_name, opt, microbatches, batch_size)
    if key not in _REF:
        built = build_model(model_name, "tiny", batch_size=batch_size, dtype="float64")
        cfg = _worker.OPTIMIZERS[opt]
        _REF[key] = reference_train(built.model, built.inputs, built.graph, cfg, _worker.STEPS, microbatches)
    return _REF[key]


def compare(model_name: str, result: dict, batch_size: int | None = None, *, rtol: float = RTOL,
            atol: float = ATOL) -> None:
    """Assert loss, gradients and state after each step equal the single-device reference."""
    assert "error" not in result, result.get("error")
    for opt in _worker.OPTIMIZERS:
        ref, got = reference(model_name, opt, result["microbatches"], batch_size), result[opt]
        for s in range(_worker.STEPS):
            where = f"{opt} step {s + 1}"
            torch.testing.assert_close(got["losses"][s], ref["losses"][s], rtol=rtol, atol=atol,
                                       msg=lambda m: f"{where} loss: {m}")
            assert set(got["grads"][s]) == set(ref["grads"][s]), where
            for k, g in ref["grads"][s].items():
                torch.testing.assert_close(got["grads"][s][k], g, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{where} grad {k}: {m}")
            for k, v in ref["states"][s].items():
                torch.testing.assert_close(got["states"][s][k], v, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{where} state {k}: {m}")


def case_id(case: tuple) -> str:
    """A parity case's test id: model (its factory's module left out), plan, batch size."""
    return "-".join(map(str, case)).rpartition(":")[2]


def parity_tests(cases_2: list[tuple], cases_4: list[tuple]) -> tuple:
    """The module-scoped launches and the per-case tests of a parity module:
    ``results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(...)``.
    A case is (model, plan[, batch size]); each launch runs all of one world size's cases once."""
    import pytest

    @pytest.fixture(scope="module")
    def results2():
        return launch(cases_2, 2)

    @pytest.fixture(scope="module")
    def results4():
        return launch(cases_4, 4)

    @pytest.mark.parametrize("i", range(len(cases_2)), ids=[case_id(c) for c in cases_2])
    def test_parity_2_processes(results2, i):
        model, _, *batch = cases_2[i]
        compare(model, results2[i], *batch)

    @pytest.mark.parametrize("i", range(len(cases_4)), ids=[case_id(c) for c in cases_4])
    def test_parity_4_processes(results4, i):
        model, _, *batch = cases_4[i]
        compare(model, results4[i], *batch)

    return results2, results4, test_parity_2_processes, test_parity_4_processes
