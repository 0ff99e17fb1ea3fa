"""Parity of mixed precision plans (docs/design.md, "Mixed precision"): a float32 model's plan run
in ``bf16`` / ``fp16`` on 2 and 4 gloo processes equals one device training the same model under
``torch.autocast`` with float32 master weights (``reference.reference_train(autocast=...)``;
fp16 with ``torch.amp.GradScaler``), one step, SGD and Adam: loss, every gradient and every
weight's update, on the zoo mlp and gpt (tiny): data parallel, row-parallel linears (Partial
sums), Megatron-LM tensor parallel and, on 4 processes, Megatron with 2 pipeline stages.

The tolerance. Let ε be the format's relative spacing (bf16 keeps 8 significant bits: ε = 2^-8
≈ 3.9e-3; fp16 11: ε = 2^-11 ≈ 4.9e-4); one rounding moves a value by at most ε/2. The executor
rounds where one device does not: a piece sent to another rank is cast to the compute dtype
(one device keeps an embedding's or a residual add's float32 output), a Partial sum is added in
it on the reader, and a gradient bucket is summed in it (one device sums nothing); and its sums
add terms in another order. Through a forward, a backward and an update a few ops deep those
roundings compound to a few ε of a tensor's scale, so each loss, gradient and update must be
within TOLERANCE·scale (``distances``: the scale is the tensor's largest element): bf16 8ε = 2^-5
(measured worst: 1.9e-2, a gpt Megatron key projection's gradient), fp16 16ε = 2^-7 (measured
worst: 4.8e-3 ≈ 10ε, the gpt position embedding's gradient, a sum over the batch whose terms
cancel: its error is its terms' rounding, not its own).

These bounds are of the order of autocast's own distance to float32, so a float32 run would pass
them too; what tells the executor's bf16 from float32 is its forward: a data-parallel plan's
loss equals the autocast reference's to float32 (the same ops on each sample, only the sum's
order differs) and is over 100 times closer to it than to the same plan run in float32
(``test_bf16_loss_is_autocast_not_float32``; a row-parallel plan, whose Partial sums are
rounded to bf16 on the wire, 4 times)."""

from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from soapsearch.executor import Executor, TrainConfig, build_model
from strategies.collective_buffers import buffer_lives
from strategies.precision import reduce_scale
from strategies.strategy import COMPUTE_DTYPES
from tests.executor.gloo import gloo_group
from tests.executor.harness import launch
from tests.executor.plans import make_plan
from tests.executor.reference import reference_train

pytestmark = pytest.mark.distributed

STEPS = 1
LOSS_SCALE = 2.0**10
"""fp16's initial loss scale here: the gradient buckets hold scaled gradients in fp16 (FSDP2's
reduce_dtype), which overflow past 65504 where one device's float32 ``.grad`` does not; the
tiny models' gradients (|g| < 2) times 2^10 stay far below (GradScaler's default 2^16 would
not: 1.25·2^16 > 65504, and the executor would skip a step one device takes)."""
OPTIMIZERS = {"sgd": TrainConfig("sgd", lr=0.05, momentum=0.9, timeout_s=60, loss_scale=LOSS_SCALE),
              "adam": TrainConfig("adam", lr=0.01, timeout_s=60, loss_scale=LOSS_SCALE)}
TOLERANCE = {"bf16": 2.0**-5, "fp16": 2.0**-7}
"""precision -> the largest |got - want| / scale (``distances``) of a loss, a gradient or an
update: the module docstring derives them."""
GRAD_FLOOR = 2.0**-4
"""A gradient's scale is at least this fraction of the model's largest gradient element."""
OVERFLOW = 2.0**40
"""A loss scale that overflows fp16 in the backward (2^40 times any gradient > 65504)."""

CASES_2 = [("mlp", "dp", "bf16"), ("mlp", "row", "bf16"), ("gpt", "dp", "bf16"), ("gpt", "megatron", "bf16"),
           ("mlp", "dp", "fp16"), ("gpt", "megatron", "fp16"), ("gpt", "zero3_dp+rc_blocks", "bf16"),
           ("gpt", "zero1_dp", "fp16"), ("gpt", "zero3_dp+rc_blocks", "bf16:float32"),
           ("gpt", "zero1_dp", "fp16:float32")]
"""A precision ``p:float32`` runs ``p`` with its gradients reduced in float32 (``Strategy.reduce_dtype``,
FSDP2's ``reduce_dtype=torch.float32``): level 1's bucket and level 3's per-use reduce-scatters."""
CASES_4 = [("mlp", "row", "fp16"), ("gpt", "megatron_pp2", "bf16"), ("gpt", "megatron_pp2", "fp16")]
FLOAT32 = [("mlp", "dp", "model"), ("gpt", "dp", "model"), ("mlp", "row", "model")]
"""The bf16 plans of CASES_2 run in float32 (``test_bf16_loss_is_autocast_not_float32``)."""
SKIP = [("mlp", "row", "fp16", OVERFLOW)]
"""fp16 with a loss scale that overflows: every rank skips the step, as one device's GradScaler."""


def _with_precision(plan, precision: str):
    """``plan`` in ``precision`` ("bf16", or "bf16:float32": its gradients reduced in float32)."""
    precision, _, reduce = precision.partition(":")
    return plan.with_precision(precision, reduce or None)


def run_cases(rank: int, world: int, port: int, cases: list[tuple], out_dir: str) -> None:
    """Each (model, plan, precision[, loss scale]) case, SGD and Adam, on a float32 model; rank 0
    saves losses, full gradients and state_dicts (and the fp16 loss scale) for the parent."""
    with gloo_group(rank, world, port):
        for i, (model_name, plan, precision, *scale) in enumerate(cases):
            try:
                built = build_model(model_name, "tiny")
                strategy = _with_precision(make_plan(built.graph, plan, world), precision)
                result = {}
                for opt, cfg in OPTIMIZERS.items():
                    cfg = replace(cfg, loss_scale=scale[0]) if scale else cfg
                    ex = Executor(built.graph, strategy, built.state, built.inputs, cfg)
                    runs = {"losses": [], "grads": [], "states": [], "scales": []}
                    for s in range(STEPS):
                        runs["losses"].append(ex.step(seed=s))
                        runs["grads"].append(ex.gradients())
                        runs["states"].append(ex.state_dict())
                        if ex.scaler is not None:
                            runs["scales"].append(ex.scaler.scale)
                    result[opt] = runs
                result["microbatches"] = strategy.microbatches
            except Exception:
                torch.save({"error": f"rank {rank}: {traceback.format_exc()}"}, Path(out_dir) / f"{i}.rank{rank}.pt")
                raise
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{i}.pt")


def wire_cases(rank: int, world: int, port: int, cases: list[tuple], out_dir: str) -> None:
    """One step of each (model, plan, precision) case recording, per rank, the dtype and bytes of
    every point-to-point piece sent (forward and backward), every collective's input and every
    gradient bucket's all-reduce, beside what the lowering (the simulator's input) says moves;
    rank 0 saves every rank's record."""
    import soapsearch.executor.reads as reads
    all_reduce, run_collective = dist.all_reduce, reads.run_collective
    with gloo_group(rank, world, port):
        try:
            for i, (model_name, plan, precision) in enumerate(cases):
                built = build_model(model_name, "tiny")
                ex = Executor(built.graph, _with_precision(make_plan(built.graph, plan, world), precision),
                              built.state, built.inputs, OPTIMIZERS["sgd"])
                got = {"forward": [], "backward": [], "collective": [], "bucket": []}
                send, start, syncing = ex.p2p.send, ex.weights.start_bucket, []

                def record_send(t, dst, index, backward, send=send, got=got):
                    got["backward" if backward else "forward"].append((t.dtype, t.numel() * t.element_size()))
                    send(t, dst, index, backward)

                def record_start(*args, start=start, **kwargs):  # a bucket's all-reduce starts here
                    syncing.append(True)
                    try:
                        return start(*args, **kwargs)
                    finally:
                        syncing.clear()

                def record_all_reduce(t, *args, got=got, **kwargs):
                    if syncing:
                        got["bucket"].append((t.dtype, t.numel() * t.element_size()))
                    return all_reduce(t, *args, **kwargs)

                def record_collective(kind, t, group, dim, got=got):
                    got["collective"].append((t.dtype, t.numel() * t.element_size()))
                    return run_collective(kind, t, group, dim)

                ex.p2p.send, ex.weights.start_bucket = record_send, record_start
                dist.all_reduce, reads.run_collective = record_all_reduce, record_collective
                try:
                    ex.step(seed=0)
                finally:
                    dist.all_reduce, reads.run_collective = all_reduce, run_collective
                low = ex.lowered
                remote = [t for t in low.transfers if not t.local]
                calls = [c for c in low.collectives if rank in c.devices]
                want = {"forward": sum(t.nbytes for t in remote if t.src_device == rank),
                        "backward": sum(t.nbytes for t in remote if t.dst_device == rank
                                        and low.graph.moves_grad(t.src_op, t.dst_op)),
                        "collective": sum(c.nbytes // (len(c.devices) if kind == "all_gather" else 1)
                                          for c in calls for kind in (c.kind, c.backward_kind if c.grad else None)
                                          if kind is not None)
                        + sum(life.collective.nbytes // len(life.collective.devices) for life in buffer_lives(low)
                              if life.regather is not None and rank in life.collective.devices),
                        "bucket": sum(b * reduce_scale(low.strategy, key.dtype)
                                      for key, b in low.gradient_sync.buckets.items() if rank in key.devices)}
                mine = {"got": {k: sum(b for _, b in v) for k, v in got.items()}, "want": want,
                        "dtypes": {k: sorted({str(d) for d, _ in v}) for k, v in got.items()}}
                every = [None] * world
                dist.all_gather_object(every, mine)
                if rank == 0:
                    torch.save(every, Path(out_dir) / f"{i}.pt")
        except Exception:
            torch.save({"error": f"rank {rank}: {traceback.format_exc()}"}, Path(out_dir) / f"{i}.rank{rank}.pt")
            raise


_REF: dict = {}


def reference(model_name: str, opt: str, microbatches: int, precision: str, loss_scale: float = LOSS_SCALE) -> dict:
    """One device under torch.autocast(compute dtype) over the float32 model (``model``: no autocast)."""
    key = (model_name, opt, microbatches, precision, loss_scale)
    if key not in _REF:
        built = build_model(model_name, "tiny")
        dtype = getattr(torch, COMPUTE_DTYPES[precision]) if precision in COMPUTE_DTYPES else None
        _REF[key] = reference_train(built.model, built.inputs, built.graph,
                                    replace(OPTIMIZERS[opt], loss_scale=loss_scale), STEPS, microbatches,
                                    autocast=dtype)
    return _REF[key]


def initial(model_name: str) -> dict[str, torch.Tensor]:
    """The model's state before training (the same seed as every run)."""
    key = ("initial", model_name)
    if key not in _REF:
        _REF[key] = {k: v.detach().clone() for k, v in build_model(model_name, "tiny").state.items()}
    return _REF[key]


def distances(result: dict, ref: dict, start: dict[str, torch.Tensor], opt: str, tol: float):
    """(what, max |got - want| / scale) for the loss, every gradient and every weight's update
    (the state after the step minus ``start``) of each step; TOLERANCE bounds it.

    The scale is the largest |want| of the tensor; for a gradient at least GRAD_FLOOR of the
    model's largest gradient element (for an update, lr times that): a gradient that vanishes in exact arithmetic (a key
    projection's bias: softmax is invariant to a shift along the keys) is the rounding noise of
    the terms it sums. Adam's first update is lr·m/√v = lr·g/|g| = ±lr per element: an element
    whose reference gradient is within the gradient tolerance of 0 (its sign is rounding) may
    move the other way, so it is allowed 2·lr apart (and checked for that)."""
    for s in range(STEPS):
        yield f"step {s + 1} loss", abs(result["losses"][s] - ref["losses"][s]) / abs(ref["losses"][s])
        assert set(result["grads"][s]) == set(ref["grads"][s])
        top = max(float(g.abs().max()) for g in ref["grads"][s].values())
        settled = {}
        for k, g in ref["grads"][s].items():
            scale = max(float(g.abs().max()), GRAD_FLOOR * top)
            yield f"step {s + 1} grad {k}", float((result["grads"][s][k].double() - g.double()).abs().max()) / scale
            settled[k] = g.abs() > tol * scale
        before = start if s == 0 else ref["states"][s - 1]
        for k, v in ref["states"][s].items():
            if not v.is_floating_point() or k not in ref["grads"][s]:
                continue
            want = v.double() - before[k].double()
            diff = (result["states"][s][k].double() - v.double()).abs()
            if opt == "adam" and s == 0:
                lr = OPTIMIZERS[opt].lr
                assert float(diff.max()) <= 2 * lr * (1 + 2.0**-6), (k, float(diff.max()))
                diff = diff[settled[k]]
            scale = max(float(want.abs().max()), OPTIMIZERS[opt].lr * GRAD_FLOOR * top)
            yield f"step {s + 1} update {k}", float(diff.max()) / scale if diff.numel() else 0.0


def check(case: tuple, result: dict) -> None:
    model, _, precision = case
    precision = precision.split(":")[0]
    assert "error" not in result, result.get("error")
    tol = TOLERANCE[precision]
    for opt in OPTIMIZERS:
        ref = reference(model, opt, result["microbatches"], precision)
        for what, e in distances(result[opt], ref, initial(model), opt, tol):
            assert e <= tol, f"{case} {opt} {what}: {e:.3g} > the {precision} tolerance {tol:.3g}"
        if precision == "fp16":
            assert result[opt]["scales"] == ref["scales"], (case, opt)


@pytest.fixture(scope="module")
def results2():
    return launch(CASES_2 + FLOAT32 + SKIP, 2, run_cases)


@pytest.fixture(scope="module")
def results4():
    return launch(CASES_4, 4, run_cases)


@pytest.mark.parametrize("i", range(len(CASES_2)), ids=["-".join(c) for c in CASES_2])
def test_parity_2_processes(results2, i):
    check(CASES_2[i], results2[i])


@pytest.mark.parametrize("i", range(len(CASES_4)), ids=["-".join(c) for c in CASES_4])
def test_parity_4_processes(results4, i):
    check(CASES_4[i], results4[i])


@pytest.mark.parametrize("j", range(len(FLOAT32)), ids=["-".join(c[:2]) for c in FLOAT32])
def test_bf16_loss_is_autocast_not_float32(results2, j):
    """The bf16 run's loss is much closer to the autocast reference than to the same plan run in
    float32: over 100 times (to float32's rounding) for data parallel, whose forward is
    autocast's on each sample; 4 times for row-parallel linears, whose Partial sums are rounded
    to bf16 on the wire. A bf16 run that computed in float32 would fail it."""
    model, plan, _ = FLOAT32[j]
    bf16, fp32 = results2[CASES_2.index((model, plan, "bf16"))], results2[len(CASES_2) + j]
    assert "error" not in bf16 and "error" not in fp32, (bf16.get("error"), fp32.get("error"))
    factor = 100 if plan == "dp" else 4
    for opt in OPTIMIZERS:
        ref = reference(model, opt, 1, "bf16")["losses"][0]
        got, other = bf16[opt]["losses"][0], fp32[opt]["losses"][0]
        near, far = abs(got - ref) / abs(ref), abs(got - other) / abs(ref)
        assert far > factor * max(near, 2.0**-24), (opt, near, far)


def test_fp16_overflow_skips_the_step_on_every_rank(results2):
    """A loss scale that overflows fp16: every rank finds an inf (the flags all-reduced), skips
    the optimizer step and halves the scale, as one device's GradScaler does: every weight is
    its initial value, the scale 2^39, the loss reported."""
    model, _, precision, scale = SKIP[0]
    result = results2[len(CASES_2) + len(FLOAT32)]
    assert "error" not in result, result.get("error")
    start = initial(model)
    for opt in OPTIMIZERS:
        ref = reference(model, opt, result["microbatches"], precision, scale)
        assert result[opt]["scales"] == ref["scales"] == [scale / 2], (opt, result[opt]["scales"], ref["scales"])
        for k, v in result[opt]["states"][0].items():
            assert torch.equal(v, start[k]) and torch.equal(ref["states"][0][k], start[k]), (opt, k)
        assert abs(result[opt]["losses"][0] - ref["losses"][0]) <= TOLERANCE[precision] * abs(ref["losses"][0])


@pytest.fixture()
def bf16_plan(tmp_path, capsys):
    from soapsearch.cli import main
    path = tmp_path / "p.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--baseline", "data_parallel", "--devices", "1",
                 "--topology", "a100-1x8", "--dtype", "bf16", "-o", str(path)]) == 0
    capsys.readouterr()
    return path


@pytest.mark.parametrize("extra,precision", [([], "bf16"), (["--dtype", "fp16", "--loss-scale", "1024"], "fp16")])
def test_run_trains_a_mixed_precision_plan(bf16_plan, capsys, extra, precision):
    """``run`` trains a bf16 plan (or the plan given ``--dtype fp16``) and prints the autocast
    reference's loss."""
    from soapsearch.run import main as run
    assert run([str(bf16_plan), "--model", "mlp", "--variant", "tiny", "--steps", "1", "--lr", "0.01",
                "--momentum", "0.9", *extra]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    built = build_model("mlp", "tiny")
    ref = reference_train(built.model, built.inputs, built.graph, TrainConfig(loss_scale=1024), 1,
                          autocast=getattr(torch, COMPUTE_DTYPES[precision]))
    assert float(line.split("loss")[1].split()[0]) == pytest.approx(ref["losses"][0], rel=1e-5)


@pytest.mark.parametrize("argv,says", [
    (["--dtype", "float64"], "--dtype float64: --dtype is the plan's precision (fp32|bf16|fp16, as on "
                             "plan/simulate/search); to cast the model give --model-dtype float64"),
    (["--dtype", "half"], "--dtype half: must be one of fp32|bf16|fp16 (the plan's precision)"),
    (["--dtype", "fp16", "--loss-scale", "1000"], "loss_scale = 1000.0: must be a power of two > 0"),
])
def test_run_bad_dtype_flags_in_one_line(bf16_plan, capsys, argv, says):
    """The old model-cast spelling of ``--dtype`` names ``--model-dtype``; a bad ``--dtype`` or
    loss scale names the rule; in one line, before any process group, from ``python -m
    soapsearch.run`` and ``soapsearch run``."""
    from soapsearch.cli import main
    from soapsearch.run import main as run
    assert run([str(bf16_plan), "--model", "mlp", "--variant", "tiny", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert main(["run", str(bf16_plan), "--model", "mlp", "--variant", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


WIRE = [("gpt", "megatron", "bf16"), ("gpt", "megatron_sp", "bf16"), ("mlp", "row", "fp16"),
        ("gpt", "megatron", "bf16:float32")]


def test_what_moves_is_what_the_simulator_charges():
    """Every byte a bf16/fp16 plan moves between ranks, per rank: the point-to-point pieces
    sent forward and backward, each collective's input (twice where it is gathered again in the
    backward, ``BufferLife.regather``) and each gradient bucket's all-reduce,
    equal the lowering's transfers, collectives and buckets (the simulator's input), all in the
    compute dtype but a plan reducing in float32's buckets, which move twice the bucket's bytes
    in float32 (``strategies.precision.reduce_scale``, as ``simulator.step`` charges them); the
    plans move all four kinds."""
    results = launch(WIRE, 2, wire_cases)
    moved = set()
    for i, (model, plan, precision) in enumerate(WIRE):
        assert "error" not in results[i], results[i]["error"]
        precision, _, reduce = precision.partition(":")
        half = str(getattr(torch, COMPUTE_DTYPES[precision]))
        for rank, r in enumerate(results[i]):
            assert r["got"] == r["want"], (model, plan, rank, r)
            for kind, dtypes in r["dtypes"].items():
                wire = "torch.float32" if kind == "bucket" and reduce else half
                assert set(dtypes) <= {wire, "torch.int64"}, (model, plan, rank, kind, dtypes)
            if reduce:
                assert r["dtypes"]["bucket"] == ["torch.float32"] and r["got"]["bucket"], (model, plan, rank, r)
            moved |= {k for k, b in r["got"].items() if b}
    assert moved == {"forward", "backward", "collective", "bucket"}
