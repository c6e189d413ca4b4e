"""``moelab specialize --resume`` / ``--force`` / ``--allow-changes``: per-epoch checkpoints, an exact
resume (the same metrics and weights as an uninterrupted run), the refusals and their messages.

A "kill" here is a ``KeyboardInterrupt`` raised at the Nth write event (the write hook the crash
harness drives with a real SIGKILL, tests/test_crash_harness.py): nothing after it runs, the write it
cuts is left half-done (a temporary file), as a kill leaves it."""

import csv
import io
import json

import pytest
import yaml

from moelab import cli
from moelab.io import atomic

TINY = ["--epochs", "2", "--train-samples", "96", "--test-samples", "48"]
#: 2 seeds of an attentive L_s model distilled: 4 fits (teacher, student per seed), runs.csv and log.csv
DISTILL = ["--gate", "attentive", "--reg", "ls", "--distill", "--runs", "2", *TINY]


def main(argv, capsys):
    code = cli.main(["specialize", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def kill_at(monkeypatch, n):
    """Raise KeyboardInterrupt (a kill: nothing after it runs) at this process's nth write event."""
    count = {"n": 0}

    def event():
        count["n"] += 1
        if count["n"] == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "_write_hook", event)  # the write hook; undone by monkeypatch.undo()
    return count


def metrics(path):
    m = json.loads((path / "metrics.json").read_text())
    m.pop("seconds")  # wall time: the one number that differs
    return m


def log_rows(path, name="log.csv"):
    rows = list(csv.DictReader(io.StringIO((path / name).read_text())))
    for r in rows:
        r.pop("time_s", None)
    return rows


def same_run(a, b):
    """The same metrics, weights and CSV rows in every file of the two runs (timings aside)."""
    assert metrics(a) == metrics(b)
    files = lambda root, pattern: sorted(p.relative_to(root) for p in root.rglob(pattern))
    assert files(a, "*.safetensors") == files(b, "*.safetensors")
    for name in files(a, "*.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert files(a, "*.csv") == files(b, "*.csv")
    for name in files(a, "*.csv"):
        assert log_rows(a / name.parent, name.name) == log_rows(b / name.parent, name.name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert cli.main(["specialize", *DISTILL, "--out", str(out)]) == 0
    return out


#: the teacher of seed 0 (attentive, L_s at the digits defaults)
TEACHER = "attentive-ls-bs0.0001-bd0.001-e5-s0"


@pytest.mark.parametrize("kill", [2, 9, 17, 30])
def test_a_killed_run_resumed_ends_bit_identical_to_an_uninterrupted_one(
    reference, kill, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    count = kill_at(monkeypatch, kill)
    code, _, err = main([*DISTILL, "--out", str(out)], capsys)
    assert code == 130 and "interrupted" in err and count["n"] == kill
    monkeypatch.undo()
    code, _, err = main(["--resume", "--out", str(out)], capsys)  # the flags are the run's own
    assert code == 0, err
    same_run(reference, out)


def test_every_epoch_of_every_model_is_checkpointed(tmp_path, capsys, monkeypatch):
    from moelab.train import checkpoint

    seen = []
    real = checkpoint.save_checkpoint

    def spy(root, step, model, state, keep=2):
        seen.append((root.parent.name, step))
        return real(root, step, model, state, keep)

    monkeypatch.setattr(checkpoint, "save_checkpoint", spy)
    assert main([*DISTILL, "--out", str(tmp_path / "run")], capsys)[0] == 0
    fits = [f"{TEACHER[:-1]}{s}{d}" for s in (0, 1) for d in ("", "-distilled")]
    assert seen == [(f, step) for f in fits for step in (2, 4)]  # 96 samples, batch 64: 2 steps an epoch


def test_a_damaged_log_or_checkpoint_is_rebuilt(reference, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 20)
    assert main([*DISTILL, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    with (out / "fits" / TEACHER / "log.csv").open("a") as f:
        f.write("9,0.1")  # a torn row
    for damaged in (out / "fits").rglob("model.safetensors"):
        damaged.write_bytes(b"not a checkpoint")  # passed over with a warning: the model trains again
        break
    assert main(["--resume", "--out", str(out)], capsys)[0] == 0
    same_run(reference, out)


def test_resume_refuses_a_changed_flag_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 4)
    assert main([*TINY, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    code, _, err = main(["--resume", "--epochs", "3", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert (
        f"--resume: --epochs=3 differs from 2 recorded in {out / 'config.yaml'}; the run cannot continue with "
        "other settings (pass --allow-changes to continue it with the new ones, or --force to start afresh)"
    ) in err
    code, _, err = main(["--resume", "--gate", "attentive", "--out", str(out)], capsys)
    assert code == 2 and "--resume: --gate='attentive' differs from 'original'" in err


def test_resume_with_allow_changes_continues_with_the_new_epochs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 6)  # config.yaml, the model's config.yaml, 2 rows, epoch 1's checkpoint, a row
    assert main([*TINY, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    code, _, err = main(["--resume", "--allow-changes", "--epochs", "3", "--out", str(out)], capsys)
    assert code == 0, err
    assert [r["step"] for r in log_rows(out / "fits" / "original-none-e5-s0")] == [
        str(i) for i in range(1, 7)
    ]
    assert yaml.safe_load((out / "config.yaml").read_text())["epochs"] == 3


def test_resume_refuses_other_data_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 4)
    assert main([*TINY, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["recorded"]["data_sha256"] = "0" * 64  # as if the files under --data-dir had changed
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    code, _, err = main(["--resume", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--resume: --data 'digits' has sha256 " in err
    assert (
        "but the run in" in err
        and "was trained on 000000000000…; the run cannot continue on other data" in err
    )
    assert main(["--resume", "--allow-changes", "--out", str(out)], capsys)[0] == 0


def test_a_finished_run_resumed_trains_nothing_and_ends_the_same(reference, tmp_path, capsys, monkeypatch):
    before = metrics(reference)
    monkeypatch.setattr("moelab.train.trainer.Trainer._step", None)  # a training step would fail
    code, _, err = main(["--resume", "--out", str(reference)], capsys)
    assert code == 0, err
    assert metrics(reference) == before


def test_a_finished_run_refuses_a_rerun_and_names_resume_which_works(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out)], capsys)[0] == 0
    code, _, err = main([*TINY, "--out", str(out)], capsys)
    assert code == 2 and "already holds a run; pass --resume to continue it or --force" in err
    assert main([*TINY, "--resume", "--out", str(out)], capsys)[0] == 0


def test_force_leaves_nothing_of_the_old_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main([*DISTILL, "--out", str(out)], capsys)[0] == 0
    kill_at(monkeypatch, 3)
    assert main([*TINY, "--force", "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    left = sorted(p.name for p in out.iterdir())
    assert left == [".lock", ".moelab-files", "config.yaml", "fits"]  # no runs.csv, model/, teacher plots
    assert main(["--resume", "--out", str(out)], capsys)[0] == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["distill"] is False


def test_resume_of_an_empty_folder_starts_a_run(tmp_path, capsys):
    code, out, _ = main([*TINY, "--resume", "--out", str(tmp_path / "new")], capsys)
    assert code == 0 and "holds no run yet; starting one" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--resume", "--force"],
            "--resume and --force are not allowed together; --resume continues the run in --out, "
            "--force starts it afresh",
        ),
        (["--allow-changes"], "--allow-changes is not allowed without --resume"),
    ],
)
def test_resume_flag_combinations_are_refused_in_one_line(argv, message, tmp_path, capsys):
    code, _, err = main([*TINY, *argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_resume_of_a_folder_of_another_command_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("command: train\n")
    code, _, err = main(["--resume", "--out", str(out)], capsys)
    assert (
        code == 2 and f"--resume: {out / 'config.yaml'} is not the config of a moelab specialize run" in err
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "partition"],
        ["--mode", "scaling", "--counts", "2,3"],
        ["--mode", "table", "--rows", "1,8"],
        ["--sweep", "--reg", "importance"],
    ],
    ids=["partition", "scaling", "table", "sweep"],
)
def test_every_mode_resumes_bit_identically(argv, tmp_path, capsys, monkeypatch):
    ref, out = tmp_path / "ref", tmp_path / "run"
    argv = [*argv, "--epochs", "1", "--train-samples", "64", "--test-samples", "32"]
    count = kill_at(monkeypatch, 10**9)
    assert main([*argv, "--out", str(ref)], capsys)[0] == 0
    events = count["n"]
    for kill in (events // 3, 2 * events // 3):
        kill_at(monkeypatch, kill)
        assert main([*argv, "--out", str(out)] + (["--resume"] if out.exists() else []), capsys)[0] == 130
    monkeypatch.undo()
    assert main(["--resume", "--out", str(out)], capsys)[0] == 0
    assert metrics(ref) == metrics(out)
    for model in ref.rglob("model.safetensors"):
        assert model.read_bytes() == (out / model.relative_to(ref)).read_bytes()
    for name in ("log.csv", "runs.csv"):
        if (ref / name).exists():
            assert log_rows(ref, name) == log_rows(out, name)
