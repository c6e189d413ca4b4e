"""Reliability: a kill during a checkpoint write, corrupted checkpoints, last-K,
every RNG state and the competition schedule in checkpoints, non-finite stops that keep the last
good checkpoint, finite competition affinities for large expert outputs."""

from __future__ import annotations

import csv
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import moelab
from moelab.data.text import load_text
from moelab.functional import COMPETITION_ACTIVATIONS, competition_affinity, normalized_weights
from moelab.io import atomic as A
from moelab.io.rundir import RunDir
from moelab.models.lm import LMConfig, TransformerLM
from moelab.train import TrainConfig, Trainer, TrainingError
from moelab.train import checkpoint as C
from moelab.train import trainer as T
from moelab.train.tasks import LMTask

TINY = dict(block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4, top_k=2, dropout=0.1)
KEYS = ["step", "lr", "loss", "aux_loss", "grad_norm", "tokens", "val_loss", "val_bpc"]
STABLE_METRICS = ("train_loss", "val_bpc", "test_bpc", "test_loss", "best_step", "steps", "params")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.txt"
    path.write_text("".join(f"line {i} says {i % 11} dogs ran.\n" for i in range(400)))
    return load_text(str(path))


def train(data, out, *, steps=12, resume=False, method="smoe", keep=2, loss=None, grad_clip=1.0, seed=5):
    torch.manual_seed(123)
    model = TransformerLM(LMConfig(vocab_size=256, method=method, **TINY))
    task = LMTask(data, 16)
    if loss is not None:
        real = task.loss
        task.loss = lambda m, b: loss(real, m, b)
    cfg = TrainConfig(
        steps=steps, batch_size=4, eval_every=3, ckpt_every=4, eval_tokens=64, test_tokens=64, seed=seed,
        keep_ckpts=keep, grad_clip=grad_clip,
    )  # fmt: skip
    run = RunDir(out, resume=resume)
    if not resume:
        run.write_config({"test": True})
    trainer = Trainer(model, task, cfg, run, progress=False)
    return trainer, trainer.fit(resume=resume)


def log_rows(out: Path) -> list[list[str]]:
    with open(out / "log.csv", newline="") as f:
        return [[r[k] for k in KEYS] for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def full(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    _, metrics = train(data, out)
    return log_rows(out), metrics


def _killer(where: str, at: int):
    """Stand-ins for the atomic writer's fsync hooks (``moelab.io.atomic._sync`` / ``fsync_dir``)
    that 'kill' the process (KeyboardInterrupt, as SIGKILL would: nothing after it runs) at one
    moment of the checkpoint write of step ``at``."""
    real_sync, real_dir = A._sync, A.fsync_dir
    tmp = f".tmp-step-{at:08d}"

    def sync(fd: int, path: Path) -> None:
        if path.parent.name == tmp and where == "state-half-written" and path.name == C.STATE:
            os.ftruncate(fd, os.fstat(fd).st_size // 2)  # the write got half-way
            raise KeyboardInterrupt
        real_sync(fd, path)
        if path.parent.name == tmp and where == "before-rename" and path.name == "config.json":
            raise KeyboardInterrupt

    def fsync_dir(path: Path) -> None:
        real_dir(path)
        if where == "after-rename" and Path(path).name == "ckpt" and (Path(path) / f"step-{at:08d}").exists():
            raise KeyboardInterrupt  # renamed into place; the older checkpoints not pruned yet

    return sync, fsync_dir


@pytest.mark.parametrize("where", ["state-half-written", "before-rename", "after-rename"])
def test_a_kill_during_a_checkpoint_write_resumes_to_the_same_log_and_metrics(
    data, tmp_path, full, where, monkeypatch
):
    sync, fsync_dir = _killer(where, at=8)
    with monkeypatch.context() as m:
        m.setattr(A, "_sync", sync)
        m.setattr(A, "fsync_dir", fsync_dir)
        with pytest.raises(KeyboardInterrupt):
            train(data, tmp_path)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    if where == "after-rename":
        assert names == ["step-00000004", "step-00000008"]
    else:  # the half-written checkpoint stays a temporary folder, never a step-* one
        assert names == [".tmp-step-00000008", "step-00000004"]
    assert len(log_rows(tmp_path)) == 8  # row 8 was logged before the checkpoint write
    _, resumed = train(data, tmp_path, resume=True)
    rows, metrics = full
    assert log_rows(tmp_path) == rows  # bit-exact on CPU
    assert {k: resumed[k] for k in STABLE_METRICS} == {k: metrics[k] for k in STABLE_METRICS}
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000008", "step-00000012"]


def _interrupt_at_batch(n: int, data, out, monkeypatch) -> None:
    """Train into ``out`` and stop with Ctrl-C when the ``n``-th batch is drawn."""
    real_sample = LMTask.sample
    calls = {"n": 0}

    def sample(self, generator, batch_size, step):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real_sample(self, generator, batch_size, step)

    with monkeypatch.context() as m:
        m.setattr(LMTask, "sample", sample)
        with pytest.raises(KeyboardInterrupt):
            train(data, out)


def test_resume_falls_back_past_a_corrupted_checkpoint_and_ends_the_same(data, tmp_path, full, monkeypatch):
    _interrupt_at_batch(11, data, tmp_path, monkeypatch)
    state = tmp_path / "ckpt" / "step-00000008" / C.STATE
    state.write_bytes(state.read_bytes()[:50])  # truncated on disk
    with pytest.warns(UserWarning, match=r"step-00000008.*state\.pt is truncated or corrupted.*falling back"):
        _, resumed = train(data, tmp_path, resume=True)
    rows, metrics = full
    assert log_rows(tmp_path) == rows
    assert {k: resumed[k] for k in STABLE_METRICS} == {k: metrics[k] for k in STABLE_METRICS}


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace("\n5,", "\n6,", 1),  # a flipped digit in the step column
        lambda text: text + ",,,,,,,,\n",  # a torn append
        lambda text: ",,,,,,,,,\n" + text.split("\n", 1)[1],  # a header of commas
    ],
    ids=["flipped-step", "torn-append", "comma-header"],
)
def test_resume_rebuilds_the_log_from_the_checkpoint_whatever_became_of_the_file(
    data, tmp_path, full, damage
):
    train(data, tmp_path)
    for p in C.list_checkpoints(tmp_path / "ckpt")[1:]:  # resume from step 8
        import shutil

        shutil.rmtree(p)
    (tmp_path / "metrics.json").unlink()
    log = tmp_path / "log.csv"
    log.write_text(damage(log.read_text()))
    train(data, tmp_path, resume=True)
    rows, _ = full
    assert log_rows(tmp_path) == rows  # the uninterrupted run's rows, each once, in order


@pytest.mark.parametrize("keep", [1, 3])
def test_training_keeps_the_newest_keep_ckpts_checkpoints(data, tmp_path, keep):
    train(data, tmp_path, keep=keep)
    want = ["step-00000004", "step-00000008", "step-00000012"][-keep:]
    assert [p.name for p in C.list_checkpoints(tmp_path / "ckpt")] == want


def test_a_checkpoint_holds_every_rng_state_the_context_step_and_the_schedule(data, tmp_path):
    trainer, _ = train(data, tmp_path, steps=8, method="competesmoe")
    model = TransformerLM(LMConfig(vocab_size=256, method="competesmoe", **TINY))
    saved = C.load_checkpoint(tmp_path / "ckpt" / "step-00000004", model)
    schedule = trainer.ctx.schedule.state_dict()
    assert saved["step"] == 4 and saved["ctx"] == {"step": 4, "total_steps": 8, "schedule": schedule}
    assert set(saved["rng"]) == {"python", "numpy", "torch", "cuda", "data"}
    assert schedule["type"] == "competition" and schedule["seed"] == 5
    assert set(saved) >= {"optimizer", "scheduler", "trainer"}

    # restoring the RNG states replays every stream: python, numpy, torch and the data order
    gen = torch.Generator().manual_seed(3)
    T._set_rng_state(saved["rng"], gen)
    first = (random.random(), np.random.rand(), torch.rand(()), torch.randint(99, (4,), generator=gen))
    random.seed(1), np.random.seed(1), torch.manual_seed(1), gen.manual_seed(1)
    T._set_rng_state(saved["rng"], gen)
    again = (random.random(), np.random.rand(), torch.rand(()), torch.randint(99, (4,), generator=gen))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])


def test_resume_refuses_a_checkpoint_with_another_competition_schedule(data, tmp_path):
    trainer, _ = train(data, tmp_path, steps=8, method="competesmoe")
    saved = trainer.ctx.schedule.state_dict()
    (tmp_path / "metrics.json").unlink()
    for p in C.list_checkpoints(tmp_path / "ckpt")[1:]:  # resume from step 4
        import shutil

        shutil.rmtree(p)
    resumed, _ = train(data, tmp_path, steps=8, method="competesmoe", resume=True)
    assert resumed.ctx.schedule.state_dict() == saved  # the same competitions, rebuilt from the seed
    (tmp_path / "metrics.json").unlink()
    for p in C.list_checkpoints(tmp_path / "ckpt")[1:]:
        import shutil

        shutil.rmtree(p)
    with pytest.raises(
        ValueError, match=r"the saved routing state has schedule .*'seed': 5.*this context .*'seed': 6"
    ):
        train(data, tmp_path, steps=8, method="competesmoe", resume=True, seed=6)


def _nan_at(step: int):
    calls = {"n": 0}

    def loss(real, model, batch):
        calls["n"] += 1
        value, tokens = real(model, batch)
        return (value * float("nan") if calls["n"] == step else value), tokens

    return loss


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(data, tmp_path):
    with pytest.raises(
        TrainingError, match=r"non-finite loss at step 10 .*last good checkpoint is .*step-00000008"
    ):
        train(data, tmp_path, loss=_nan_at(10))
    ckpts = C.list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in ckpts] == ["step-00000004", "step-00000008"]
    model = TransformerLM(LMConfig(vocab_size=256, **TINY))
    C.load_checkpoint(ckpts[-1], model)  # verifies
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(log_rows(tmp_path)) == 9 and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_a_non_finite_gradient_stops_before_the_update(data, tmp_path, grad_clip):
    calls = {"n": 0}

    def loss(real, model, batch):
        calls["n"] += 1
        value, tokens = real(model, batch)
        if calls["n"] == 6:  # finite loss (sqrt(0) = 0) whose gradient is NaN (0 * inf)
            value = value + torch.sqrt(0.0 * model.head.weight.sum())
        return value, tokens

    with pytest.raises(TrainingError, match=r"non-finite gradient norm at step 6; .*step-00000004"):
        train(data, tmp_path, loss=loss, grad_clip=grad_clip)  # checked with clipping off too
    model = TransformerLM(LMConfig(vocab_size=256, **TINY))
    C.load_checkpoint(C.list_checkpoints(tmp_path / "ckpt")[-1], model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_non_finite_loss_without_checkpoint_says_so(data):
    model = TransformerLM(LMConfig(vocab_size=256, **TINY))
    task = LMTask(data, 16)
    real = task.loss
    task.loss = lambda m, b: (real(m, b)[0] * float("inf"), 1)
    with pytest.raises(TrainingError, match=r"no checkpoint was written yet\. Lower --lr"):
        Trainer(model, task, TrainConfig(steps=3, batch_size=2), None, progress=False).fit()


@pytest.mark.parametrize("activation", COMPETITION_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e4, -1e4])
def test_competition_affinities_stay_finite_for_outputs_of_order_1e4(activation, dtype, scale):
    torch.manual_seed(0)
    out = (scale * (1 + torch.rand(5, 4, 8))).to(dtype)  # |g| in [1e4, 2e4]
    s = competition_affinity(out, activation)
    assert s.shape == (5, 4) and torch.isfinite(s).all() and (s >= 0).all()
    if scale > 0:  # (very negative outputs may underflow to s = 0: the router clamps Σ s, below)
        assert torch.isfinite(normalized_weights(s)).all()
    if activation == "exp":  # the per-token max is 1 and the ranking is the exact one
        exact_log = out.double().logsumexp(-1)
        assert torch.equal(s.double().argmax(-1), exact_log.argmax(-1))
        torch.testing.assert_close(s.amax(-1), torch.ones(5, dtype=dtype))


@pytest.mark.parametrize("kappa", COMPETITION_ACTIVATIONS)
@pytest.mark.parametrize("sign", ["mixed", "negative"])
def test_a_competition_layer_stays_finite_with_large_expert_outputs(kappa, sign):
    torch.manual_seed(0)
    layer = moelab.MoE(16, 6, 2, d_hidden=32, method="competition", kappa=kappa)
    with torch.no_grad():
        w = layer.experts.w_out
        if sign == "negative":  # relu hidden units >= 0, so every output is <= 0: κ underflows to 0
            w.copy_(-w.abs())
        w.mul_(1e4 / w.abs().mean())  # outputs ~1e4
    x = torch.randn(10, 16)
    y = layer(x)
    r = layer.last_routing
    assert torch.isfinite(y).all() and torch.isfinite(r.weights).all() and (r.weights >= 0).all()
    if sign == "mixed":
        assert y.abs().amax() > 1e3


_KILLER = """
import os, signal, sys
from moelab.io import atomic as A

tmp, name = f".tmp-step-{int(os.environ['KILL_AT']):08d}", os.environ["KILL_FILE"]
real = A._sync

def sync(fd, path):
    if path.parent.name == tmp and path.name == name:
        if name == "state.pt":
            os.ftruncate(fd, 1000)  # half-way through the write
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd, path)

A._sync = sync
from moelab.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("file", [C.STATE, "config.json"])
def test_sigkill_inside_a_checkpoint_write_then_resume_ends_like_an_uninterrupted_run(tmp_path, file):
    """A real `moelab train` process SIGKILLed inside the atomic write of checkpoint 10 (state.pt
    half written, or everything written but not yet renamed), then resumed with --resume."""
    import json
    import os
    import subprocess
    import sys

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"row {i} of the corpus, value {i % 17}.\n" for i in range(600)))
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
        "KILL_AT": "10",
        "KILL_FILE": file,
    }
    args = ["train", "--data", str(corpus), "--block-size", "16", "--batch-size", "4", "--num-experts", "4",
            "--steps", "20", "--eval-every", "5", "--ckpt-every", "5", "--eval-tokens", "64", "--test-tokens", "64",
            "--no-progress"]  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "moelab.cli", *args, "--out", str(tmp_path / "full")], env=env, check=True
    )
    killed = subprocess.run([sys.executable, "-c", _KILLER, *args, "--out", str(tmp_path / "cut")], env=env)
    assert killed.returncode == -9
    assert (tmp_path / "cut" / "ckpt" / ".tmp-step-00000010").is_dir()
    subprocess.run(
        [sys.executable, "-m", "moelab.cli", *args, "--out", str(tmp_path / "cut"), "--resume"],
        env=env,
        check=True,
    )
    drop = lambda rows: [{k: v for k, v in r.items() if k != "time_s"} for r in rows]
    assert drop(RunDir(tmp_path / "cut", resume=True).read_log()) == drop(
        RunDir(tmp_path / "full", resume=True).read_log()
    )
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("full", "cut"))
    timing = ("tokens_per_s", "train_time_s")
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_ones(data, tmp_path, full, monkeypatch):
    import errno

    real = A._sync

    def sync(fd, path):
        if path.parent.name == ".tmp-step-00000008":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, path)

    with monkeypatch.context() as m:
        m.setattr(A, "_sync", sync)
        with pytest.raises(C.CheckpointError, match=r"cannot write checkpoint .*step-00000008: No space left on device; "
                           r"the previous checkpoints are kept \(step-00000004\); free disk space"):  # fmt: skip
            train(data, tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004"]  # no temporary left
    _, resumed = train(data, tmp_path, resume=True)
    rows, metrics = full
    assert log_rows(tmp_path) == rows
    assert {k: resumed[k] for k in STABLE_METRICS} == {k: metrics[k] for k in STABLE_METRICS}


def test_a_schedule_state_is_its_arguments_and_rebuilds_it():
    from moelab.schedules import CoinFlipSchedule, CompetitionSchedule, schedule_from_state

    coin = CoinFlipSchedule(2, rate=0.1, seed=3)
    assert coin.state_dict() == {"type": "coin-flip", "num_layers": 2, "rate": 0.1, "seed": 3}
    comp = CompetitionSchedule(3, 40, omega=0.3, seed=2)
    rebuilt = schedule_from_state(comp.state_dict())
    assert torch.equal(rebuilt.table, comp.table) and rebuilt.state_dict() == comp.state_dict()
    assert schedule_from_state(None) is None
    with pytest.raises(ValueError, match=r"schedule state of type 'x' is not allowed; expected one of"):
        schedule_from_state({"type": "x"})


def test_cuda_rng_states_are_saved_and_restored_when_there_is_a_gpu(monkeypatch):
    """The CUDA generators (dropout on the GPU) round-trip through the checkpoint state; faked here
    so that the plumbing is tested on CPU."""
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    gen = torch.Generator()
    saved = T._rng_state(gen)
    assert saved["cuda"] is states
    T._set_rng_state(saved, gen)
    assert restored == [states]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # resumed on fewer GPUs: left alone
    T._set_rng_state(saved, gen)
    assert restored == [states]


def test_resume_drops_cut_and_garbage_log_rows(data, tmp_path, full, monkeypatch):
    _interrupt_at_batch(11, data, tmp_path, monkeypatch)
    log = tmp_path / "log.csv"
    width = log.read_text().splitlines()[0].count(",")
    with log.open("a") as f:  # a zero-filled row (power loss) and a row cut mid-write
        f.write("\x00" * 3 + "," * width + "\n" + "11,0.001,2.5")
    train(data, tmp_path, resume=True)
    assert log_rows(tmp_path) == full[0]


def test_a_non_finite_validation_stops_before_that_step_is_saved(data, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = LMTask.evaluate

    def evaluate(self, model, split, max_tokens):
        out = real(self, model, split, max_tokens)
        if split == "valid":
            calls["n"] += 1
            if calls["n"] == 2:  # the validation at step 6 (eval_every 3); training stays finite
                out = {k: float("nan") for k in out}
        return out

    monkeypatch.setattr(LMTask, "evaluate", evaluate)
    with pytest.raises(
        TrainingError,
        match=r"validation bpc is not finite at step 6 .*last good checkpoint is .*step-00000004",
    ):
        train(data, tmp_path)
    assert [p.name for p in C.list_checkpoints(tmp_path / "ckpt")] == ["step-00000004"]
    assert not (tmp_path / "metrics.json").exists()


def test_an_update_that_overflows_stops_naming_the_last_good_checkpoint(data, tmp_path, monkeypatch):
    # the optimizer the trainer builds (AdamW by default); torch wraps each optimizer class's step
    # once, on that class, when its first instance is built: patch that class, not its base
    real, calls = torch.optim.AdamW.step, {"n": 0}

    def step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # what Adam raises when its step size does not fit the parameters' dtype
            raise RuntimeError("value cannot be converted to type float without overflow")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(TrainingError, match=r"the update at step 6 overflowed .*step-00000004.*Lower --lr"):
        train(data, tmp_path)


def test_a_learning_rate_float32_cannot_hold_is_refused():
    with pytest.raises(
        ValueError, match=r"lr=1e\+300 is not allowed; expected a number > 0 and <= 3\.4e\+38"
    ):
        TrainConfig(steps=1, batch_size=1, lr=1e300)
