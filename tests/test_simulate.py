"""``moelab simulate``: error paths exit 2 with a message naming the flag; a tiny study writes its run
directory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from moelab.cli import main
from moelab.experiments import runner


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--study", "nope", "--out", "X"],
         "--study='nope' is not allowed; expected one of ['cosine-vs-perturbed', 'misspecified', "
         "'linear-vs-perturbed', 'softmax-vs-competition', 'shared-experts', 'sigmoid-vs-softmax', "
         "'strong-vs-ridge', 'gaussian-vs-regression', 'attention-gating', 'replora', 'rate-grid', "
         "'competition-v1', 'competition-ffn']"),
        (["--out", "X"], "--study is required"),
        (["--study", "replora", "--optimizer", "sgd", "--out", "X"],
         "--optimizer='sgd' is not allowed for study 'replora': its fits are batched L-BFGS from near the truth"),
        (["--study", "misspecified"], "--out is required"),
        (["--study", "cosine-vs-perturbed", "--tau", "-1", "--out", "X"], "--tau=-1.0 is not allowed"),
        (
            ["--study", "cosine-vs-perturbed", "--sample-sizes", "10,20", "--out", "X"],
            "--sample-sizes=[10, 20]: the smallest n=10 is below the number of parameters",
        ),
        (["--study", "cosine-vs-perturbed", "--extra-experts", "0", "--out", "X"], "--extra-experts=0"),
        (["--study", "cosine-vs-perturbed", "--optimizer", "rmsprop", "--out", "X"],
         "--optimizer='rmsprop' is not allowed; expected one of"),
        (["--study", "cosine-vs-perturbed", "--sample-sizes", "500", "--out", "X"],
         "--sample-sizes=[500] is not allowed; expected >= 2 distinct"),
        (["--study", "misspecified", "--d", "0", "--out", "X"], "--d=0 is not allowed; expected a positive integer"),
        (["--study", "misspecified", "--k-true", "0", "--out", "X"], "--k-true=0 is not allowed"),
        (["--study", "misspecified", "--extra-experts", "0", "--out", "X"], "--extra-experts=0"),
        (["--study", "misspecified", "--noise-var", "-1", "--out", "X"],
         "--noise-var=-1.0 is not allowed; expected a number >= 0"),
        (["--study", "misspecified", "--tau", "-1", "--out", "X"], "--tau=-1.0 is not allowed"),
        (["--study", "misspecified", "--init", "zeros", "--out", "X"],
         "--init='zeros' is not allowed; expected one of ['near', 'random']"),
        (["--study", "misspecified", "--restarts", "0", "--out", "X"], "--restarts=0 is not allowed"),
        (["--study", "misspecified", "--max-iter", "0", "--out", "X"], "--steps=0 is not allowed"),
        (["--study", "misspecified", "--gtol", "-1", "--out", "X"], "--gtol=-1.0 is not allowed"),
        (["--study", "misspecified", "--ftol", "nan", "--out", "X"], "--ftol=nan is not allowed"),
        (["--study", "misspecified", "--beta1-bound", "0", "--out", "X"],
         "--beta1-bound=0.0 is not allowed; expected a number > 0 or one of [inf]"),
        (["--study", "cosine-vs-perturbed", "--beta1-bound", "0.5", "--out", "X"],
         "--beta1-bound=0.5 is not allowed for this truth: its largest ‖β₁ᵢ‖ is"),
        (["--study", "misspecified", "--n-boot", "0", "--out", "X"], "--n-boot=0 is not allowed"),
        (["--study", "softmax-vs-competition", "--nu-min", "-1", "--out", "X"],
         "--nu-min=-1.0 is not allowed; expected a number >= 0"),
        (["--study", "softmax-vs-competition", "--nu-min", "0.5", "--out", "X"],
         "--nu-min=0.5 is not allowed for this truth: its smallest ν is"),
        (["--study", "misspecified", "--reference-n", "0", "--out", "X"], "--reference-n=0 is not allowed"),
        (["--study", "misspecified", "--reference-steps", "-3", "--out", "X"],
         "--reference-steps=-3 is not allowed"),
        (["--study", "misspecified", "--eta-bound", "-2", "--out", "X"],
         "--eta-bound=-2.0 is not allowed; expected a number > 0 or one of [inf]"),
        (["--study", "misspecified", "--eta-bound", "0.5", "--out", "X"],
         "--eta-bound=0.5 is not allowed for this truth: its largest ‖ηᵢ‖ is"),
        (["--study", "misspecified", "--replicates", "0", "--out", "X"], "--replicates=0"),
        (["--study", "misspecified", "--replicates", "1", "--out", "X"],
         "--replicates=1 is not allowed; expected an integer in [2, 1000000000]"),
        (["--study", "misspecified", "--n-boot", "1", "--out", "X"],
         "--n-boot=1 is not allowed; expected an integer in [41, 1000000000]"),
        (["--study", "misspecified", "--n-boot", "40", "--out", "X"], "--n-boot=40 is not allowed"),
        (["--study", "misspecified", "--sample-sizes", "500,x", "--out", "X"],
         "argument --sample-sizes: '500,x' is not a comma-separated list of integers"),
        (["--study", "misspecified", "--d", "two", "--out", "X"], "argument --d: invalid int value: 'two'"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_message(argv, message, tmp_path, capsys):
    argv = [str(tmp_path / a) if a == "X" else a for a in argv]
    try:
        code = main(["simulate", *argv])
    except SystemExit as exc:  # argparse's own errors (a flag's type) exit from the parser
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1  # one line, no traceback


def test_every_model_and_fit_flag_reaches_the_study_config():
    import math

    from moelab.cli import build_parser
    from moelab.experiments import runner
    from moelab.experiments.simulate import SIMULATE, study_of

    argv = ["simulate", "--study", "cosine-vs-perturbed", "--d", "3", "--k-true", "3", "--extra-experts", "2",
            "--noise-var", "0.04", "--tau", "0.5", "--init", "random", "--restarts", "2", "--max-iter", "7",
            "--gtol", "1e-5", "--ftol", "1e-9", "--beta1-bound", "inf", "--eta-bound", "7", "--n-boot", "99",
            "--reference-n", "5000", "--reference-steps", "300", "--out", "X"]  # fmt: skip
    args = build_parser().parse_args(argv)
    cfg = study_of(runner.new_config(SIMULATE, runner.given_by_args(SIMULATE, args)))
    assert (cfg.d, cfg.k_true, cfg.extra_experts, cfg.noise_var, cfg.tau) == (3, 3, 2, 0.04, 0.5)
    assert (cfg.init, cfg.restarts, cfg.steps, cfg.gtol, cfg.ftol, cfg.n_boot) == (
        "random",
        2,
        7,
        1e-5,
        1e-9,
        99,
    )
    assert math.isinf(cfg.beta1_bound) and cfg.eta_bound == 7.0
    assert (cfg.reference_n, cfg.reference_steps) == (5000, 300)


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
    assert {"n_iter", "grad_norm", "converged", "hit_cap", "beta1_max_norm"} <= set(header)
    assert {row.split(",")[header.index("loss")] for row in lines[1:]} <= {"expert", "voronoi"}
    assert (out / "rates.png").stat().st_size > 0
    # the per-n table: printed and written
    printed = capsys.readouterr().out
    assert "95% CI of the mean" in printed and "slope(" in printed
    table = (out / "table.csv").read_text().splitlines()
    assert table[0].split(",")[:10] == ["router", "setting", "loss", "k", "n", "mean", "sd", "ci_low", "ci_high",
                                        "replicates"]  # fmt: skip
    assert len(table) == 1 + len(metrics["rates"]) * 2
    for row in metrics["table"]:
        assert row["ci_low"] <= row["mean"] <= row["ci_high"]
    # slope differences between the routers of each panel, and theory slopes on the rates
    assert metrics["differences"] and all(d["ci_low"] <= d["ci_high"] for d in metrics["differences"])
    # a stated rate beside the series it is stated for, blank beside the others
    assert all(r["theory"] for r in metrics["rates"] if r["router"].startswith(("perturbed", "competition")))
    assert not any(r["theory"] for r in metrics["rates"] if r["router"] in ("cosine", "softmax"))
    # every replicate's estimates, readable without pickle
    with np.load(out / "estimates.npz", allow_pickle=False) as z:
        assert z["sample_sizes"].tolist() == [200, 400]
        key = (
            "softmax__over-specified__a"
            if study == "softmax-vs-competition"
            else "perturbed__over-specified__beta1"
        )
        assert z[key].shape[:2] == (2, 2)  # (sizes, replicates, k, d)
        assert any(k.endswith("target_beta1") for k in z.files)
    assert main(argv) == 2  # a finished run is not overwritten
    assert "already holds a run" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0  # ... and --resume of it is the finished study
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert main([*argv, "--resume", "--seed", "1"]) == 2  # the lifecycle's one sentence
    sentence = runner.refuse_change("--seed", 1, 0, out / "config.yaml").args[0]
    assert capsys.readouterr().err.endswith(sentence + "\n")


def test_a_replicate_where_no_step_is_accepted_is_not_converged_and_the_table_says_why(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["simulate", "--study", "softmax-vs-competition", "--quick", "--replicates", "2", "--steps", "3",
            "--sample-sizes", "200,400", "--lr", "1e308", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert all(row["converged"] == 0.0 for row in metrics["table"])
    assert all("2/2" in row["why_not"] for row in metrics["table"])
    lines = (out / "losses.csv").read_text().splitlines()
    header = lines[0].split(",")
    for row in lines[1:]:
        cells = dict(zip(header, row.split(",")))
        assert float(cells["converged"]) == 0.0 and cells["stop_reason"] in (
            "no step accepted",
            "loss not finite",
        )
    printed = capsys.readouterr().out
    assert "no step accepted" in printed
    # no slope of unfitted estimates is printed, nor set against a stated rate
    assert printed.count("slope not measured: 0% of replicates converged, below 90% (") == len(
        metrics["rates"]
    )
    assert all(r["converged"] == 0.0 and r["not_measured"] for r in metrics["rates"])
    assert all(t["verdict"] == "not measured" for r in metrics["rates"] for t in r["theory"])


@pytest.mark.parametrize(
    "study, flag, value",
    [("cosine-vs-perturbed", "--replicates", "999000000"), ("cosine-vs-perturbed", "--restarts", "999000000"),
     ("misspecified", "--reference-n", "1000000000000000000")],
)  # fmt: skip
def test_sizes_beyond_the_machines_memory_are_refused_before_anything_runs(
    tmp_path, capsys, study, flag, value
):
    out = tmp_path / "sim"
    args = ["simulate", "--study", study, "--quick", flag, value, "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{flag}={value} is not allowed here: the batched fits would need at least" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
