"""RunDir: never overwrite a finished run; atomic writes; appended logs."""

from __future__ import annotations

import json
import math
import os

import pytest
import yaml

from moelab.io.rundir import RunDir, atomic_write_bytes, atomic_write_text


def test_rundir_creates_the_folder(tmp_path):
    run = RunDir(tmp_path / "a" / "b")
    assert run.path.is_dir()


def test_rundir_refuses_an_existing_run_without_resume_or_force(tmp_path):
    RunDir(tmp_path).write_config({"lr": 1e-3})
    with pytest.raises(
        FileExistsError,
        match=r"already holds a run; pass --resume to continue it or --force to remove the files",
    ):
        RunDir(tmp_path)
    assert RunDir(tmp_path, resume=True).read_config() == {"lr": 1e-3}
    RunDir(tmp_path, force=True)


def test_rundir_accepts_a_folder_without_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    RunDir(tmp_path)


def test_rundir_refuses_a_file_as_out(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"exists and is not a directory"):
        RunDir(f)


def test_config_and_metrics_round_trip_as_plain_data(tmp_path):
    run = RunDir(tmp_path)
    run.write_config({"sizes": (1, 2), "path": tmp_path / "x", "nested": {"a": 1}})
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {
        "sizes": [1, 2],
        "path": str(tmp_path / "x"),
        "nested": {"a": 1},
    }
    run.write_metrics({"loss": 0.5, "bad": math.nan, "inf": math.inf})
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"loss": 0.5, "bad": None, "inf": None}
    assert run.read_metrics()["loss"] == 0.5


def test_append_log_appends_rows_under_one_header(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_log() == []
    run.append_log({"step": 1, "loss": 2.5})
    run.append_log({"step": 2, "loss": 2.0})
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines == ["step,loss", "1,2.5", "2,2.0"]
    assert run.read_log() == [{"step": "1", "loss": "2.5"}, {"step": "2", "loss": "2.0"}]
    resumed = RunDir(tmp_path, resume=True)
    resumed.append_log({"step": 3, "loss": 1.5})
    assert len(resumed.read_log()) == 3


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("moelab.io.atomic.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_a_png_is_written_atomically_the_same_bytes_each_time_and_its_pyplot_figure_closed(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moelab.io.atomic import atomic_write_png

    def draw():
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot([0, 1, 2], [1, 0, 2])
        return fig

    fig = draw()
    path = atomic_write_png(tmp_path / "sub" / "f.png", fig, dpi=50)
    first = path.read_bytes()
    assert first.startswith(b"\x89PNG\r\n\x1a\n") and b"Software" not in first
    assert not plt.fignum_exists(fig.number)  # pyplot holds no figure a writer drew
    assert atomic_write_png(path, draw(), dpi=50).read_bytes() == first  # drawn again: the same file
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.png"]


def test_every_png_moelab_writes_goes_through_the_one_writer():
    """No module but :mod:`moelab.io.atomic` calls ``savefig``: every figure is written by
    ``atomic_write_png`` (atomic, the same bytes for the same figure)."""
    import ast
    import pathlib

    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "moelab"
    callers = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("savefig", "print_png", "imsave")
    )
    assert callers == ["io/atomic.py"]


def test_force_starts_a_fresh_run_without_the_old_log_and_metrics(tmp_path):
    old = RunDir(tmp_path)
    old.write_config({"lr": 1.0})
    old.write_metrics({"loss": 9.0})
    old.append_log({"step": 1, "loss": 9.0})
    old.append_log({"step": 1, "loss": 9.0}, name="eval.csv")
    (tmp_path / "notes.txt").write_text("mine")
    new = RunDir(tmp_path, force=True)
    assert new.read_log() == [] and new.read_log("eval.csv") == []
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "config.yaml").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only the run's own files go
    new.append_log({"step": 1, "loss": 2.0})
    assert new.read_log() == [{"step": "1", "loss": "2.0"}]


def test_resume_keeps_the_old_run_even_with_force(tmp_path):
    old = RunDir(tmp_path)
    old.write_config({"lr": 1.0})
    old.append_log({"step": 1})
    resumed = RunDir(tmp_path, resume=True, force=True)
    assert resumed.read_config() == {"lr": 1.0} and len(resumed.read_log()) == 1


def test_append_log_keeps_the_first_rows_columns_in_their_order(tmp_path):
    run = RunDir(tmp_path)
    run.append_log({"step": 1, "loss": 2.5})
    RunDir(tmp_path, resume=True).append_log({"loss": 2.0, "lr": 0.1, "step": 2})  # reordered, extra key
    assert (tmp_path / "log.csv").read_text().splitlines() == ["step,loss", "1,2.5", "2,2.0"]


def test_an_out_name_too_long_for_the_file_system_is_refused_before_anything_is_written(tmp_path):
    long = "x" * 300
    with pytest.raises(
        ValueError, match=r"the folder name 'xxxxxxxxxxxxxxxxxxxx'… is 300 bytes; expected at most 255"
    ):
        RunDir(tmp_path / long / "run")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="is longer than 4095 bytes"):
        RunDir(tmp_path.joinpath(*["y" * 200] * 25))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_give_a_file_the_mode_the_umask_allows(tmp_path, umask, mode):
    import stat

    old = os.umask(umask)
    try:
        path = atomic_write_text(tmp_path / "metrics.json", "{}\n")
        log = tmp_path / "log.csv"
        log.write_text("step\n")  # a plain file, for comparison
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode == stat.S_IMODE(log.stat().st_mode)


def test_a_run_opened_again_removes_the_temporary_files_killed_writes_left(tmp_path):
    (tmp_path / "config.yaml").write_text("command: train\n")
    (tmp_path / "best").mkdir()
    stale = [
        tmp_path / ".metrics.json.k2j3h4.tmp",
        tmp_path / "best" / ".model.safetensors.abc123.tmp",
        tmp_path / "ckpt" / ".tmp-step-00000004",
    ]
    stale[2].mkdir(parents=True)
    for p in stale[:2]:
        p.write_bytes(b"\0" * 1000)
    (tmp_path / "notes.tmp").write_text("the user's")  # not a temporary name of the atomic writer
    RunDir(tmp_path, resume=True).close()
    assert not any(p.exists() for p in stale)
    assert (tmp_path / "notes.tmp").exists() and (tmp_path / "config.yaml").exists()


def test_force_removes_only_what_moelab_wrote_never_the_users_files(tmp_path):
    from moelab.io.atomic import atomic_directory

    out = tmp_path / "out"
    run = RunDir(out)
    run.write_config({"command": "compare"})
    run.write_metrics({"loss": 1.0})
    run.append_log({"step": 1}, name="eval.csv")
    atomic_write_text(out / "report" / "table.txt", "t\n")
    with atomic_directory(out / "ckpt" / "step-00000001") as tmp:
        atomic_write_text(tmp / "state.pt", "x")
    child = RunDir(out / "smoe" / "seed0")  # a comparison's run, written while out is held
    child.write_config({"command": "train"})
    child.close()
    run.close()
    # the user's own files beside and inside the run: a CSV, an earlier run of theirs, a task file
    (out / "mine.csv").write_text("the user's table")
    (out / "smoe" / "notes.md").write_text("the user's notes")
    earlier = RunDir(out / "earlier")
    earlier.write_config({"command": "train"})
    earlier.close()
    (out / "task.csv").write_text("text,label\n")
    with pytest.raises(
        FileExistsError, match=r"already holds a run; pass --resume to continue it or --force to remove "
    ):
        RunDir(out)
    RunDir(out, force=True).close()
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert left == [
        ".lock", "earlier/.lock", "earlier/.moelab-files", "earlier/config.yaml", "mine.csv", "smoe/notes.md",
        "task.csv",
    ]  # fmt: skip


def test_force_refuses_a_folder_whose_run_files_no_manifest_lists_and_removes_nothing(tmp_path):
    for name in ("config.yaml", "results.csv", "log.csv"):  # a user's files, or an older moelab's run
        (tmp_path / name).write_text("x")
    with pytest.raises(FileExistsError) as info:
        RunDir(tmp_path)
    assert "--force" not in str(info.value) and "config.yaml, log.csv, results.csv" in str(info.value)
    with pytest.raises(
        FileExistsError,
        match=r"^--force: --out .* holds config.yaml, log.csv, results.csv, which no moelab run recorded "
        r"writing \(your files, or a run of an older moelab\); --force removes only what moelab wrote",
    ):
        RunDir(tmp_path, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "log.csv", "results.csv"]


def test_the_manifest_lists_a_file_before_it_is_written_so_a_killed_write_is_still_moelabs(tmp_path):
    from moelab.io.atomic import MANIFEST, set_write_hook

    run = RunDir(tmp_path)

    def kill() -> None:
        raise KeyboardInterrupt

    set_write_hook(kill)
    try:
        with pytest.raises(KeyboardInterrupt):
            run.write_metrics({"loss": 1.0})
    finally:
        set_write_hook(None)
    assert "metrics.json" in (tmp_path / MANIFEST).read_text().splitlines()
    run.close()


def test_a_manifest_entry_that_leaves_the_folder_is_never_followed(tmp_path):
    from moelab.io.atomic import MANIFEST

    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "precious.txt").write_text("x")
    (out / MANIFEST).write_text("../precious.txt\n" + str(tmp_path / "precious.txt") + "\n")
    RunDir(out, force=True).close()
    assert (tmp_path / "precious.txt").exists()


def test_a_transformers_models_config_json_is_not_a_run(tmp_path):

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_text("x")
    RunDir(tmp_path, force=True).close()  # not refused, and nothing of the model removed
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()


def test_force_clears_a_nested_run_another_process_wrote_through_its_own_manifest(tmp_path):
    from moelab.io.atomic import MANIFEST, record_write

    out = tmp_path / "out"
    top = RunDir(out)
    record_write(out / "smoe" / "seed0" / MANIFEST)  # compare's worker processes write these runs
    top.write_config({"command": "compare"})
    top.close()
    child = RunDir(out / "smoe" / "seed0")  # written while no folder of this process holds out
    child.write_config({"command": "train"})
    child.append_log({"step": 1})
    child.close()
    (out / "smoe" / "notes.md").write_text("the user's")
    RunDir(out, force=True).close()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [".lock", "smoe", "smoe/notes.md"]


def test_a_checked_result_killed_mid_write_is_still_vouched_for_and_an_edit_is_refused(tmp_path):
    from moelab.io.atomic import atomic_write_checked, read_json, set_write_hook

    path = tmp_path / "cost.json"
    atomic_write_checked(path, b'{"a": 1}\n')
    assert read_json(path) == {"a": 1}

    def kill() -> None:
        raise KeyboardInterrupt

    set_write_hook(kill)
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic_write_checked(path, b'{"a": 2}\n')
    finally:
        set_write_hook(None)
    assert read_json(path) == {"a": 1}  # the old content, still vouched for
    atomic_write_checked(path, b'{"a": 2}\n')
    assert read_json(path) == {"a": 2}
    path.write_text('{"a": 3}\n')
    with pytest.raises(ValueError, match=r"cost.json' was changed after moelab wrote it \(its sha256 is not"):
        read_json(path)
    path.write_text('{"a": 1}\n')  # nor is the content before the last write
    with pytest.raises(ValueError, match="was changed after moelab wrote it"):
        read_json(path)


def test_an_interrupted_force_is_finished_by_the_next_one(tmp_path, monkeypatch):
    from pathlib import Path

    out = tmp_path / "out"
    run = RunDir(out)
    for name in ("benchmark.md", "benchmark.csv", "smoe/cost.json", "smoe/seed0/metrics.json"):
        atomic_write_text(out / name, "old\n")
    run.close()
    real = Path.unlink
    calls = []

    def interrupted(self, missing_ok=False):
        calls.append(self.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a Ctrl-C in the middle of the clearing
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", interrupted)
    with pytest.raises(KeyboardInterrupt):
        RunDir(out, force=True)
    monkeypatch.undo()
    assert any((out / n).exists() for n in ("benchmark.md", "benchmark.csv", "smoe/cost.json"))
    from moelab.io.atomic import release_folder
    from moelab.io.rundir import _HELD

    os.close(_HELD.pop(out.resolve()))  # the interrupted process's lock, released as its exit would
    release_folder(out)
    RunDir(out, force=True).close()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [".lock"]
