"""The moelab command's core behaviour: help, version, unknown commands, one-line errors."""

from __future__ import annotations

import pytest

import moelab
from moelab import cli


def test_help_exits_zero_and_describes_the_tool(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: moelab" in out and "mixture-of-experts" in out


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moelab {moelab.__version__}"


def test_unknown_command_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["no-such-command"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab: error:") and "no-such-command" in err
    assert "Traceback" not in err


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: moelab" in capsys.readouterr().out


def _fake_command(monkeypatch, exc):
    import sys
    import types

    mod = types.ModuleType("moelab_fake_cmd")

    def add_arguments(parser):
        parser.add_argument("--n", type=int, default=1)

    def run(args):
        if exc is not None:
            raise exc
        return 0

    mod.add_arguments, mod.run = add_arguments, run
    monkeypatch.setitem(sys.modules, "moelab_fake_cmd", mod)
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("moelab_fake_cmd", "a fake command"))


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("top_k=9 is not allowed"),
        cli.UsageError("bad --out"),
        FileNotFoundError("no such file: x"),
        FileExistsError("--out runs/x already holds a run"),
        NotADirectoryError("--out f exists and is not a directory"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(monkeypatch, capsys, exc):
    _fake_command(monkeypatch, exc)
    assert cli.main(["fake"]) == 2
    err = capsys.readouterr().err
    assert err == f"moelab fake: error: {exc}\n"


def test_debug_shows_the_traceback(monkeypatch):
    _fake_command(monkeypatch, ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        cli.main(["--debug", "fake"])


def test_subcommand_bad_argument_exits_2(monkeypatch, capsys):
    _fake_command(monkeypatch, None)
    assert cli.main(["fake", "--n", "3"]) == 0
    with pytest.raises(SystemExit) as info:
        cli.main(["fake", "--n", "x"])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_interrupt_exits_130(monkeypatch, capsys):
    _fake_command(monkeypatch, KeyboardInterrupt())
    assert cli.main(["fake"]) == 130
    assert capsys.readouterr().err == "moelab fake: interrupted\n"


def test_other_errors_keep_their_traceback(monkeypatch):
    _fake_command(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fake"])


def test_python_dash_m_moelab_help_exits_0_and_lists_every_subcommand():
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(cli.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "moelab", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: moelab")
    for name in cli.SUBCOMMANDS:
        assert name in proc.stdout


def _all_help(parser) -> list[str]:
    """The help text of ``parser`` and of every subcommand under it, recursively."""
    import argparse

    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts += _all_help(sub)
    return texts


def test_help_cites_papers_by_name_not_by_internal_number_or_issue():
    import re

    internal = re.compile(r"(?<![\d.,])\b00[0-4]\b(?![.,]?\d)|\b[Ii]ssue \d|paper 00")
    texts = _all_help(cli.build_parser())
    assert len(texts) > len(cli.SUBCOMMANDS)
    for text in texts:
        assert not internal.search(text), internal.search(text).group(0) + " in:\n" + text
    assert any("CompeteSMoE (2024) Table 2" in t for t in texts)


def test_references_table_holds_every_short_citation_and_the_readme_links_it():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = (root / "docs" / "references.md").read_text(encoding="utf-8")
    for name, arxiv in [
        ("CompeteSMoE (2024)", "2402.02526"),
        ("CompeteSMoE (2025)", "2505.13380"),
        ("Krishnamurthy et al. (2023)", "Improving Expert Specialization"),
        ("perturbed cosine router (2024)", "2405.14131"),
        ("Ho (2025)", "VIASM"),
    ]:
        assert f"| {name} |" in table and arxiv in table
    assert "docs/references.md" in (root / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("command", ["train", "compare", "finetune", "upcycle", "specialize", "simulate"])
def test_resume_with_force_is_refused_by_every_command_in_one_sentence(command, tmp_path, capsys):
    assert cli.main([command, "--out", str(tmp_path / "o"), "--resume", "--force"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"moelab {command}: error: --resume and --force are not allowed together; --resume continues the run "
        "in --out, --force starts it afresh\n"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["upcycle", "--model", "m", "--num-experts", "2", "--top-k", "1", "--seed", "-1"],
         "--seed=-1 is not allowed; expected an integer in [0, 9223372036854775807]"),
        (["bench", "suite", "--seed", "-1"], "--seed=-1 is not allowed; expected an integer in [0, 9223372036854775807]"),
        (["finetune", "--task", "t.csv", "--from", "r", "--eval-every", "0"],
         "--eval-every=0 is not allowed; expected a positive integer"),
    ],
)  # fmt: skip
def test_seed_and_eval_every_are_checked_alike_by_every_command(argv, message, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {message}\n") and len(err.strip().splitlines()) == 1


def test_help_shows_percent_signs_once_never_doubled():
    import re

    texts = _all_help(cli.build_parser())
    assert not [t for t in texts if "%%" in t]
    assert any(re.search(r"5%\s+of\s+--steps", t) for t in texts)


def test_a_retired_environment_variable_is_named_once_not_silently_ignored(monkeypatch, capsys):
    monkeypatch.setenv("MOELAB_AUTOTUNE", "bogus")
    assert cli.main(["simulate", "--study", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "moelab: MOELAB_AUTOTUNE='bogus' is no longer read; impl='auto' follows its rule; measure the kernels "
        "with moelab train --autotune or moelab.experts.autotune(model, example_input) (docs/kernels.md)"
    )
    assert err.count("MOELAB_AUTOTUNE") == 1 and len(err.splitlines()) == 2  # and the command's own refusal
