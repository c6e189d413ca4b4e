"""The trainer: LR schedules, validation, best-val test, logs, resume on the same curve."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

import moelab
from moelab.data.text import load_text
from moelab.io.rundir import RunDir
from moelab.layer import moe_layers
from moelab.models.lm import LMConfig, TransformerLM
from moelab.schedules import lr_factor, model_schedule, routing_context, split_schedule_options
from moelab.train import TrainConfig, Trainer, TrainingError
from moelab.train.parallel import Parallel
from moelab.train.tasks import LMTask

TINY = dict(block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4, top_k=2, dropout=0.1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.txt"
    path.write_text("".join(f"sentence number {i} is about {i % 13} cats.\n" for i in range(500)))
    return load_text(str(path))


def test_lr_factor_matches_the_formulas():
    # warm-up: linear up to 1
    assert [lr_factor("inverse_sqrt", s, 100, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # inverse square root after warm-up (000: 1/sqrt(t)), 1 at the end of warm-up
    assert lr_factor("inverse_sqrt", 15, 100, 4) == pytest.approx(math.sqrt(4 / 16))
    assert lr_factor("inverse_sqrt", 99, 100, 0) == pytest.approx(0.1)
    # cosine: 1 after warm-up, min_ratio at the end, midway the mean
    assert lr_factor("cosine", 10, 110, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor("cosine", 60, 110, 10, 0.1) == pytest.approx(0.55)
    assert lr_factor("cosine", 110, 110, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor("constant", 50, 100, 10) == 1.0
    with pytest.raises(ValueError, match="schedule='linear' is not allowed"):
        lr_factor("linear", 1, 10, 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(steps=0), "steps=0 is not allowed"),
        (dict(batch_size=-1), "batch_size=-1 is not allowed"),
        (dict(lr=0.0), "lr=0.0 is not allowed"),
        (dict(schedule="step"), "schedule='step' is not allowed"),
        (dict(grad_clip=-1.0), "grad_clip=-1.0 is not allowed"),
        (dict(optimizer="sgd"), r"optimizer='sgd' is not allowed; expected one of \['adam', 'adamw'\]"),
        (dict(weight_decay=-0.1), "weight_decay=-0.1 is not allowed; expected a number >= 0"),
        (
            dict(optimizer="adam", weight_decay=0.1),
            "optimizer='adam' with weight_decay=0.1 is not allowed; expected weight_decay=0 with adam",
        ),
    ],
)
def test_train_config_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"steps": 10, "batch_size": 4, **kwargs})


@pytest.mark.parametrize("old", ["expert_parallel", "fsdp"])
def test_the_parallel_layout_is_given_one_way(data, old):
    """``parallel=`` is the one way to say how the model is spread (``ExpertParallel()``,
    ``Parallelized(fsdp=True)``, ...): the old ``expert_parallel=`` / ``fsdp=`` shorthands are gone,
    and Python's TypeError names the keyword."""
    model = TransformerLM(LMConfig(vocab_size=data.vocab_size, **TINY))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
        Trainer(
            model, LMTask(data, 16), TrainConfig(steps=1, batch_size=2), None, progress=False, **{old: True}
        )
    trainer = Trainer(model, LMTask(data, 16), TrainConfig(steps=1, batch_size=2), None, progress=False)
    assert type(trainer.parallel) is Parallel  # the default: choose() on one process


def test_the_trainer_optimizes_the_models_groups_with_adamw_by_default(data, tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=256, method="xmoe", **TINY))
    cfg = TrainConfig(steps=2, batch_size=4, eval_every=2, eval_tokens=64, weight_decay=0.3)
    assert cfg.optimizer == "adamw"
    Trainer(model, LMTask(data, 16), cfg, RunDir(tmp_path / "r"), progress=False).fit()
    saved = torch.load(tmp_path / "r" / "ckpt" / "step-00000002" / "state.pt", weights_only=True)
    groups = saved["optimizer"]["param_groups"]
    decayed, rest = model.param_groups(0.3)
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert all(g["decoupled_weight_decay"] for g in groups)  # AdamW
    assert [len(g["params"]) for g in groups] == [len(decayed["params"]), len(rest["params"])]


def run_training(data, out, steps=12, resume=False, stop_at=None, method="smoe"):
    """Train the tiny model; ``stop_at`` raises KeyboardInterrupt when sampling that step."""
    torch.manual_seed(123)  # model init (the trainer re-seeds for training)
    model = TransformerLM(LMConfig(vocab_size=256, method=method, **TINY))
    task = LMTask(data, 16)
    if stop_at is not None:
        sample, calls = task.sample, {"n": 0}

        def interrupted(generator, batch_size, step):
            calls["n"] += 1
            if calls["n"] == stop_at:
                raise KeyboardInterrupt
            return sample(generator, batch_size, step)

        task.sample = interrupted
    cfg = TrainConfig(steps=steps, batch_size=4, eval_every=3, ckpt_every=4, eval_tokens=128, seed=5)
    run = RunDir(out, resume=resume)
    if not resume:
        run.write_config({"test": True})
    return Trainer(model, task, cfg, run, progress=False).fit(resume=resume)


def read_log(path):
    with open(path / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_run_writes_log_metrics_and_uses_the_best_validation_weights(data, tmp_path):
    metrics = run_training(data, tmp_path / "a")
    rows = read_log(tmp_path / "a")
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    vals = {int(r["step"]): float(r["val_bpc"]) for r in rows if r["val_bpc"]}
    assert sorted(vals) == [3, 6, 9, 12]
    best_step = min(vals, key=vals.get)
    assert metrics["best_step"] == best_step and metrics["val_bpc"] == pytest.approx(vals[best_step])
    assert metrics["train_loss"] == pytest.approx(sum(float(r["loss"]) for r in rows[-3:]) / 3)
    assert metrics["world_size"] == 1 and metrics["seed"] == 5 and metrics["tokens_per_s"] > 0
    assert [p.name for p in (tmp_path / "a" / "ckpt").iterdir()] and (
        tmp_path / "a" / "best" / "model.safetensors"
    ).exists()


def test_resume_after_an_interruption_continues_the_same_curve(data, tmp_path):
    full = run_training(data, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run_training(data, tmp_path / "cut", stop_at=11)  # killed while sampling step 11 (ckpt at 8)
    assert len(read_log(tmp_path / "cut")) == 10  # rows 9-10 were written after the checkpoint
    resumed = run_training(data, tmp_path / "cut", resume=True)
    a, b = read_log(tmp_path / "full"), read_log(tmp_path / "cut")
    keys = ["step", "lr", "loss", "aux_loss", "grad_norm", "tokens", "val_loss", "val_bpc"]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]  # bit-exact on CPU
    for key in ("train_loss", "val_bpc", "test_bpc", "test_loss", "best_step", "max_vio_run"):
        assert resumed[key] == full[key]  # MaxVio over the run: the checkpoint carries the run's load
    assert 0 < full["max_vio_run"] <= 3


def test_resume_before_the_first_checkpoint_starts_over_with_a_clean_log(data, tmp_path):
    full = run_training(data, tmp_path / "full", steps=6)
    with pytest.raises(KeyboardInterrupt):
        run_training(data, tmp_path / "cut", steps=6, stop_at=3)  # no checkpoint yet (first at 4)
    resumed = run_training(data, tmp_path / "cut", steps=6, resume=True)
    assert [r["loss"] for r in read_log(tmp_path / "cut")] == [r["loss"] for r in read_log(tmp_path / "full")]
    assert resumed["test_bpc"] == full["test_bpc"]


def test_resuming_a_finished_run_returns_its_metrics(data, tmp_path):
    first = run_training(data, tmp_path / "a", steps=4)
    again = run_training(data, tmp_path / "a", steps=4, resume=True)
    assert again["test_bpc"] == first["test_bpc"] and len(read_log(tmp_path / "a")) == 4


def test_a_non_finite_loss_stops_with_a_clear_message(data):
    model = TransformerLM(LMConfig(vocab_size=256, **TINY))
    task = LMTask(data, 16)
    real = task.loss
    task.loss = lambda m, b: (real(m, b)[0] * float("nan"), 1)
    with pytest.raises(TrainingError, match="non-finite loss at step 1"):
        Trainer(model, task, TrainConfig(steps=3, batch_size=2), None, progress=False).fit()


def test_the_routing_context_advances_every_step(data):
    model = TransformerLM(LMConfig(vocab_size=256, method="stablemoe", **TINY))
    seen = []
    task = LMTask(data, 16)
    real = task.loss

    def spy(m, batch):
        seen.append(m.blocks[0].ffn.ctx.step)
        return real(m, batch)

    task.loss = spy
    trainer = Trainer(model, task, TrainConfig(steps=5, batch_size=2, eval_every=5), None, progress=False)
    trainer.fit()
    assert seen == [0, 1, 2, 3, 4] and trainer.ctx.total_steps == 5 and trainer.ctx.step == 5


def test_batches_shard_by_rank_into_the_global_batch(data):
    task = LMTask(data, 16)
    x, y = task.sample(torch.Generator().manual_seed(0), 6)
    parts = [task.shard((x, y), r, 2) for r in range(2)]
    assert torch.equal(torch.cat([parts[0][0], parts[1][0]]), torch.cat([x[0::2], x[1::2]]))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_competition_schedule_is_built_only_for_methods_that_need_one():
    def model(method):
        return TransformerLM(LMConfig(vocab_size=10, **{**TINY, "dropout": 0.0, "method": method}))

    assert model_schedule(model("smoe"), 100, 0) is None
    options = {"omega": 0.1, "a_max": 6, "competition_warmup": 0.2}
    schedule = model_schedule(model("competesmoe"), 100, 7, options)
    assert isinstance(schedule, moelab.CompetitionSchedule)
    # a_max is capped at the model's 2 MoE layers
    assert (schedule.num_layers, schedule.total_steps, schedule.seed) == (2, 100, 7)
    assert (schedule.omega, schedule.a_max, schedule.warmup) == (0.1, 2, 0.2)
    coin = model_schedule(model("competesmoe-v1"), 100, 7, {"rate": 0.03})
    assert isinstance(coin, moelab.CoinFlipSchedule) and coin.num_layers == 2
    with pytest.raises(ValueError, match=r"schedule_options keys \['balance_coef'\] are not allowed"):
        model_schedule(model("competesmoe"), 100, 7, {"balance_coef": 0.0})


def test_routing_context_holds_the_models_schedule_and_is_attached_once():
    m = TransformerLM(LMConfig(vocab_size=10, **{**TINY, "dropout": 0.0, "method": "competesmoe"}))
    ctx = routing_context(m, 50, 3, omega=0.2)
    assert all(layer.ctx is ctx for layer in moe_layers(m))
    assert ctx.state_dict()["schedule"] == {**ctx.schedule.state_dict(), "type": "competition"}
    assert (ctx.schedule.seed, ctx.schedule.omega, ctx.total_steps) == (3, 0.2, 50)


def test_schedule_options_are_kept_out_of_the_layers():
    layer, schedule = split_schedule_options({"omega": 0.05, "rate": 0.03, "balance_coef": 0})
    assert layer == {"balance_coef": 0} and schedule == {"omega": 0.05, "rate": 0.03}


@pytest.mark.skipif("competesmoe" not in moelab.methods(), reason="competesmoe is not in this moelab")
def test_competesmoe_trains_with_its_schedule(data):
    model = TransformerLM(LMConfig(vocab_size=256, method="competesmoe", **TINY))
    trainer = Trainer(
        model, LMTask(data, 16), TrainConfig(steps=4, batch_size=2, eval_every=4), None,
        progress=False,
    )  # fmt: skip
    metrics = trainer.fit()
    assert trainer.ctx.schedule is not None and math.isfinite(metrics["test_bpc"])


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_ends_like_an_uninterrupted_run(tmp_path):
    """A real `moelab train` process killed with SIGKILL (during a step or a checkpoint write),
    then resumed, ends with the same log.csv losses and metrics as a run never interrupted."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"row {i} of the corpus, value {i % 17}.\n" for i in range(800)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}

    def cmd(out, *extra):
        return [sys.executable, "-m", "moelab.cli", "train", "--data", str(corpus), "--block-size", "16",
                "--batch-size", "4", "--num-experts", "4", "--steps", "60", "--eval-every", "10",
                "--ckpt-every", "5", "--eval-tokens", "64", "--test-tokens", "64", "--no-progress",
                "--out", str(out), *extra]  # fmt: skip

    subprocess.run(cmd(tmp_path / "full"), env=env, check=True, capture_output=True)
    for rows in (0, 7, 10, 23):  # before the run exists, mid-interval, at an eval + checkpoint, ...
        out = tmp_path / f"killed{rows}"
        proc = subprocess.Popen(cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = out / "log.csv"
        while proc.poll() is None and (not log.exists() or len(log.read_text().splitlines()) <= rows):
            if rows == 0:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        subprocess.run(cmd(out, "--resume"), env=env, check=True, capture_output=True)
        a, b = read_log(tmp_path / "full"), read_log(out)
        assert [r["loss"] for r in a] == [r["loss"] for r in b]
        ma = json.loads((tmp_path / "full" / "metrics.json").read_text())
        mb = json.loads((out / "metrics.json").read_text())
        assert {k: ma[k] for k in ("test_bpc", "val_bpc", "train_loss")} == {
            k: mb[k] for k in ("test_bpc", "val_bpc", "train_loss")
        }


def test_log_has_the_cheap_routing_diagnostics_and_overlap_only_on_competition_steps(data, tmp_path):
    run_training(data, tmp_path / "c", steps=12, method="competesmoe")
    rows = read_log(tmp_path / "c")
    assert all(0 < float(r["router_entropy"]) <= math.log(4) + 1e-6 for r in rows)
    assert all(float(r["load_cv"]) >= 0 for r in rows)
    assert all(0 <= float(r["max_vio"]) <= 3 for r in rows)  # MaxVio of the batch: N - 1 at most
    overlap = [r["competition_overlap"] for r in rows]
    assert any(v for v in overlap) and any(v == "" for v in overlap)  # competes on some steps only
    assert all(0 <= float(v) <= 2 for v in overlap if v)


def test_max_vio_run_is_the_max_violation_of_the_load_of_every_training_step(data, tmp_path):
    from moelab.metrics import max_violation

    torch.manual_seed(123)
    model = TransformerLM(LMConfig(vocab_size=256, **TINY))
    loads = []

    class Recording(LMTask):
        def loss(self, model, batch):
            out = super().loss(model, batch)
            if model.training:
                loads.append([moelab.metrics.routing_loads(model)])
            return out

    cfg = TrainConfig(steps=3, batch_size=4, eval_every=3, eval_tokens=64, seed=5)
    metrics = Trainer(model, Recording(data, 16), cfg, None, progress=False).fit()
    layers = zip(*[step[0] for step in loads])
    expected = [max_violation(sum(per_step)) for per_step in layers]
    assert len(loads) == 3 and metrics["max_vio_run"] == pytest.approx(sum(expected) / len(expected))


def test_every_run_writes_its_curves_png_before_its_metrics_and_a_resume_draws_the_same(data, tmp_path):
    import matplotlib.image

    run_training(data, tmp_path / "a", steps=4)
    png = tmp_path / "a" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[1] > pixels.shape[0] > 100 and pixels.std() > 0  # two panels, something drawn
    first = png.read_bytes()
    (tmp_path / "a" / "metrics.json").unlink()  # killed after the figure, before metrics.json
    png.unlink()
    run_training(data, tmp_path / "a", steps=4, resume=True)
    assert png.read_bytes() == first  # drawn from log.csv: the same figure


@pytest.mark.parametrize("opts", [[], ["--opt", "balance_scope=global"]])
def test_log_csv_holds_every_weighted_aux_term_and_they_sum_to_the_aux_loss(tmp_path, opts):
    # CompeteSMoE (2025) App. D.2 Fig. 7 plots the router's losses one by one
    import csv

    from moelab.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 300)
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "3", "--eval-every", "3", "--eval-tokens", "64",
            "--test-tokens", "64", "--no-progress", "--method", "competesmoe", "--out", str(out), *opts]  # fmt: skip
    assert main(args) == 0
    rows = list(csv.DictReader((out / "log.csv").open()))
    terms = [k for k in rows[0] if k.startswith("aux_") and k != "aux_loss"]
    assert {"aux_balance", "aux_z", "aux_distill", "aux_diversity"} <= set(terms)
    for row in rows:
        assert sum(float(row[t]) for t in terms) == pytest.approx(float(row["aux_loss"]), rel=1e-5)
    assert float(rows[0]["aux_balance"]) > 0  # the global scope's balance is logged under its name


def test_an_interrupted_fit_leaves_no_step_balance_and_the_next_trainer_balances(data):
    """The global scope's StepBalance is closed however fit ends: a new Trainer attaches its own, and a
    plain forward afterwards forms the global-scope losses itself."""
    from moelab.balance import attached_step_balance

    class Stops(LMTask):
        def loss(self, model, batch):
            out = super().loss(model, batch)
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                raise RuntimeError("interrupted")
            return out

    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=256, **TINY, method_options={"balance_scope": "global"}))
    cfg = TrainConfig(steps=2, batch_size=4, eval_every=2, eval_tokens=32, test_tokens=32)
    with pytest.raises(RuntimeError, match="interrupted"):  # in the second step, between forward and record
        Trainer(model, Stops(data, 16), cfg, progress=False).fit()
    assert attached_step_balance(model) is None
    trainer = Trainer(model, LMTask(data, 16), cfg, progress=False)
    trainer.fit()
    assert attached_step_balance(model) is None
    model.train()
    model(torch.randint(0, 256, (2, 16)))
    model(torch.randint(0, 256, (2, 16)))  # no StepBalance left to leave the losses to
    assert moelab.layer.aux_terms(model)["balance"] > 0


# ------------------------------------------------------------------------------ --autotune
def _rule_first_clock(monkeypatch):
    """A fake ``time.perf_counter`` under which auto's rule kernel for the tiny LM is the fastest."""
    from moelab.experts import KERNELS, grouped_mm_available

    rule = "grouped" if grouped_mm_available(torch.device("cpu"), torch.float32) else "loop"
    now = [0.0]
    for name, fn in list(KERNELS.items()):

        def kernel(*args, name=name, fn=fn):
            now[0] += 1.0 if name == rule else 5.0
            return fn(*args)

        monkeypatch.setitem(KERNELS, name, kernel)
    monkeypatch.setattr("time.perf_counter", lambda: now[0])
    return rule


def test_autotune_measures_one_batch_before_the_first_step_and_says_what_it_picked(data, capsys, monkeypatch):
    rule = _rule_first_clock(monkeypatch)
    weights = []
    for autotune in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(LMConfig(vocab_size=256, **TINY))
        cfg = TrainConfig(steps=2, batch_size=4, eval_every=2, eval_tokens=32, test_tokens=32)
        trainer = Trainer(model, LMTask(data, 16), cfg, progress=False, autotune=autotune)
        trainer.fit()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        lines = [line for line in capsys.readouterr().out.splitlines() if "autotune" in line]
        if not autotune:
            assert lines == [] and trainer.autotuned is None
            assert all(layer.experts.tuned == {} for layer in moelab.layer.moe_layers(model))
    (line,) = lines
    assert line.startswith("moelab: autotune measured 1 shape class: train, cpu float32, 1 thread")
    assert line.endswith("; this run trains with the picks")
    (tuned,) = trainer.autotuned.classes
    assert tuned.rule == rule and tuned.calls == TINY["n_layer"]  # every MoE layer's call is a probe
    assert all(layer.experts.tuned == trainer.autotuned.picks for layer in moelab.layer.moe_layers(model))
    # in training no other candidate rounds as the rule's kernel by construction: the pick is the rule's,
    # and the data order and the RNG streams are those of a run without autotune
    assert tuned.pick == rule and tuned.other_rounding
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
def test_two_processes_of_the_same_autotuned_train_command_end_with_the_same_weights(corpus, tmp_path):
    import os
    import subprocess
    import sys

    src = str(Path(moelab.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env.pop("OMP_WAIT_POLICY", None)  # spinning workers: where the clock's ranking varies most
    args = ["--data", str(corpus), "--size", "cpu", "--steps", "6", "--threads", "2", "--autotune", "--d-model", "32",
            "--layers", "1", "--heads", "2", "--eval-tokens", "64", "--test-tokens", "64", "--batch-size", "4",
            "--block-size", "32", "--no-progress"]  # fmt: skip
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "moelab", "train", *args, "--out", str(tmp_path / f"at{i}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(3)
    ]
    for run in runs:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out
        assert "moelab: autotune measured" in out
    final = [
        (tmp_path / f"at{i}" / "ckpt" / "step-00000006" / "model.safetensors").read_bytes() for i in range(3)
    ]
    assert final[0] == final[1] == final[2]


def test_autotune_is_refused_with_several_processes(data):
    from moelab.train.parallel import Parallel

    class Two(Parallel):
        def __init__(self):
            super().__init__()
            self.rank, self.world_size = 0, 2

    model = TransformerLM(LMConfig(vocab_size=256, **TINY))
    with pytest.raises(
        ValueError, match=r"autotune=True is not allowed with 2 processes; expected one process"
    ):
        Trainer(model, LMTask(data, 16), TrainConfig(steps=1, batch_size=4), parallel=Two(), autotune=True)


def test_the_train_command_has_an_autotune_flag_that_is_not_an_input_of_the_run():
    import argparse

    from moelab.experiments import runner
    from moelab.experiments.lm import TrainRun, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--out", "x", "--autotune"]).autotune is True
    assert TrainRun().autotune is False
    # like --threads: how a run executes, so --resume may change it
    assert runner.changed_input(TrainRun, {"autotune": True}, {"autotune": False}) is None
