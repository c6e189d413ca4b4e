"""``moelab specialize --resume`` / ``--force`` / ``--allow-changes``: per-epoch checkpoints, an exact
resume (the same metrics and weights as an uninterrupted run), the refusals and their messages.

A "kill" here is a ``KeyboardInterrupt`` raised at the Nth write event (the hook the crash harness
drives with a real SIGKILL, tests/test_crash_harness.py): nothing after it runs, the write it cuts
is left half-done (a temporary file), as a kill leaves it."""

import csv
import io
import json

import pytest
import yaml

from moelab import cli
from moelab.io import atomic, rundir

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

    monkeypatch.setattr(atomic, "write_event", event)
    monkeypatch.setattr(rundir, "write_event", event)
    return count


def metrics(path):
    m = json.loads((path / "metrics.json").read_text())
    m.pop("seconds")  # wall time: the one number that differs
    return m


def log_rows(path, name="log.csv"):
    rows = list(csv.DictReader(io.StringIO((path / name).read_text())))
    for r in rows:
        r.pop("seconds", None)
    return rows


def same_run(a, b):
    assert metrics(a) == metrics(b)
    assert (a / "model" / "model.safetensors").read_bytes() == (
        b / "model" / "model.safetensors"
    ).read_bytes()
    assert log_rows(a) == log_rows(b)
    if (a / "runs.csv").exists():
        assert (a / "runs.csv").read_text() == (b / "runs.csv").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert cli.main(["specialize", *DISTILL, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("kill", [2, 5, 9, 13])
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
    assert not (out / "ckpt").exists()  # a finished run drops its checkpoints
    assert not list(out.rglob(".*.tmp"))  # nor keeps the temporary files of cut writes


def test_every_epoch_is_checkpointed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 10**9)
    seen = []
    real = atomic.atomic_write_torch

    def spy(path, obj):
        seen.append((path.name, obj["epoch"], obj["optimizer"] is None))
        return real(path, obj)

    monkeypatch.setattr("moelab.experiments.specialization.atomic_write_torch", spy)
    assert main([*DISTILL, "--out", str(out)], capsys)[0] == 0
    assert seen == [(f"fit-{k:05d}.pt", e, e == 2) for k in range(4) for e in (1, 2)]


def test_a_damaged_log_is_rebuilt_from_the_checkpoint(reference, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 12)
    assert main([*DISTILL, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    with (out / "log.csv").open("a") as f:
        f.write("attentive-ls,9,0.1")  # a torn row
    (out / "runs.csv").write_text("garbage\n")
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
    kill_at(monkeypatch, 4)  # config.yaml, epoch 1's row and checkpoint, epoch 2's row: killed
    assert main([*TINY, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    code, _, err = main(["--resume", "--allow-changes", "--epochs", "3", "--out", str(out)], capsys)
    assert code == 0, err
    assert [r["epoch"] for r in log_rows(out)] == ["1", "2", "3"]
    assert yaml.safe_load((out / "config.yaml").read_text())["epochs"] == 3


def test_resume_refuses_other_data_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 4)
    assert main([*TINY, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["data_sha256"] = "0" * 64  # as if the files under --data-dir had changed
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    code, _, err = main(["--resume", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--resume: --data 'digits' has sha256 " in err
    assert (
        "but the run in" in err
        and "was trained on 000000000000…; the run cannot continue on other data" in err
    )
    assert main(["--resume", "--allow-changes", "--out", str(out)], capsys)[0] == 0


def test_a_finished_run_is_not_run_again_by_resume(reference, tmp_path, capsys):
    before = (reference / "metrics.json").read_text()
    code, out, _ = main(["--resume", "--out", str(reference)], capsys)
    assert code == 0 and "is finished; nothing to do (--force to run it again)" in out
    assert (reference / "metrics.json").read_text() == before


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
    assert left == [".lock", "ckpt", "config.yaml", "log.csv"]  # no runs.csv, model/, teacher plots
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
    assert code == 2 and f"--resume: {out / 'config.yaml'} is not the config of a specialize run" in err


def test_a_missing_or_damaged_checkpoint_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at(monkeypatch, 9)
    assert main([*DISTILL, "--out", str(out)], capsys)[0] == 130
    monkeypatch.undo()
    (out / "ckpt" / "fit-00001.pt").write_bytes(b"not a checkpoint")
    code, _, err = main(["--resume", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"checkpoint file {out / 'ckpt' / 'fit-00001.pt'} cannot be read" in err
    (out / "ckpt" / "fit-00000.pt").unlink()
    code, _, err = main(["--resume", "--out", str(out)], capsys)
    assert code == 2 and f"checkpoint file {out / 'ckpt' / 'fit-00000.pt'} is missing" in err


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
