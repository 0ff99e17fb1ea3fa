"""``soapsearch export --format dtensor``: the megatron plan of zoo gpt, without and with
sequence parallelism, as parallelize_module styles; the exported file trained on 2 gloo
processes against one device (the loss under its ``loss_context()``: ``loss_parallel()`` where the
cross-entropy is cut on its classes); refusals in one line."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from soapsearch import trace, zoo
from soapsearch._dtensor_source import python_source
from soapsearch.cli import main
from soapsearch.export_dtensor import dtensor_plan, module_names
from strategies import ParallelConfig, PlanError, baseline, save_strategy
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.conftest import cli_error


@pytest.fixture(scope="module")
def gpt():
    model, inputs = zoo.build("gpt", "tiny")
    return model, trace(model, inputs, name="gpt-tiny")


def _class_cut(graph) -> bool:
    """Whether the cross-entropy's rule has its ``classes`` dim (the megatron plan then cuts it)."""
    return any(d.name == "classes" for d in graph["cross_entropy"].dims)


def _head(sp: bool, class_cut: bool) -> str:
    """lm_head, column-parallel on the vocabulary: its logits Shard(-1) into loss_parallel() where
    the loss is cut on its classes, else gathered."""
    kw = ["input_layouts=Shard(1)"] if sp else []
    kw.append("use_local_output=False" if class_cut else "output_layouts=Replicate()")
    return f"ColwiseParallel({', '.join(kw)})"


def _block_sp(i: int) -> dict[str, str]:
    b = f"blocks.{i}."
    col = "ColwiseParallel(input_layouts=Shard(1), use_local_output=False)"
    return {b + "ln_1": "SequenceParallel()", b + "attn.q": col, b + "attn.k": col, b + "attn.v": col,
            b + "attn.proj": "RowwiseParallel(output_layouts=Shard(1))", b + "attn.dropout": "SequenceParallel()",
            b + "ln_2": "SequenceParallel()", b + "mlp.fc": "ColwiseParallel(input_layouts=Shard(1))",
            b + "mlp.proj": "RowwiseParallel(output_layouts=Shard(1))", b + "mlp.dropout": "SequenceParallel()"}


def _block(i: int) -> dict[str, str]:
    """Megatron without sequence parallelism: the norms, dropouts and residual adds run
    replicated on the tp ranks, the column linears read and the row linears all-reduce to Replicate."""
    b = f"blocks.{i}."
    col = "ColwiseParallel(use_local_output=False)"
    return {b + "attn.q": col, b + "attn.k": col, b + "attn.v": col, b + "attn.proj": "RowwiseParallel()",
            b + "mlp.fc": "ColwiseParallel()", b + "mlp.proj": "RowwiseParallel()"}


def expected(sp: bool, class_cut: bool) -> dict[str, str]:
    if sp:
        return {"wte": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)",
                "drop": "SequenceParallel()", **_block_sp(0), **_block_sp(1), "ln_f": "SequenceParallel()",
                "lm_head": _head(sp, class_cut)}
    return {"wte": "RowwiseParallel(input_layouts=Replicate())", **_block(0), **_block(1),
            "lm_head": _head(sp, class_cut)}


@pytest.mark.parametrize("sp", [False, True], ids=["megatron", "megatron_sp"])
@pytest.mark.parametrize("devices", [2, 4])
def test_megatron_gpt_mapping(gpt, devices, sp):
    model, graph = gpt
    strategy = baseline("megatron", graph, devices, tp=2, sequence_parallel=sp)
    plan = dtensor_plan(graph, strategy, module_names(model))
    assert plan.mapping == expected(sp, _class_cut(graph))
    assert (plan.tp, plan.dp) == (2, devices // 2)
    assert plan.replicated_parameters == (("wpe",) if sp else ()) and plan.sharded_attention
    assert plan.loss_parallel == _class_cut(graph)


def _refusal(graph, model, strategy) -> str:
    with pytest.raises(PlanError) as e:
        dtensor_plan(graph, strategy, module_names(model))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refused(gpt):
    model, graph = gpt
    meg = baseline("megatron", graph, 4, tp=2)
    msg = _refusal(graph, model, baseline("owt", graph, 2))
    assert msg.startswith("op 'blocks_0_attn_dropout': config = 'A2 @ 0-1'") and "no ParallelStyle" in msg
    assert "no op is cut" in _refusal(graph, model, baseline("data_parallel", graph, 4))
    fc = graph["blocks_0_mlp_fc"]  # S4×A8×P64×R16: out_features and in_features both cut
    both = meg.replace(fc.name, ParallelConfig((2, 1, 2, 2), tuple(range(8))))
    both = type(both)(both.configs, 8)
    msg = _refusal(graph, model, both)
    assert msg.startswith("op 'blocks_0_mlp_fc'") and "cut on both 'out_features' and 'in_features'" in msg
    swapped = meg.replace(fc.name, ParallelConfig(meg[fc.name].degrees, (0, 2, 1, 3)))
    msg = _refusal(graph, model, swapped)
    assert msg.startswith("op 'blocks_0_mlp_fc': devices = [0, 2, 1, 3]: partition 1 (sample 0) on device 2, not 1")
    assert "microbatches" in _refusal(graph, model, meg.with_microbatches(2))
    assert _refusal(graph, model, meg.with_precision("bf16")).startswith("precision = 'bf16': the export writes")
    zero = meg.replace(fc.name, meg[fc.name].with_memory(zero=1))
    assert _refusal(graph, model, zero).startswith("op 'blocks_0_mlp_fc': zero = 1: the export writes")
    again = meg.replace(fc.name, meg[fc.name].with_memory(recompute=True))
    assert _refusal(graph, model, again).startswith("op 'blocks_0_mlp_fc': recompute = True: the export")
    msg = _refusal(graph, model, baseline("megatron", graph, 4, tp=2, pp=2))
    assert msg.startswith("op 'wte': devices = '0-1': runs on 2 of the plan's 4 devices: "
                          "pipeline stages (pp > 1)"), msg


def test_refused_loss_parallel(gpt):
    """A cross-entropy cut on its classes is loss_parallel()'s only where its logits are cut alike
    and it has no label smoothing."""
    model, graph = gpt
    if not _class_cut(graph):
        pytest.skip("the cross-entropy rule has no 'classes' dim in this tree")
    meg = baseline("megatron", graph, 2, tp=2)
    whole = meg.replace("view_8", ParallelConfig((2, 1), (0, 1)))  # the logits' rows, not their classes
    msg = _refusal(graph, model, whole)
    assert msg.startswith("op 'cross_entropy'") and "where its logits 'view_8' are not cut alike" in msg
    loss = graph["cross_entropy"]
    attrs = loss.attrs
    object.__setattr__(loss, "attrs", {**attrs, "label_smoothing": 0.1})  # the frozen node, for this check
    try:
        msg = _refusal(graph, model, meg)
    finally:
        object.__setattr__(loss, "attrs", attrs)
    assert msg.startswith("op 'cross_entropy': label_smoothing = 0.1") and "no label smoothing" in msg


def test_cli(gpt, tmp_path, capsys):
    _, graph = gpt
    plan, out = tmp_path / "plan.json", tmp_path / "tp_plan.py"
    save_strategy(plan, baseline("megatron", graph, 4, tp=2), graph)
    assert main(["export", str(plan), "--format", "dtensor", "-o", str(out)]) == 0
    assert "wrote 14 ParallelStyles for gpt-tiny (TP = 2, DP = 2)" in capsys.readouterr().out
    text = out.read_text()
    assert "TP = 2\nDP = 2\n" in text and "'blocks.1.mlp.proj': RowwiseParallel(),  # op" in text
    assert f"LOSS_PARALLEL = {_class_cut(graph)}\n" in text and "with loss_context():" in text
    save_strategy(plan, baseline("megatron", graph, 4, tp=2, sequence_parallel=True), graph)
    assert main(["export", str(plan), "--format", "dtensor", "-o", str(out)]) == 0
    assert "wrote 24 ParallelStyles for gpt-tiny (TP = 2, DP = 2)" in capsys.readouterr().out
    assert "'blocks.1.mlp.proj': RowwiseParallel(output_layouts=Shard(1))" in out.read_text()
    save_strategy(plan, baseline("owt", graph, 2), graph)
    err = cli_error(capsys, ["export", str(plan), "--format", "dtensor", "-o", str(out)])
    assert "op 'blocks_0_attn_dropout'" in err


def _load(path: str):
    spec = importlib.util.spec_from_file_location("tp_plan_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny():
    model, inputs = zoo.build("gpt", "tiny", dropout=0.0)
    return model.double(), inputs


def _worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    with gloo_group(rank, world, port):
        exported = _load(path)
        ref, inputs = _tiny()
        model, _ = _tiny()
        exported.parallelize(model, exported.make_mesh("cpu"))
        losses, grads = [], {}
        for m in (ref, model):
            with exported.loss_context() if m is model else contextlib.nullcontext():  # as its docstring says
                loss = m(*inputs)
                loss.backward()
            losses.append(loss.full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
            grads[m is ref] = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                               for k, p in m.named_parameters()}
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
        torch.save({"losses": losses, "grads": grads, "weights": weights, "ref": ref.state_dict()},
                   Path(out) / f"{rank}.pt")


def _vocab_parallel(plan):
    """``plan`` with its lm_head's logits kept Shard(-1) into loss_parallel(), as the export writes
    it where the cross-entropy is cut on its classes."""
    styles = tuple(dataclasses.replace(s, kwargs=tuple(kw for kw in s.kwargs if kw[0] != "output_layouts")
                                       + (("use_local_output", "False"),)) if s.fqn == "lm_head" else s
                   for s in plan.styles)
    return dataclasses.replace(plan, styles=styles, loss_parallel=True)


@pytest.mark.parametrize("case", ["megatron", "megatron_sp", "megatron_sp_loss_parallel"])
def test_parity_two_gloo(gpt, tmp_path, case):
    """The exported file on 2 gloo processes (mesh (1, 2) on "cpu") equals one device after one
    SGD step, float64: loss, every gradient, every weight; the loss and backward under the file's
    ``loss_context()``. The loss_parallel case is the export's own where the megatron plan cuts
    the cross-entropy on its classes (the rule's ``classes`` dim), else the same file with the
    lm_head's logits kept Shard(-1)."""
    model, graph = gpt
    plan, path = tmp_path / "plan.json", tmp_path / "tp_plan.py"
    save_strategy(plan, baseline("megatron", graph, 2, tp=2, sequence_parallel=case != "megatron"), graph)
    assert main(["export", str(plan), "--format", "dtensor", "-o", str(path)]) == 0
    if case.endswith("loss_parallel"):
        tp = dtensor_plan(graph, baseline("megatron", graph, 2, tp=2, sequence_parallel=True), module_names(model))
        tp = tp if tp.loss_parallel else _vocab_parallel(tp)
        path.write_text(python_source(tp, str(plan)))
        assert "'lm_head': ColwiseParallel(input_layouts=Shard(1), use_local_output=False)" in path.read_text()
    for got in spawn_ranks(_worker, 2, str(path)):
        ref_loss, loss = got["losses"]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        assert set(got["grads"][False]) == set(got["grads"][True])
        for k, g in got["grads"][True].items():
            torch.testing.assert_close(got["grads"][False][k], g, rtol=1e-10, atol=1e-14, msg=lambda m: f"{k}: {m}")
        for k, w in got["ref"].items():
            torch.testing.assert_close(got["weights"][k], w, rtol=1e-10, atol=1e-14, msg=lambda m: f"{k}: {m}")
