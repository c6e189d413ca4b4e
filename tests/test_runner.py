"""The run lifecycle every command shares: --config, the --resume checks and their one sentence
(the vocabulary the configs are declared with: tests/test_config.py)."""

from __future__ import annotations

import argparse

import pytest
import yaml

from config_helpers import Toy
from moelab import config as vocab
from moelab.experiments import runner


def _record(config, run):
    run.write_config()
    return {"name": config.name, "steps": config.inner.steps}


TOY = runner.Command("toy", Toy, _record)


def _parse(*argv):
    p = argparse.ArgumentParser()
    vocab.add_arguments(p, Toy)
    return p.parse_args(list(argv))


def test_a_config_file_fills_what_the_command_line_leaves_and_names_itself_in_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: b\ndepth: 4\ninner: {steps: 3}\n")
    given = runner.given_by_args(TOY, _parse("--config", str(path), "--depth", "5"))
    assert given == {"name": "b", "layers": 5, "inner.steps": 3}
    path.write_text("steps: 0\n")
    with pytest.raises(ValueError, match=r"^--config '.*c.yaml': --steps=0 is not allowed"):
        runner.given_by_args(TOY, _parse("--config", str(path)))
    path.write_text("nope: 1\n")
    with pytest.raises(ValueError, match=r"unknown keys \['nope'\]; allowed: "):
        runner.given_by_args(TOY, _parse("--config", str(path)))


def test_a_run_records_its_config_and_resume_refuses_a_changed_input_in_the_one_sentence(tmp_path):
    out = tmp_path / "run"
    assert runner.execute(TOY, {"inner.steps": 4}, out=out) == {"name": "a", "steps": 4}
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["command"] == "toy" and stored["inner"] == {"steps": 4, "lr": 0.1}
    # a run's own config.yaml is accepted back
    config, _ = runner.read_run_config(Toy, out, "toy")
    assert config.inner.steps == 4
    # not given: the run's own; how it runs (input=False) may change
    assert runner.execute(TOY, {"quiet": True}, out=out, resume=True)["steps"] == 4
    with pytest.raises(ValueError) as info:
        runner.execute(TOY, {"inner.steps": 5}, out=out, resume=True)
    assert str(info.value) == runner.refuse_change("--steps", 5, 4, out / "config.yaml").args[0]
    assert str(info.value).startswith(f"--resume: --steps=5 differs from 4 recorded in {out / 'config.yaml'}")
    # --allow-changes continues with the new settings and records them
    assert runner.execute(TOY, {"inner.steps": 5}, out=out, resume=True, allow_changes=True)["steps"] == 5
    assert yaml.safe_load((out / "config.yaml").read_text())["inner"]["steps"] == 5


def test_a_whole_config_counts_as_given_so_resume_compares_every_input(tmp_path):
    out = tmp_path / "run"
    runner.execute(TOY, Toy(), out=out)
    with pytest.raises(ValueError, match="--resume: --name='b' differs from 'a'"):
        runner.execute(TOY, Toy(name="b"), out=out, resume=True)


def test_resume_of_another_commands_run_and_contradictory_flags_are_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("command: train\n")
    with pytest.raises(ValueError, match=r"is not the config of a moelab toy run \(command='train'\)"):
        runner.execute(TOY, {}, out=out, resume=True)
    with pytest.raises(ValueError, match="--resume and --force are not allowed together"):
        runner.execute(TOY, {}, out=out, resume=True, force=True)
    with pytest.raises(ValueError, match="--allow-changes is not allowed without --resume"):
        runner.execute(TOY, {}, out=out, allow_changes=True)


def test_resume_refuses_other_data_in_the_one_sentence(tmp_path):
    out = tmp_path / "run"

    def fingerprinted(digest):
        def execute(config, run):
            run.check_fingerprint("--data", "x.txt", digest)
            run.write_config()
            return {"ok": 1}

        return runner.Command("toy", Toy, execute)

    runner.execute(fingerprinted("a" * 64), {}, out=out)
    with pytest.raises(ValueError) as info:
        runner.execute(fingerprinted("b" * 64), {}, out=out, resume=True)
    assert str(info.value) == runner.refuse_other_data("--data", "x.txt", "b" * 64, "a" * 64, out).args[0]
    assert runner.execute(fingerprinted("b" * 64), {}, out=out, resume=True, allow_changes=True) == {"ok": 1}


def test_metrics_json_is_written_by_the_lifecycle(tmp_path):
    import json

    out = tmp_path / "run"
    runner.execute(TOY, {"name": "b"}, out=out)
    assert json.loads((out / "metrics.json").read_text()) == {"name": "b", "steps": 10}


def test_train_specialize_and_bench_suite_refuse_a_changed_seed_in_the_same_sentence(
    corpus, tmp_path, capsys
):
    """One resume implementation: each command's recorded settings are checked by the runner, so
    a changed ``--seed`` gets the one sentence of :func:`runner.refuse_change` everywhere."""
    from moelab import cli

    train = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
             "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "32",
             "--test-tokens", "32", "--no-progress"]  # fmt: skip
    specialize = ["specialize", "--epochs", "1", "--train-samples", "64", "--test-samples", "32"]
    suite = ["bench", "suite", "--tokens", "4", "--routing", "balanced", "--shapes", "4x2x16", "--d-model", "16",
             "--repeats", "2", "--warmup", "0", "--threads", "1", "--peers", "none", "--no-memory"]  # fmt: skip
    commands = {
        "train": (train, tmp_path / "train", tmp_path / "train" / "config.yaml"),
        "specialize": (specialize, tmp_path / "spec", tmp_path / "spec" / "config.yaml"),
        "bench": (suite, tmp_path / "suite.json", tmp_path / "suite.json"),
    }
    for name, (argv, out, where) in commands.items():
        assert cli.main([*argv, "--out", str(out)]) == 0, name
        capsys.readouterr()
        assert cli.main([*argv, "--out", str(out), "--resume", "--seed", "1"]) == 2, name
        sentence = runner.refuse_change("--seed", 1, 0, where).args[0]
        assert capsys.readouterr().err == f"moelab {name}: error: {sentence}\n", name


def test_an_out_holding_the_config_file_the_command_reads_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    file = out / "c.yaml"
    file.write_text("name: b\n")
    with pytest.raises(
        ValueError, match=r"^--config '.*c.yaml' lies in --out '.*run': the run would write over"
    ):
        runner.execute(TOY, {"name": "b"}, out=out, force=True, inputs={"--config": str(file)})
    assert file.exists()
    runner.execute(TOY, {"name": "b"}, out=tmp_path / "other", inputs={"--config": str(file)})


def test_a_resume_on_another_number_of_processes_says_so_once(tmp_path, capsys):
    out = tmp_path / "run"
    runner.execute(TOY, {}, out=out)
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["recorded"]["world_size"] == 1
    runner.execute(TOY, {}, out=out, resume=True)
    assert "process(es)" not in capsys.readouterr().out  # the same number: nothing to say
    stored["recorded"]["world_size"] = 2  # as if trained under torchrun --nproc-per-node 2
    (out / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    runner.execute(TOY, {}, out=out, resume=True)
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and printed == (
        f"--resume: the run in {out} was trained on 2 process(es) and continues on 1: the data order and "
        "the per-rank terms (each rank's share of the batch, rank-local balance statistics) change from "
        "here on, so it will not end as an uninterrupted run would\n"
    )
