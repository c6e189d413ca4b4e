"""User-facing errors of the moelab command (docs/errors.md): each bad flag, config file or data
file exits 2 with one line naming the input and what is allowed, before any data is read or any
training starts.  Messages that other test files already pin are not repeated here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab import cli


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("".join(f"row {i} of a corpus.\n" for i in range(200)))
    return path


def error_of(capsys, argv: list[str]) -> str:
    """Run ``moelab argv``; it must exit 2 with exactly one line on stderr, which is returned."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2, f"moelab {' '.join(argv)} exited {code}"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------ moelab train
@pytest.mark.parametrize(
    "text,message",
    [
        ("steps: [1", "is not valid YAML"),
        ("- steps\n- 3\n", "must hold a mapping of flag names to values"),
        ("stepz: 3\n", r"unknown keys \['stepz'\]; allowed: "),
        ("steps: ten\n", "steps='ten' is not allowed; expected an integer in \\[1, 1000000000\\]"),
        ("steps: true\n", "steps=True is not allowed; expected an integer in \\[1, 1000000000\\]"),
        ("lr: fast\n", "lr='fast' is not allowed; expected a number"),
        ("no-progress: 1\n", "no-progress=1 is not allowed; expected true or false"),
        ("opt: [1, 2]\n", r"--opt 1 is not allowed; expected KEY=VALUE"),
        ("schedule: step\n", r"schedule='step' is not allowed; expected one of \['inverse_sqrt'"),
        ("method: null\n", "method=None is not allowed; expected a string"),
        ("arch: {a: 1}\n", r"arch=\{'a': 1\} is not allowed; expected one of"),
    ],
)
def test_a_bad_config_file_names_the_file_the_key_and_what_is_allowed(capsys, tmp_path, text, message):
    path = config_file(tmp_path, text)
    err = error_of(capsys, ["train", "--config", path, "--out", str(tmp_path / "o"), "--data", "missing.txt"])
    assert err.startswith(f"moelab train: error: --config {path!r}")
    assert pytest.importorskip("re").search(message, err), err
    assert not (tmp_path / "o").exists()  # nothing was written


def test_config_values_fill_the_flags_like_the_command_line(tmp_path):
    import argparse

    from moelab.experiments import runner
    from moelab.experiments.lm import TRAIN, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    path = config_file(tmp_path, "steps: 7\nlr: 1\nopt: balance_coef=0\nno_progress: true\n")
    args = parser.parse_args(["--config", path, "--steps", "9"])
    given = runner.given_by_args(TRAIN, args)
    assert (given["steps"], given["lr"], given["opts"], given["progress"]) == (
        9,
        1,
        {"balance_coef": 0},
        True,
    )
    config = runner.resolve_config(TRAIN, given, out=None)[0]
    assert (config.steps, config.lr, config.opts) == (9, 1.0, {"balance_coef": 0})


def test_missing_config_file(capsys, tmp_path):
    err = error_of(capsys, ["train", "--config", "nope.yaml", "--out", str(tmp_path / "o")])
    assert err == "moelab train: error: --config 'nope.yaml' does not exist"


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "--out is required (the run directory)"),
        (["--opt", "1a=3"], "--opt '1a=3' is not allowed; KEY '1a' must be a name of letters"),
        (["--opt", "=3"], "--opt '=3' is not allowed; KEY '' must be a name of letters"),
        (["--opt", "omega="], "--opt 'omega=' is not allowed; VALUE is empty (expected KEY=VALUE"),
        (["--steps", "0"], "--steps=0 is not allowed; expected an integer in [1, 1000000000]"),
        (["--batch-size", "-2"], "--batch-size=-2 is not allowed; expected a positive integer"),
        (["--size", "huge"], "--size='huge' is not allowed; expected one of ['tiny'"),
        (["--arch", "moe"], "--arch='moe' is not allowed; expected one of ['switch', 'glam', 'dense']"),
        (["--method", "nope"], "'nope'"),
        (["--num-experts", "0"], "--num-experts=0 is not allowed; expected a positive integer"),
        (["--num-experts", "4", "--top-k", "5"], "top_k=5 is not allowed; expected an integer in [1, 4]"),
        (["--dropout", "1.5"], "dropout=1.5 is not allowed; expected a number in [0, 1)"),
        (["--lr", "0"], "lr=0.0 is not allowed; expected a number > 0"),
        (["--lr", "nan"], "lr=nan is not allowed; expected a number > 0"),
        (["--grad-clip", "-1"], "--grad-clip=-1.0 is not allowed; expected a number >= 0"),
        (["--ckpt-every", "-1"], "--ckpt-every=-1 is not allowed; expected an integer in [0,"),
        (["--warmup", "-3"], "warmup=-3 is not allowed; expected an integer in [0,"),
        (["--seed", "-1"], "seed=-1 is not allowed; expected an integer in [0,"),
        (["--weight-decay", "-1"], "--weight-decay=-1.0 is not allowed; expected a number >= 0"),
        (["--weight-decay", "inf"], "--weight-decay=inf is not allowed; expected a number >= 0"),
        (
            ["--optimizer", "adam", "--weight-decay", "0.1"],
            "optimizer='adam' with weight_decay=0.1 is not allowed; expected weight_decay=0 with adam",
        ),
    ],
)
def test_bad_train_flags_fail_before_the_data_is_read(capsys, tmp_path, argv, message):
    out = [] if not argv else ["--out", str(tmp_path / "o")]
    err = error_of(capsys, ["train", "--data", "missing.txt", *out, *argv])
    assert err.startswith("moelab train: error: ") and message in err, err
    assert not (tmp_path / "o").exists()


def test_threads_flag_is_validated(capsys, tmp_path, corpus):
    err = error_of(capsys, ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--threads", "0"])
    assert err == "moelab train: error: --threads=0 is not allowed; expected a positive integer"


@pytest.mark.parametrize("kind", ["dir", "binary-word", "empty", "short"])
def test_bad_data_files_name_the_file(capsys, tmp_path, kind):
    path = tmp_path / "data"
    extra: list[str] = []
    if kind == "dir":
        path.mkdir()
        message = f"--data {str(path)!r} is not a regular file"
    elif kind == "binary-word":
        path.write_bytes(b"\xff\xfe\x00bad" * 50)
        extra, message = (
            ["--level", "word"],
            f"--data {str(path)!r} is not UTF-8 text (needed for level='word')",
        )
    elif kind == "empty":
        path.write_text("  \n")
        message = f"--data {str(path)!r} is empty"
    else:
        path.write_text("tiny text\n")
        message = "is too short: its train split has"
    err = error_of(
        capsys, ["train", "--data", str(path), "--out", str(tmp_path / "o"), "--steps", "1", *extra]
    )
    assert message in err, err


def test_a_non_finite_loss_exits_1_and_says_what_was_kept(capsys, tmp_path, corpus):
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--steps", "3", "--block-size", "8",
            "--batch-size", "2", "--lr", "1e30", "--grad-clip", "0", "--no-progress", "--num-experts", "4"]  # fmt: skip
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "moelab train: non-finite" in out and "Lower --lr or check the data" in out
    assert "no checkpoint was written yet" in out


# ------------------------------------------------------------------------------ other commands
def test_compare_sweep_is_validated(capsys, tmp_path):
    err = error_of(
        capsys, ["compare", "--out", str(tmp_path / "c"), "--methods", "smoe", "--sweep", "omega="]
    )
    assert "--sweep 'omega=' is not allowed; VALUE is empty (expected KEY=V1,V2,..." in err


def _lm_config_yaml(**changes) -> str:
    """A complete ``config.yaml`` of a ``moelab train`` run (every recorded setting)."""
    import dataclasses

    import yaml

    from moelab.experiments.lm import TrainRun, resolve

    config = dataclasses.replace(resolve(TrainRun()), **changes)
    return yaml.safe_dump({"command": "train", **dataclasses.asdict(config), "recorded": {}}, sort_keys=False)


@pytest.mark.parametrize(
    "setup,message",
    [
        (
            {"config.yaml": "command: finetune\n"},
            "is not the config of a moelab train run (command='finetune'); expected a language-model run",
        ),
        ({"config.yaml": "command: train\n"}, "config.yaml' lacks the recorded settings --task, --data"),
        ({"config.yaml": _lm_config_yaml()}, "has no tokenizer.json"),
    ],
)
def test_finetune_refuses_a_run_that_is_not_a_finished_lm(capsys, tmp_path, setup, message):
    run = tmp_path / "lm"
    run.mkdir()
    for name, text in setup.items():
        (run / name).write_text(text)
    err = error_of(capsys, ["finetune", "--from", str(run), "--out", str(tmp_path / "o"), "--task", "x.csv"])
    assert err.startswith("moelab finetune: error: --from ") and message in err, err


def test_finetune_refuses_an_lm_run_without_weights(capsys, tmp_path):
    from moelab.data.text import ByteTokenizer

    run = tmp_path / "lm"
    run.mkdir()
    (run / "config.yaml").write_text(_lm_config_yaml(block_size=8, num_experts=4))
    (run / "tokenizer.json").write_text(json.dumps(ByteTokenizer().state()))
    err = error_of(capsys, ["finetune", "--from", str(run), "--out", str(tmp_path / "o"), "--task", "x.csv"])
    assert "holds no saved model (best/ or ckpt/step-*/)" in err


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "holds no rows"),
        ("text,label\nonly one column\n", "row 2 has 1 column(s), expected at least 2"),
        ("text,label,split\na,1,bogus\n", "row 2 has split 'bogus'; expected train, valid or test"),
        ("text,label\na,1\nb,1\n", "found 1 distinct label(s); classification needs at least 2"),
        ("text,label,split\na,1,train\nb,0,train\n", "the test split is empty"),
    ],
)
def test_a_bad_classification_file_names_the_row(tmp_path, content, message):
    from moelab.data.classification import read_table

    path = tmp_path / "task.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_table(path)


def test_a_classification_file_that_is_not_utf8(tmp_path):
    from moelab.data.classification import read_table

    path = tmp_path / "task.csv"
    path.write_bytes(b"text,label\n\xff\xfe,1\n")
    with pytest.raises(ValueError, match="cannot be read as UTF-8 text"):
        read_table(path)


def test_upcycle_option_is_validated(capsys, tmp_path):
    argv = ["upcycle", "--model", "m", "--num-experts", "4", "--top-k", "2", "--out", str(tmp_path / "o")]
    err = error_of(capsys, [*argv, "--option", "noequals"])
    assert "--option 'noequals' is not allowed; expected KEY=VALUE, e.g. --option balance_coef=0.02" in err


def test_argparse_errors_are_one_line(capsys):
    err = error_of(capsys, ["train", "--steps", "ten"])
    assert err == "moelab: error: argument --steps: invalid int value: 'ten'"


@pytest.mark.parametrize(
    "kind,message",
    [
        ("missing", "--model '{p}' does not exist (expected a local directory or a config JSON)"),
        ("empty-dir", "'{p}/config.json' is missing; --model needs a transformers config.json"),
        ("bad-json", "--model '{p}' is not valid JSON ("),
        ("no-type", "--model '{p}' has no 'model_type'; expected a transformers config.json"),
    ],
)
def test_upcycle_model_source_is_validated(capsys, tmp_path, kind, message):
    p = tmp_path / "model"
    if kind == "empty-dir":
        p.mkdir()
    elif kind == "bad-json":
        p.write_text("{nope")
    elif kind == "no-type":
        p.write_text('{"hidden_size": 8}')
    argv = ["upcycle", "--model", str(p), "--num-experts", "4", "--top-k", "2", "--out", str(tmp_path / "o")]
    err = error_of(capsys, argv)
    assert message.format(p=p) in err, err


def test_upcycle_layers_are_validated(capsys, tmp_path):
    argv = ["upcycle", "--model", "m", "--num-experts", "4", "--top-k", "2", "--out", str(tmp_path / "o")]
    err = error_of(capsys, [*argv, "--layers", "1,x"])
    assert "argument --layers: '1,x' is not a comma-separated list of integers" in err


# ------------------------------------------------------------------------------ library checks
def test_damaged_checkpoint_metadata_is_named(tmp_path):
    from moelab.train import checkpoint as C

    model = torch_tiny_model()
    path = C.save_checkpoint(tmp_path, 1, model, {"step": 1})
    (path / "config.json").write_text("{not json")
    with pytest.raises(C.CheckpointError, match=r".*step-00000001/config\.json' is corrupted \(not JSON\)"):
        C.verify_checkpoint(path)
    path = C.save_checkpoint(tmp_path, 2, model, {"step": 2})
    (path / "state.pt").unlink()
    with pytest.raises(C.CheckpointError, match=r"checkpoint file .*step-00000002/state\.pt is missing"):
        C.verify_checkpoint(path)


def torch_tiny_model():
    import torch

    from moelab.models.lm import LMConfig, TransformerLM

    torch.manual_seed(0)
    return TransformerLM(
        LMConfig(vocab_size=11, block_size=4, n_layer=1, d_model=8, n_head=2, num_experts=2, top_k=1)
    )


def test_text_readers_validate_their_arguments(tmp_path):
    from moelab.data.text import CharTokenizer, load_text, tokenizer_from_state

    with pytest.raises(ValueError, match=r"alphabet='aa' is not allowed; expected distinct characters"):
        CharTokenizer("aa")
    with pytest.raises(
        ValueError, match=r"tokenizer level='bpe' is not allowed; expected byte, char or word"
    ):
        tokenizer_from_state({"level": "bpe"})
    with pytest.raises(ValueError, match=r"level='char' is not allowed; expected byte or word"):
        load_text("default", level="char")
    path = tmp_path / "t.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    with pytest.raises(ValueError, match=r"split='dev' is not allowed; expected train, valid or test"):
        load_text(str(path)).split("dev")


def test_glam_needs_two_layers():
    from moelab.models.lm import LMConfig

    with pytest.raises(ValueError, match=r"n_layer=1 is not allowed for arch='glam'; expected >= 2"):
        LMConfig(vocab_size=10, n_layer=1, arch="glam")


def test_schedule_state_is_checked():
    from moelab import RoutingContext
    from moelab.schedules import CoinFlipSchedule, CompetitionSchedule, schedule_from_state

    ctx = RoutingContext(total_steps=10, schedule=CompetitionSchedule(2, 10, seed=0))
    other = RoutingContext(total_steps=10, schedule=CompetitionSchedule(2, 10, seed=1))
    with pytest.raises(
        ValueError, match=r"the saved routing state has schedule .*; expected the same schedule"
    ):
        ctx.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match=r"schedule state of type 'table' is not allowed"):
        schedule_from_state({"type": "table"})
    with pytest.raises(ValueError, match="a CoinFlipSchedule with a callable rate has no state_dict"):
        CoinFlipSchedule(2, rate=lambda step: 0.1).state_dict()


def test_competition_base_must_be_a_plain_router():
    import moelab

    with pytest.raises(ValueError, match=r"base='stablemoe' is not allowed: the base must be a plain router"):
        moelab.MoE(8, 4, 2, method="competesmoe", base="stablemoe")


def test_report_refuses_unreadable_runs(tmp_path):
    from moelab.experiments.report import collect_runs

    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("a: [1\n")
    (run / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match=r"run .*r cannot be read: "):
        collect_runs([run])
    (run / "config.yaml").write_text("task: lm\n")
    with pytest.raises(ValueError, match=r"run .*r has no test metric in metrics.json"):
        _ = collect_runs([run])[0].metric


def test_upcycle_and_from_hf_refuse_non_modules():
    import torch

    import moelab

    with pytest.raises(ValueError, match=r"model='x' is not allowed; expected a torch.nn.Module"):
        moelab.upcycle("x", 4, 2)
    with pytest.raises(
        ValueError, match=r"module of type Linear is not a transformers MoE block and contains none"
    ):
        moelab.from_hf(torch.nn.Linear(2, 2))


def test_save_refuses_non_tensor_state(tmp_path):
    import moelab

    with pytest.raises(ValueError, match=r"state entry 'w' is a str; expected a tensor"):
        moelab.save({"w": "x"}, tmp_path / "c")


def test_a_router_name_cannot_be_registered_twice():
    from moelab.routers import Router, register

    with pytest.raises(ValueError, match=r"router 'topk' is already registered"):
        register("topk")(type("Again", (Router,), {}))


def test_the_batch_must_split_over_the_processes(monkeypatch):
    from moelab.train import TrainConfig, Trainer
    from moelab.train import parallel as P

    monkeypatch.setattr(P, "process_group", lambda: (0, 4))
    model = torch_tiny_model()
    with pytest.raises(
        ValueError, match=r"batch_size=6 is not allowed with 4 processes; expected a multiple of"
    ):
        Trainer(model, object(), TrainConfig(steps=1, batch_size=6), None, progress=False)


def _command_raising(monkeypatch, exc):
    import sys
    import types

    mod = types.ModuleType("moelab_rely_fake")
    mod.add_arguments = lambda parser: None

    def run(args):
        raise exc

    mod.run = run
    monkeypatch.setitem(sys.modules, "moelab_rely_fake", mod)
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("moelab_rely_fake", "a fake command"))


@pytest.mark.parametrize(
    "exc",
    [
        OSError(28, "No space left on device", "runs/x/log.csv"),  # ENOSPC
        PermissionError(13, "Permission denied", "/runs"),
        OSError(30, "Read-only file system", "/ro/x"),
    ],
)
def test_a_full_disk_or_a_permission_error_is_one_line(monkeypatch, capsys, exc):
    _command_raising(monkeypatch, exc)
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == f"moelab fake: error: {exc}\n"
    with pytest.raises(OSError):
        cli.main(["--debug", "fake"])


def test_other_os_errors_keep_their_traceback(monkeypatch):
    _command_raising(monkeypatch, OSError(5, "Input/output error"))
    with pytest.raises(OSError, match="Input/output error"):
        cli.main(["fake"])


def test_an_unwritable_out_is_one_line(capsys, tmp_path, corpus):
    import os

    if os.geteuid() == 0:
        pytest.skip("root ignores folder permissions")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    err = error_of(capsys, ["train", "--data", str(corpus), "--out", str(locked / "run"), "--steps", "1"])
    assert "Permission denied" in err


@pytest.mark.parametrize(
    "name,sha,message",
    [
        (
            "../escape.bin",
            None,
            r"name='../escape.bin' is not allowed; expected a plain file name \(no folders\)",
        ),
        ("", None, r"name='' is not allowed; expected a plain file name"),
        ("d.bin", "abc", r"sha256='abc' is not allowed; expected 64 hexadecimal digits or None"),
        ("d.bin", "z" * 64, r"sha256='z{64}' is not allowed"),
    ],
)
def test_fetch_validates_the_name_and_the_digest(tmp_path, monkeypatch, name, sha, message):
    from moelab.data.download import fetch

    monkeypatch.setenv("MOELAB_DATA", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=message):
        fetch(name, "https://127.0.0.1:9/x", sha, progress=False)


def test_fetch_accepts_an_upper_case_digest_without_refetching(tmp_path, monkeypatch):
    import hashlib

    from moelab.data.download import fetch

    monkeypatch.setenv("MOELAB_DATA", str(tmp_path / "cache"))
    src = tmp_path / "d.bin"
    src.write_bytes(b"payload" * 10)
    digest = hashlib.sha256(src.read_bytes()).hexdigest().upper()
    fetch("d.bin", src.as_uri(), digest, progress=False)
    # cached and verified: the offline URL is never tried
    assert (
        fetch("d.bin", "https://127.0.0.1:9/x", digest, timeout=0.5, progress=False).read_bytes()
        == src.read_bytes()
    )


def test_tasks_models_and_the_trainer_validate_their_constructor_arguments(tmp_path):
    from moelab.data.classification import ClassificationData
    from moelab.data.text import ByteTokenizer, load_text
    from moelab.experiments.finetune import ClassificationTask
    from moelab.models.classifier import LMClassifier
    from moelab.train import Trainer
    from moelab.train.tasks import LMTask

    path = tmp_path / "t.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    text = load_text(str(path))
    with pytest.raises(ValueError, match=r"block_size=0 is not allowed; expected a positive integer"):
        LMTask(text, 0)
    with pytest.raises(ValueError, match=r"eval_batch=0 is not allowed; expected a positive integer"):
        LMTask(text, 8, eval_batch=0)
    data = ClassificationData("t", {s: ["a b", "c"] for s in ("train", "valid", "test")},
                              {s: [0, 1] for s in ("train", "valid", "test")}, ["0", "1"])  # fmt: skip
    with pytest.raises(ValueError, match=r"eval_batch=-1 is not allowed; expected a positive integer"):
        ClassificationTask(data, ByteTokenizer(), 8, eval_batch=-1)
    with pytest.raises(ValueError, match=r"num_classes=1 is not allowed; expected an integer >= 2"):
        LMClassifier(torch_tiny_model(), 1)
    with pytest.raises(ValueError, match=r"dropout=1.0 is not allowed; expected a number in \[0, 1\)"):
        LMClassifier(torch_tiny_model(), 2, dropout=1.0)
    with pytest.raises(ValueError, match=r"config of type dict is not allowed; expected a TrainConfig"):
        Trainer(torch_tiny_model(), LMTask(text, 4), {"steps": 1}, None)
