"""``moelab simulate``: error paths exit 2 with a message; a tiny study writes its run directory."""

from __future__ import annotations

import json

import pytest
import yaml

from moelab.cli import main
from moelab.stats.studies import study_config


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--study", "nope", "--out", "X"], "--study 'nope' is not a study"),
        (["--out", "X"], "--study is required"),
        (["--study", "misspecified"], "--out is required"),
        (["--study", "cosine-vs-perturbed", "--tau", "-1", "--out", "X"], "tau=-1.0 is not allowed"),
        (
            ["--study", "cosine-vs-perturbed", "--sample-sizes", "10,20", "--out", "X"],
            "below the number of parameters",
        ),
        (["--study", "cosine-vs-perturbed", "--extra-experts", "0", "--out", "X"], "extra_experts=0"),
        (["--study", "cosine-vs-perturbed", "--optimizer", "rmsprop", "--out", "X"], "optimizer='rmsprop'"),
        (["--study", "cosine-vs-perturbed", "--sample-sizes", "500", "--out", "X"], "expected >= 2 distinct"),
    ],
)
def test_bad_input_exits_2_with_message(argv, message, tmp_path, capsys):
    argv = [str(tmp_path / a) if a == "X" else a for a in argv]
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_setting_is_rejected():
    with pytest.raises(ValueError, match=r"unknown study settings \['depth'\]"):
        study_config("misspecified", depth=3)


@pytest.mark.parametrize(
    "study", [pytest.param("cosine-vs-perturbed", marks=pytest.mark.slow), "softmax-vs-competition"]
)
def test_tiny_study_writes_config_metrics_csv_and_plot(study, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["simulate", "--study", study, "--quick", "--replicates", "2", "--steps", "2",
            "--sample-sizes", "200,400", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["sample_sizes"] == [200, 400] and config["replicates"] == 2
    assert metrics["config"]["steps"] == 2
    for rate in metrics["rates"]:
        assert {"router", "setting", "slope", "ci_low", "ci_high"} <= set(rate)
        assert rate["ci_low"] <= rate["ci_high"]
    lines = (out / "losses.csv").read_text().splitlines()
    assert len(lines) == 1 + len(metrics["rates"]) * 2 * 2  # header + series × sizes × replicates
    header = lines[0].split(",")
    assert "loss" in header and "value" in header  # the loss's name and its value, apart
    assert {row.split(",")[header.index("loss")] for row in lines[1:]} <= {"expert", "voronoi"}
    assert (out / "rates.png").stat().st_size > 0
    assert main(argv) == 2  # a finished run is not overwritten
    assert "already holds a run" in capsys.readouterr().err
