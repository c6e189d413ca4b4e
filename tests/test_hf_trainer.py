"""moelab.hf.trainer: the transformers Trainer with moelab layers — schedules, the aux loss inside
the forward (DDP), per-loss logging (TensorBoard), exact resume, output_router_logits."""

import copy
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moelab
from moelab.balance import attached_step_balance
from moelab.hf.upcycle import upcycle
from moelab.layer import moe_layers
from moelab.methods import get_method
from moelab.routers import ROUTERS
from moelab.schedules import CoinFlipSchedule, CompetitionSchedule, build_schedule

transformers = pytest.importorskip("transformers")
from moelab.hf.trainer import ROUTING_FILE, MoETrainer  # noqa: E402

V = 40
#: a competition schedule that competes on some steps of both halves of a 6-step run (seed 0)
COMPETE = {"omega": 0.5, "competition_warmup": 0.0}


def _model(method: str = "competesmoe", **options):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    if get_method(method).router in ("aoe", "routing-free"):
        # Autonomy-of-Experts' and Routing-Free MoE's factorised gates have no exact upcycling (upcycle
        # refuses it): fresh layers of the upcycled shape take the MLPs' places
        model = upcycle(model, 4, 2, method="smoe")
        for block in model.transformer.h:
            old = block.mlp  # resid_pdrop=0: the layer itself, no dropout after it
            block.mlp = moelab.MoE(16, 4, 2, d_hidden=old.experts.d_hidden, method=method,
                                      activation=old.experts.activation, bias=True, **options)  # fmt: skip
        return model.train()
    return upcycle(model, 4, 2, method=method, **options).train()


def _data(n: int = 24):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, V, (8,), generator=g)), "labels": ids} for _ in range(n)]


def _args(out, **overrides):
    kw = dict(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
        save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def _ctx(model) -> moelab.RoutingContext:
    return model.transformer.h[0].mlp.ctx


def _train_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


# ------------------------------------------------------------------------------------ weight decay
def test_weight_decay_skips_moelabs_temperatures_and_expert_bias_stacks(tmp_path):
    model = _model("xmoe")
    trainer = MoETrainer(model=model, args=_args(tmp_path, weight_decay=0.1), train_dataset=_data())
    by_transformers = set(transformers.Trainer.get_decay_parameter_names(trainer, model))
    ours = set(trainer.get_decay_parameter_names(model))
    vectors = {
        n for n in by_transformers if n.endswith(("router.temperature", "experts.b_in", "experts.b_out"))
    }
    assert (
        len(vectors) == 3 * 2
    )  # two MoE layers; transformers alone would decay them (their names say nothing)
    assert ours == by_transformers - vectors
    assert any(n.endswith("experts.w_in") for n in ours) and any(
        n.endswith("router.embeddings") for n in ours
    )
    optimizer = trainer.create_optimizer()
    shapes = {id(p): (n, p.dim()) for n, p in model.named_parameters()}
    decayed = [shapes[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    assert decayed and all(dim >= 2 and name not in vectors for name, dim in decayed)


# ------------------------------------------------------------------------------------ schedules
def test_competesmoe_builds_its_competition_schedule_and_competes_on_its_steps(tmp_path):
    model = _model()
    trainer = MoETrainer(model=model, args=_args(tmp_path), train_dataset=_data(), schedule_options=COMPETE)
    trainer.train()
    ctx = _ctx(model)
    assert isinstance(ctx.schedule, CompetitionSchedule) and ctx.step == 6 and ctx.total_steps == 6
    expected = build_schedule("competesmoe", 2, 6, seed=0, **COMPETE)
    assert torch.equal(ctx.schedule.table, expected.table)  # the method's schedule, from args.seed
    competing = ctx.schedule.table.any(dim=0).tolist()
    assert any(competing[:3]) and any(competing[3:]) and not all(competing)
    logs = _train_logs(trainer)
    assert len(logs) == 6
    for step, log in enumerate(logs):  # the distillation loss exists exactly on the competition steps
        assert (log["aux_distill"] > 0) == competing[step], (step, log)
        assert (log["aux_diversity"] != 0) == competing[step], (step, log)
        parts = sum(v for k, v in log.items() if k.startswith("aux_") and k != "aux_loss")
        assert parts == pytest.approx(log["aux_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    ("method", "expected"),
    [("competesmoe-v1", CoinFlipSchedule), ("densemoe", CompetitionSchedule), ("smoe", None)],
)
def test_the_trainer_builds_the_schedule_the_method_declares(tmp_path, method, expected):
    model = _model(method)
    options = {"rate": 0.2} if method == "competesmoe-v1" else None
    trainer = MoETrainer(
        model=model, args=_args(tmp_path, max_steps=1), train_dataset=_data(4), schedule_options=options
    )
    trainer.train()
    schedule = _ctx(model).schedule
    assert (schedule is None) if expected is None else isinstance(schedule, expected)
    if method == "competesmoe-v1":
        assert schedule.rate == 0.2 and schedule.num_layers == 2


def test_bad_schedule_options_and_mixed_schedules_are_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"schedule_options keys \['omgea'\] are not allowed; allowed: \['omega'"
    ):
        MoETrainer(
            model=_model(), args=_args(tmp_path), train_dataset=_data(4), schedule_options={"omgea": 0.1}
        )
    mixed = _model("competesmoe-v1")
    mixed.transformer.h[1].mlp = _model("competesmoe").transformer.h[1].mlp
    trainer = MoETrainer(model=mixed, args=_args(tmp_path, max_steps=1), train_dataset=_data(4))
    with pytest.raises(
        ValueError, match=r"use methods \['competesmoe', 'competesmoe-v1'\], which need different "
    ):
        trainer.train()


def test_a_competition_schedule_needs_the_planned_steps():
    from moelab.schedules import model_schedule

    with pytest.raises(
        ValueError, match=r"method 'competesmoe' needs the planned number of steps for its competition"
    ):
        model_schedule(_model(), None)
    assert isinstance(model_schedule(_model("competesmoe-v1"), None), CoinFlipSchedule)  # coin flips do not


def test_a_model_output_that_cannot_carry_the_aux_loss_is_refused(tmp_path):
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = moelab.MoE(8, 4, 2)

        def forward(self, x):
            return self.moe(x).sum()

    model = Bare().train()
    trainer = MoETrainer(model=model, args=_args(tmp_path), train_dataset=_data(4))
    with pytest.raises(
        ValueError,
        match=r"a model output of type Tensor is not allowed under MoETrainer; expected a ModelOutput",
    ):
        trainer.compute_loss(model, {"x": torch.randn(3, 8)})


# ------------------------------------------------------------------------- the aux loss in forward
def test_the_aux_loss_is_part_of_the_forward_that_ddp_wraps(tmp_path):
    """DDP (find_unused_parameters, as the Trainer sets it) on a competition step: the aux loss read
    after the forward marks a parameter ready twice; computed inside the forward it trains."""
    model = _model()
    trainer = MoETrainer(model=model, args=_args(tmp_path), train_dataset=_data(4), schedule_options=COMPETE)
    ctx = moelab.RoutingContext(
        total_steps=6, schedule=build_schedule("competesmoe", 2, 6, omega=1.0, competition_warmup=0.0)
    )
    moelab.attach(model, ctx)
    batch = {"input_ids": torch.stack([d["input_ids"] for d in _data(4)])}
    batch["labels"] = batch["input_ids"]
    # a file store: no port to race for (a port picked and released can be taken before gloo binds it)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        loss = trainer.compute_loss(ddp, dict(batch))
        aux = moelab.aux_loss(model)
        assert model.transformer.h[0].mlp.last_routing.indices.shape[-1] == 2 and aux.item() > 0
        loss.backward()  # no "Expected to mark a variable ready only once"
        with torch.no_grad():
            task = transformers.Trainer.compute_loss(trainer, model, dict(batch))
        assert loss.item() == pytest.approx(task.item() + aux.item(), rel=1e-6)
        assert model.transformer.h[0].mlp.router.base.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_a_model_from_model_init_gets_the_aux_loss_too(tmp_path):
    trainer = MoETrainer(
        model_init=lambda: _model(), args=_args(tmp_path, max_steps=2), train_dataset=_data(8)
    )
    trainer.train()
    assert all(log["aux_loss"] > 0 and log["aux_balance"] > 0 for log in _train_logs(trainer))
    assert _ctx(trainer.model).step == 2


def test_a_task_loss_computed_outside_the_model_still_gets_the_aux_loss(tmp_path):
    model = _model("smoe", balance_coef=0.5)
    trainer = MoETrainer(
        model=model, args=_args(tmp_path, label_smoothing_factor=0.1), train_dataset=_data(4)
    )
    batch = {"input_ids": torch.stack([d["input_ids"] for d in _data(4)])}
    batch["labels"] = batch["input_ids"]
    loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
    aux = moelab.aux_loss(model)
    assert outputs.loss is None and torch.equal(outputs["moelab_aux_loss"], aux)
    task = transformers.Trainer.compute_loss(trainer, model, dict(batch))
    assert aux.item() > 0.4 and loss.item() == pytest.approx(task.item() + aux.item(), rel=1e-6)
    model.eval()
    with torch.no_grad():  # evaluation: the task loss alone
        assert "moelab_aux_loss" not in trainer.compute_loss(model, dict(batch), return_outputs=True)[1]


# ------------------------------------------------------------------------------------- logging
def test_each_aux_loss_is_logged_and_reaches_tensorboard(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _model()
    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # offline: event files only
    args = _args(tmp_path, max_steps=4, report_to=["tensorboard"])
    trainer = MoETrainer(model=model, args=args, train_dataset=_data(), schedule_options=COMPETE)
    trainer.train()
    events = list(logdir.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    names = ["aux_loss", "aux_balance", "aux_z", "aux_distill", "aux_diversity", "aux_competition_balance"]
    assert {f"train/{n}" for n in [*names, "loss"]} <= tags, tags
    logs = _train_logs(trainer)
    for name in names:
        logged = [e.value for e in acc.Scalars(f"train/{name}")]
        assert logged == pytest.approx([log[name] for log in logs], rel=1e-6)
    assert logs[0]["aux_balance"] > 0 and logs[0]["aux_z"] > 0
    for layer in (0, 1):  # each layer's balance over the logging interval
        logged = [e.value for e in acc.Scalars(f"train/max_vio/layer{layer}")]
        assert logged == pytest.approx([log[f"max_vio/layer{layer}"] for log in logs], rel=1e-6)
        assert all(0 < log[f"jain/layer{layer}"] <= 1 for log in logs)


def test_each_layers_load_balance_is_logged_over_the_logging_interval(tmp_path):
    model = _model("smoe")
    loads = {0: [], 1: []}  # every training forward's expert counts, read from the layers
    for i, layer in enumerate(moe_layers(model)):
        layer.register_forward_hook(
            lambda m, a, out, i=i: loads[i].append(
                torch.bincount(m.last_routing.indices.flatten(), minlength=4)
            )
        )
    trainer = MoETrainer(
        model=model, args=_args(tmp_path, max_steps=4, logging_steps=2), train_dataset=_data()
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 2
    for layer in (0, 1):
        for log, steps in zip(logs, (loads[layer][:2], loads[layer][2:4])):
            load = sum(steps).double()
            assert log[f"max_vio/layer{layer}"] == pytest.approx(
                float(load.max() / load.mean() - 1), rel=1e-12
            )
            assert log[f"jain/layer{layer}"] == pytest.approx(float(load.sum() ** 2 / (4 * (load**2).sum())))


# -------------------------------------------------------------------------------------- resume
class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_from_a_trainer_checkpoint_ends_with_the_uninterrupted_weights(tmp_path):
    def run(out, resume=False, stop=None):
        model = _model()
        args = _args(out, save_strategy="steps", save_steps=3)
        callbacks = [_StopAt(stop)] if stop else []
        trainer = MoETrainer(
            model=model, args=args, train_dataset=_data(), callbacks=callbacks, schedule_options=COMPETE
        )
        trainer.train(resume_from_checkpoint=resume or None)
        return model, trainer

    full, full_trainer = run(tmp_path / "full")
    table = _ctx(full).schedule.table
    assert table[:, :3].any() and table[:, 3:].any()  # competition before and after the interruption
    _, stopped = run(tmp_path / "part", stop=3)
    assert stopped.state.global_step == 3
    saved = torch.load(tmp_path / "part" / "checkpoint-3" / ROUTING_FILE, weights_only=True)
    assert saved == {"ctx": {"step": 3, "total_steps": 6, "schedule": _ctx(full).schedule.state_dict()}}
    resumed, trainer = run(tmp_path / "part", resume=True)
    assert trainer.state.global_step == 6 and _ctx(resumed).step == 6
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    keys = ("loss", "aux_loss", "aux_distill", "aux_balance")  # the log goes on as if never stopped
    assert [[log[k] for k in keys] for log in _train_logs(trainer)] == [
        [log[k] for k in keys] for log in _train_logs(full_trainer)
    ]


def test_a_resumed_run_whose_checkpoint_holds_another_schedule_is_refused(tmp_path):
    args = _args(tmp_path, save_strategy="steps", save_steps=3)
    MoETrainer(
        model=_model(), args=args, train_dataset=_data(), callbacks=[_StopAt(3)], schedule_options=COMPETE
    ).train()
    path = tmp_path / "checkpoint-3" / ROUTING_FILE
    state = torch.load(path, weights_only=True)
    state["ctx"]["schedule"]["seed"] += 1  # competitions at other steps than this run's
    torch.save(state, path)
    trainer = MoETrainer(model=_model(), args=args, train_dataset=_data(), schedule_options=COMPETE)
    with pytest.raises(
        ValueError, match=r"the saved routing state has schedule .*; expected the same schedule"
    ):
        trainer.train(resume_from_checkpoint=True)


def test_a_checkpoint_whose_routing_state_does_not_match_its_step_is_refused(tmp_path):
    model = _model()
    args = _args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    MoETrainer(model=model, args=args, train_dataset=_data(8), schedule_options=COMPETE).train()
    path = tmp_path / "checkpoint-2" / ROUTING_FILE
    state = torch.load(path, weights_only=True)
    state["ctx"]["step"] = 1
    torch.save(state, path)
    trainer = MoETrainer(model=_model(), args=args, train_dataset=_data(8), schedule_options=COMPETE)
    with pytest.raises(
        ValueError,
        match=r"holds the routing state of step 1 but the Trainer resumes at step 2; the checkpoint",
    ):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


# --------------------------------------------------------------------------- output_router_logits
def test_output_router_logits_on_a_converted_model_is_refused_in_one_line(tmp_path):
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, V, (2, 6))
    moelab.from_hf(model)
    message = r"^output_router_logits=True is not allowed on a model with moelab MoE layers: transformers' "
    with pytest.raises(ValueError, match=message + r".*set model.config.output_router_logits=False"):
        MoETrainer(model=model, args=_args(tmp_path), train_dataset=_data(4))
    model.config.output_router_logits = False
    trainer = MoETrainer(model=model, args=_args(tmp_path), train_dataset=_data(4))
    with pytest.raises(ValueError, match=message):  # asked for in the batch
        trainer.compute_loss(model, {"input_ids": ids, "labels": ids, "output_router_logits": True})
    model.config.output_router_logits = True  # switched on after the trainer was built
    with pytest.raises(ValueError, match=message):
        model(ids)
    model.config.output_router_logits = False
    loss = trainer.compute_loss(model.train(), {"input_ids": ids, "labels": ids})
    assert torch.isfinite(loss) and moelab.aux_loss(model).item() > 0  # the layers' own balance loss


# ------------------------------------------------------------------------------------- torchrun
SCRIPT = """
import json, os, sys
import torch
import transformers
sys.path.insert(0, os.environ["TESTS"])
from test_hf_trainer import COMPETE, _args, _ctx, _data, _model, _train_logs
from moelab.hf.trainer import MoETrainer

out = os.environ["OUT"]
model = _model()
args = _args(out, max_steps=6, per_device_train_batch_size=2, ddp_backend="gloo", save_strategy="steps", save_steps=3)
trainer = MoETrainer(model=model, args=args, train_dataset=_data(), schedule_options=COMPETE)
trainer.train()
table = _ctx(model).schedule.table
rank = int(os.environ["RANK"])
torch.save(model.state_dict(), os.path.join(out, f"weights{rank}.pt"))
json.dump({
    "world": trainer.args.world_size,
    "ddp": type(trainer.model_wrapped).__name__,
    "step": _ctx(model).step,
    "competing": table.any(dim=0).tolist(),
    "logs": _train_logs(trainer),
}, open(os.path.join(out, f"rank{rank}.json"), "w"))
"""


@pytest.mark.slow
def test_competesmoe_trains_under_torchrun_ddp_through_its_competition_steps(tmp_path):
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    src = str(Path(moelab.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": src,
        "TESTS": str(Path(__file__).resolve().parent),
        "OUT": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "run.py"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["world"] == 2 and report["ddp"] == "DistributedDataParallel" and report["step"] == 6
        assert any(report["competing"]) and len(report["logs"]) == 6
        for step, log in enumerate(report["logs"]):  # passed every competition step
            assert (log["aux_distill"] > 0) == report["competing"][step]
    assert reports[0]["logs"] == reports[1]["logs"]  # the logged losses are the means over the ranks
    w0, w1 = (torch.load(tmp_path / f"weights{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # DDP kept the ranks identical
    assert (tmp_path / "checkpoint-6" / ROUTING_FILE).is_file()


#: methods whose router needs each token's document, which a transformers decoder does not pass
#: to its MoE blocks: refused in one line (EMO)
BY_DOCUMENT = [m for m in moelab.methods() if ROUTERS[get_method(m).router].takes_doc_ids]


@pytest.mark.parametrize("method", moelab.methods())
def test_the_trainer_trains_every_method(tmp_path, method):
    model = _model(method)
    if method in BY_DOCUMENT:
        trainer = MoETrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_data(8))
        with pytest.raises(ValueError, match=r"^doc_ids=None is not allowed with EMO's document pools"):
            trainer.train()
        return
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = MoETrainer(
        model=model, args=_args(tmp_path, max_steps=2), train_dataset=_data(8), schedule_options=None
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert _ctx(model).step == 2
    changed = [k for k, v in model.state_dict().items() if "mlp" in k and not torch.equal(v, before[k])]
    assert changed, f"{method}: no MoE parameter moved"


# ------------------------------------------------------------------------------------ the plain Trainer
def test_a_converted_models_training_loss_includes_the_aux_loss():
    """As transformers' MoE models with output_router_logits: a training forward with labels
    returns task + aux (its gradient is attached to the layers' outputs); evaluation returns the
    task loss alone."""
    model = _model("smoe")
    ids = _data(4)[0]["input_ids"].unsqueeze(0).repeat(2, 1)
    out = model(input_ids=ids, labels=ids)
    logits = out.logits[:, :-1].reshape(-1, V)
    task = torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))
    aux = moelab.aux_loss(model)
    assert aux.item() > 0
    torch.testing.assert_close(out.loss.detach(), (task + aux).detach())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, task)


def test_the_plain_trainer_trains_with_the_aux_loss(tmp_path):
    model = _model("smoe")
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_data())
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in _train_logs(trainer))


def test_the_plain_trainer_with_gradient_accumulation_is_refused_in_one_line(tmp_path):
    """The plain Trainer divides the loss of a model that takes no loss kwargs by the accumulation
    steps; the layers' aux gradient would keep weight 1: refused at the first backward, naming the
    fix.  (A model taking ``num_items_in_batch`` is not divided: its aux loss counts once per
    micro-batch, as in transformers' own MoE models.)"""
    model = _model("smoe")
    args = _args(tmp_path, max_steps=1, gradient_accumulation_steps=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data())
    trainer.model_accepts_loss_kwargs = False
    with pytest.raises(
        ValueError, match=r"aux_loss enters this loss with weight 0.5, .*set_aux_scale\(model, 0.5\)"
    ):
        trainer.train()


def test_competesmoe_trains_under_bf16_through_its_competition_steps(tmp_path):
    """``TrainingArguments(bf16=True)``: the forward runs under bf16 autocast (the competition's
    expert backward once refused its bf16 rows); the losses stay finite and the distillation is
    logged on the competition steps."""
    model = _model()
    args = _args(tmp_path, bf16=True, max_steps=4)
    trainer = MoETrainer(model=model, args=args, train_dataset=_data(), schedule_options=COMPETE)
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 4 and all(math.isfinite(h["loss"]) for h in logs)
    assert any(h["aux_distill"] > 0 for h in logs)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------- fp16: the gradient scaler
def _two_micro_batch_grads(layer, xs, scaler=None):
    """Gradient accumulation over two micro-batches as MoETrainer runs it: each loss ``(task + aux) / 2``,
    the layers' aux gradient weighted by ``1/2`` times the scaler's scale (``set_aux_scale``), the backward
    of the scaled loss, then the scaler's ``unscale_``."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    scale = 1.0 if scaler is None else float(scaler.get_scale())
    moelab.set_aux_scale(layer, scale / 2)
    for x in xs:
        loss = (layer(x).pow(2).mean() + layer.aux_loss) / 2
        (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    return {n: p.grad for n, p in layer.named_parameters()}


def test_a_gradient_scaler_scales_the_aux_gradient_as_the_task_loss():
    """fp16 training (a GradScaler, as MoETrainer under ``fp16=True``): with the aux weight times the
    scaler's scale, the unscaled gradients, the router's aux part included, are those of the float32
    step without a scaler (a power-of-two scale: exact); left at the unscaled weight, the aux loss's
    weight check refuses in backward."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method="smoe", balance_coef=1.0, z_coef=0.1).train()
    ref, task_only = copy.deepcopy(layer), copy.deepcopy(layer)
    xs = torch.randn(2, 16, 8).unbind()
    want = _two_micro_batch_grads(ref, xs)
    got = _two_micro_batch_grads(layer, xs, torch.amp.GradScaler("cpu", init_scale=2.0**12))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    moelab.set_aux_scale(task_only, 0.0)  # the aux gradient is a real part of the router's: not lost in noise
    for x in xs:
        (task_only(x).pow(2).mean() / 2).backward()
    aux_part = want["router.weight"] - task_only.router.weight.grad
    assert aux_part.norm() > 0.1 * want["router.weight"].norm()
    layer.zero_grad()
    moelab.set_aux_scale(layer, 0.5)  # the scaler's scale forgotten
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with pytest.raises(
        ValueError, match=r"aux_loss enters this loss with weight 2048, .*set_aux_scale\(model, 2048\)"
    ):
        scaler.scale((layer(xs[0]).pow(2).mean() + layer.aux_loss) / 2).backward()


def test_the_trainer_weighs_the_aux_gradient_by_its_gradient_scalers_scale(tmp_path):
    """On a device with fp16 the accelerator holds a GradScaler (on CPU it has none: one is set here):
    the weight MoETrainer gives the layers is the scaler's scale over the accumulation steps."""
    trainer = MoETrainer(model=_model("smoe"), args=_args(tmp_path, max_steps=1), train_dataset=_data(4))
    trainer.current_gradient_accumulation_steps = 4
    assert trainer._aux_weight() == 0.25
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert trainer._aux_weight() == 2.0**10 / 4
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert trainer._aux_weight() == 0.25


# ------------------------------------------------------------------------- global balance scope
def test_global_balance_in_one_process_trains_as_the_micro_batch_balance(tmp_path):
    """One process, one micro-batch a step: the step's load is the micro-batch's, so the StepBalance the
    trainer attaches gives the same run; it is detached when training ends."""
    logs = {}
    for scope in ("micro", "global"):
        model = _model("smoe", balance_scope=scope, importance_coef=0.1)
        trainer = MoETrainer(model=model, args=_args(tmp_path / scope, max_steps=3), train_dataset=_data(12))
        trainer.train()
        logs[scope] = _train_logs(trainer)
        assert attached_step_balance(model) is None
    for a, b in zip(logs["micro"], logs["global"]):
        for key in ("loss", "aux_loss", "aux_balance", "aux_importance"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key


def test_global_balance_under_gradient_accumulation_uses_the_steps_running_counts(tmp_path):
    """Two micro-batches a step, each with its own backward: the second is balanced against the counts of
    both (Megatron-Core's global_aux_loss), so the run differs from the micro-batch balance."""
    seen = []

    class Spy(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            balance = attached_step_balance(model)
            seen.append(balance is not None and balance._totals is None)  # the last step's are cleared

        def on_step_end(self, args, state, control, model=None, **kwargs):
            balance = attached_step_balance(model)
            seen.append(balance is not None and balance._forwards)  # both micro-batches recorded

    logs = {}
    for scope in ("micro", "global"):
        model = _model("smoe", balance_scope=scope, balance_coef=1.0)
        args = _args(
            tmp_path / scope, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2
        )
        trainer = MoETrainer(model=model, args=args, train_dataset=_data(8), callbacks=[Spy()])
        trainer.train()
        logs[scope] = _train_logs(trainer)
    assert seen == [
        False,
        False,
        False,
        False,
        True,
        2,
        True,
        2,
    ]  # micro: none; global: one, cleared each step
    assert logs["global"][0]["aux_balance"] > 0
    assert logs["global"][0]["aux_balance"] != pytest.approx(logs["micro"][0]["aux_balance"], rel=1e-6)


def test_an_interrupted_run_leaves_no_step_balance_behind_and_the_next_run_balances(tmp_path):
    """A run stopped by an exception never reaches on_train_end: its StepBalance is closed all the same,
    so neither a plain loop nor a new MoETrainer afterwards drops the global-scope losses."""

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("interrupted")

    model = _model("smoe", balance_scope="global", balance_coef=1.0)
    trainer = MoETrainer(
        model=model, args=_args(tmp_path / "a", max_steps=3), train_dataset=_data(12), callbacks=[Stop()]
    )
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.train()
    assert attached_step_balance(model) is None
    ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # a plain loop: the layers form their global-scope losses themselves
        model(input_ids=ids, labels=ids).loss.backward()
    assert moelab.layer.aux_terms(model)["balance"] > 0
    trainer = MoETrainer(model=model, args=_args(tmp_path / "b", max_steps=2), train_dataset=_data(12))
    trainer.train()  # a new run attaches its own
    assert _train_logs(trainer)[0]["aux_balance"] > 0 and attached_step_balance(model) is None


def test_training_a_loaded_model_for_more_steps_rebuilds_its_routing_context_for_them(tmp_path):
    from moelab.hf.trainer import MoETrainerCallback

    model = _model()
    moelab.routing_context(model, total_steps=6, seed=0, **COMPETE).step = 6  # as after a 6-step run
    moelab.save(model, tmp_path / "m")
    loaded = moelab.load(tmp_path / "m").train()
    assert _ctx(loaded).total_steps == 6
    trainer = MoETrainer(model=loaded, args=_args(tmp_path / "b", max_steps=10), train_dataset=_data(40))
    with pytest.warns(
        UserWarning, match=r"routing context planned 6 steps .* max_steps=10: .* rebuilt for 10"
    ):
        trainer.train()
    ctx = _ctx(loaded)
    assert ctx.total_steps == 10 and ctx.step == 10 and ctx.schedule.total_steps == 10
    # drawn again with the loaded schedule's options (ω, warm-up), as a fresh 10-step run would be
    assert torch.equal(ctx.schedule.table, build_schedule("competesmoe", 2, 10, seed=0, **COMPETE).table)
    given = MoETrainerCallback(ctx=moelab.RoutingContext(total_steps=6))
    trainer = MoETrainer(
        model=_model("smoe"),
        args=_args(tmp_path / "c", max_steps=10),
        train_dataset=_data(40),
        callbacks=[given],
    )
    with pytest.raises(
        ValueError, match=r"^ctx.total_steps=6 is not allowed: the Trainer plans max_steps=10; "
    ):
        trainer.train()


def test_bf16_evaluate_and_generate_run_the_experts_in_bf16(tmp_path):
    """``TrainingArguments(bf16=True)``: ``evaluate()`` runs the forward under bf16 autocast without
    autograd (where the ``loop`` and ``stream`` kernels once crashed on a float32 buffer), and so does
    ``generate()`` under ``torch.autocast``: a finite loss and the new tokens after the prompt."""
    model = _model("smoe")
    trainer = MoETrainer(model=model, args=_args(tmp_path, bf16=True, max_steps=2), train_dataset=_data(),
                         eval_dataset=_data(8))  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    prompt = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], prompt)
