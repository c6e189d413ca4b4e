"""The expert-specialization lab (Krishnamurthy et al. (2023)): L_s (eq. 8–10), the specialize command's error paths, a tiny digits run, sweep selection."""

import json

import numpy as np
import pytest
import torch
import yaml

import moelab
from moelab import cli
from moelab.experiments import specialization as spec
from moelab.losses import importance_loss, sample_similarity_loss
from moelab.models.vision import ImageMoE


def literal_ls(p, x, beta_s, beta_d):
    n, m = p.shape
    total = 0.0
    for i in range(n):
        for j in range(n):
            d = float(((x[i] - x[j]) ** 2).sum())
            s = sum(beta_s * p[i, e] * p[j, e] * d for e in range(m)) / m
            dd = sum(beta_d * p[i, e] * p[j, f] * d for e in range(m) for f in range(m) if e != f) / (
                m * m - m
            )
            total += float(s - dd)
    return total / (n * n - n)


def test_ls_matches_the_papers_double_sum():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(5, 3, generator=g, dtype=torch.float64).softmax(-1)
    x = torch.randn(5, 2, 2, generator=g, dtype=torch.float64)
    got = sample_similarity_loss(p, x, 1e-2, 3e-2)
    assert float(got) == pytest.approx(literal_ls(p, x.reshape(5, -1), 1e-2, 3e-2), rel=1e-10)


def test_ls_is_lower_when_similar_samples_share_an_expert():
    # two tight clusters far apart; (a) each cluster on its own expert, (b) clusters mixed over experts
    x = torch.cat(
        [
            torch.zeros(4, 3) + 0.01 * torch.arange(4)[:, None],
            10 + 0.01 * torch.arange(4)[:, None].repeat(1, 3),
        ]
    )
    by_cluster = torch.tensor([[0.9, 0.1]] * 4 + [[0.1, 0.9]] * 4)
    mixed = torch.tensor([[0.9, 0.1], [0.1, 0.9]] * 4)
    assert sample_similarity_loss(by_cluster, x, 1e-3, 1e-3) < sample_similarity_loss(mixed, x, 1e-3, 1e-3)
    # each term separately: S favours shared experts for near pairs, D rewards far pairs split
    assert sample_similarity_loss(by_cluster, x, 1.0, 0.0) < sample_similarity_loss(mixed, x, 1.0, 0.0)
    assert sample_similarity_loss(by_cluster, x, 0.0, 1.0) < sample_similarity_loss(mixed, x, 0.0, 1.0)


def test_ls_needs_two_samples_and_two_experts():
    with pytest.raises(ValueError, match="expected N >= 2 samples and M >= 2 experts"):
        sample_similarity_loss(torch.ones(1, 3) / 3, torch.zeros(1, 4), 1.0, 1.0)


def test_importance_loss_is_the_coefficient_of_variation_of_eq_7():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]], dtype=torch.float64)
    imp = np.array([1.2, 0.5, 0.3])
    assert float(importance_loss(p)) == pytest.approx(imp.std() / imp.mean())


def main(argv, capsys):
    """``moelab specialize argv``: the exit code and stderr (argparse's own refusals included)."""
    try:
        code = cli.main(["specialize", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experts", "1"], "--experts=1 is not allowed; expected an integer >= 2"),
        (
            ["--distill"],
            "--distill is not allowed with --gate original; distillation starts from an attentive gate",
        ),
        (["--top-k", "7"], "--top-k=7 is not allowed; expected an integer in [1, 5]"),
        (["--mode", "scaling", "--counts", "5,x"], "argument --counts: '5,x' is not a comma-separated list"),
        (["--mode", "scaling", "--counts", "5,1"], "--counts='5,1' is not allowed; expected integers >= 2"),
        (["--data", "mnist", "--data-dir", "NOPE"], "--data-dir NOPE is not a folder"),
        (
            ["--data", "svhn"],
            "--data='svhn' is not allowed; expected one of ['digits', 'mnist', 'fmnist', 'fmnist+mnist', "
            "'cifar100']",
        ),
        (["--gate", "moe"], "--gate='moe' is not allowed; expected one of ['original', 'attentive']"),
        (["--reg", "l2"], "--reg='l2' is not allowed; expected one of ['none', 'importance', 'ls']"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path):
    argv = [a if a != "NOPE" else str(tmp_path / "nope") for a in argv]
    message = message.replace("NOPE", str(tmp_path / "nope"))
    code, err = main([*argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--train-samples", "0"], "--train-samples=0 is not allowed; expected a positive integer"),
        (["--test-samples", "-5"], "--test-samples=-5 is not allowed; expected a positive integer"),
        (["--lr", "inf"], "--lr=inf is not allowed; expected a number > 0"),
        (["--lr", "nan"], "--lr=nan is not allowed; expected a number > 0"),
        (["--lr", "0"], "--lr=0.0 is not allowed; expected a number > 0"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--epochs", "inf"], "argument --epochs: invalid int value: 'inf'"),
        (["--epochs", "0"], "--epochs=0 is not allowed; expected an integer in [1, 1000000000]"),
        (["--epochs", "2.5"], "argument --epochs: invalid int value: '2.5'"),
        (["--batch-size", "-1"], "--batch-size=-1 is not allowed; expected a positive integer"),
        (["--runs", "0"], "--runs=0 is not allowed; expected an integer in [1, 1000000000]"),
        (["--threads", "0"], "--threads=0 is not allowed; expected a positive integer"),
        (["--top-k", "0"], "--top-k=0 is not allowed; expected a positive integer"),
        (["--seed", "-1"], "--seed=-1 is not allowed; expected an integer in [0, 9223372036854775807]"),
        (["--experts", "2.5"], "argument --experts: invalid int value: '2.5'"),
        (
            ["--w-importance", "-1"],
            "--w-importance=-1.0 is not allowed; expected a number in [0, 3.40282e+38]",
        ),
        (["--beta-s", "nan"], "--beta-s=nan is not allowed; expected a number in [0, 3.40282e+38]"),
        (["--beta-d", "inf"], "--beta-d=inf is not allowed; expected a number in [0, 3.40282e+38]"),
    ],
)
def test_bad_numbers_exit_2_naming_the_flag_and_the_allowed_range(argv, message, capsys, tmp_path):
    code, err = main([*argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--train-samples", "5000"],
            "--train-samples=5000 is not allowed; expected an integer in [1, 1437] (the size of the digits "
            "train set)",
        ),
        (
            ["--test-samples", "361"],
            "--test-samples=361 is not allowed; expected an integer in [1, 360] (the size of the digits test set)",
        ),
    ],
)
def test_subsets_larger_than_the_set_are_refused_before_a_run_is_written(argv, message, capsys, tmp_path):
    code, err = main([*argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "o" / "config.yaml").exists()


def test_counts_equal_to_the_split_sizes_are_the_whole_sets(tmp_path, capsys):
    code, _ = main(
        ["--epochs", "1", "--train-samples", "1437", "--test-samples", "360", "--out", str(tmp_path / "o")],
        capsys,
    )
    recorded = yaml.safe_load((tmp_path / "o" / "config.yaml").read_text())["recorded"]
    assert code == 0 and recorded["train_size"] == 1437 and recorded["test_size"] == 360


def test_truncated_idx_folder_exits_2_naming_the_file(tmp_path, capsys):
    folder = tmp_path / "mnist"
    folder.mkdir()
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (folder / stem).write_bytes(bytes([0, 0, 8, 1]) + (100).to_bytes(4, "big") + b"\0" * 10)
    code, err = main(["--data", "mnist", "--data-dir", str(folder), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "train-images-idx3-ubyte is truncated" in err and err.count("\n") == 1


def test_tiny_digits_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "--data",
        "digits",
        "--gate",
        "attentive",
        "--reg",
        "ls",
        "--distill",
        "--epochs",
        "2",
        "--train-samples",
        "256",
        "--test-samples",
        "100",
        "--out",
        str(out),
    ]
    code, _ = main(argv, capsys)
    assert code == 0
    m = json.loads((out / "metrics.json").read_text())
    for key in (
        "test_error",
        "train_error",
        "H_s",
        "H_u",
        "I_EY",
        "seed",
        "test_error_top1",
        "teacher_test_error",
    ):
        assert key in m
    assert 0 <= m["test_error"] <= 1 and 0 <= m["H_s"] <= np.log2(5) + 1e-9 and m["seed"] == 0
    assert (out / "model_selection.png").stat().st_size > 0 and (out / "config.yaml").exists()
    assert (out / "model_teacher_selection.png").stat().st_size > 0
    teacher = out / "fits" / "attentive-ls-bs0.0001-bd0.001-e5-s0"
    for fit in (teacher, teacher.with_name(teacher.name + "-distilled")):
        log = (fit / "log.csv").read_text().splitlines()
        assert len(log) == 1 + 2 * 4  # header, 2 epochs of 4 steps (256 samples, batch 64)
        errors = [row.split(",")[-1] for row in log[1:]]  # the test error after every epoch
        assert [bool(e) for e in errors] == [False, False, False, True] * 2
    code, err = main(argv, capsys)  # a finished run is not overwritten
    assert code == 2 and "already holds a run" in err


def test_every_trained_model_opens_with_moelab_load(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--gate", "attentive", *TINY, "--out", str(out)], capsys)[0] == 0
    fit = out / "fits" / "attentive-none-e5-s0"
    x = torch.randn(3, 1, 8, 8)
    for path in (fit, fit / "ckpt" / "step-00000002", out / "model"):
        model = moelab.load(path)
        assert isinstance(model, ImageMoE)
    saved = moelab.load(out / "model")
    torch.testing.assert_close(moelab.load(fit)(x).probs, saved(x).probs, rtol=0, atol=0)
    m = json.loads((out / "metrics.json").read_text())
    assert json.loads((fit / "metrics.json").read_text())["test_error"] == m["test_error"]


def test_single_model_baseline_reports_no_gate_metrics(tmp_path, capsys):
    code, _ = main(
        [
            "--mode",
            "single",
            "--epochs",
            "1",
            "--train-samples",
            "128",
            "--test-samples",
            "64",
            "--out",
            str(tmp_path / "s"),
        ],
        capsys,
    )
    m = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert code == 0 and m["I_EY"] is None and m["H_s"] is None and 0 <= m["test_error"] <= 1


def test_sweep_covers_the_appendix_c_grid_and_selects_the_minimum_training_error(monkeypatch):
    seen = []

    def fake_train_once(lab, cfg):
        seen.append((cfg.beta_s, cfg.beta_d, cfg.seed))
        train_error = abs(cfg.beta_d - 1e-3) + cfg.seed * 1e-6  # minimum at beta_d = 1e-3, seed 0
        metrics = {"train_error": train_error, "test_error": 0.1 + cfg.seed / 100, "seed": cfg.seed}
        return spec.Trained(None, metrics, None)

    monkeypatch.setattr(spec, "train_once", fake_train_once)
    summary = spec.sweep(None, spec.SpecConfig(data="mnist", reg="ls", runs=3)).metrics
    assert len(seen) == 2 * 6 * 3  # β_s ∈ {1e-6, 1e-5} × β_d ∈ {1e-1..1e-6} × 3 seeds (Table 6)
    assert summary["selected"]["beta_d"] == pytest.approx(1e-3) and summary["selected"]["seed"] == 0
    assert summary["test_error_std"] == pytest.approx(float(np.std([0.10, 0.11, 0.12], ddof=1)))
    assert summary["num_runs"] == 36


TINY = ["--epochs", "1", "--train-samples", "128", "--test-samples", "64"]


@pytest.mark.slow
def test_table_mode_writes_all_nine_rows_of_table_2(tmp_path, capsys):
    code, _ = main(["--mode", "table", *TINY, "--out", str(tmp_path / "t")], capsys)
    m = json.loads((tmp_path / "t" / "metrics.json").read_text())
    assert code == 0 and sorted(m["rows"]) == sorted(name for name, _ in spec.TABLE_ROWS)
    assert len((tmp_path / "t" / "table.md").read_text().splitlines()) == 2 + 9


@pytest.mark.slow
def test_partition_and_scaling_modes_run(tmp_path, capsys):
    code, _ = main(["--mode", "partition", *TINY, "--out", str(tmp_path / "p")], capsys)
    m = json.loads((tmp_path / "p" / "metrics.json").read_text())
    assert code == 0 and set(m["partition"]) == {"a", "b"} and m["pairs"][0] == [0, 7]
    assert (tmp_path / "p" / "partition_b_gate.png").exists()
    code, _ = main(["--mode", "scaling", "--counts", "5,6", *TINY, "--out", str(tmp_path / "s")], capsys)
    m = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert code == 0 and set(m["scaling"]) == {"importance_5", "importance_6", "ls_5", "ls_6"}


def test_the_sd_over_one_seed_is_undefined_not_zero(monkeypatch):
    metrics = {"train_error": 0.2, "test_error": 0.1, "H_s": 0.5}
    monkeypatch.setattr(spec, "train_once", lambda lab, cfg: spec.Trained(None, dict(metrics), None))
    summary = spec.sweep(None, spec.SpecConfig(data="mnist"), use_grid=False).metrics
    assert summary["test_error_std"] is None and summary["over_seeds"]["test_error"]["sd"] is None
    row = spec.format_table({"vanilla MoE": summary}).splitlines()[2]
    assert row.startswith("| vanilla MoE | 1 | 0.100 | NA | NA | NA | 0.500 |") and "nan" not in row


def test_every_default_beta_is_a_point_of_the_appendix_c_grid():
    for data, (beta_s, beta_d) in spec.BETA_DEFAULTS.items():
        assert beta_s in spec.GRIDS[data]["beta_s"] and any(
            beta_d == pytest.approx(g) for g in spec.GRIDS[data]["beta_d"]
        )
    # 1e-4, the middle of the Fashion-MNIST grid, left training unchanged; 1e-2 had the lowest train error
    assert spec.resolve(spec.SpecConfig(data="fmnist")).beta_d == pytest.approx(1e-2)


def test_help_shows_the_per_dataset_beta_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["specialize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fmnist 1e-06" in text and "fmnist 0.01" in text and "--rows" in text


def test_resolved_config_records_the_expert_count():
    assert spec.resolve(spec.SpecConfig(data="fmnist")).experts == 5
    assert spec.resolve(spec.SpecConfig(data="fmnist", experts=7)).experts == 7


def test_distilled_titles_name_the_teacher_and_the_student_separately():
    model, teacher = spec.titles(spec.SpecConfig(gate="attentive", reg="ls", distill=True))
    assert model == "digits: distilled from attentive gate MoE with L_s"
    assert teacher == "digits: attentive gate MoE with L_s (teacher)"
    assert spec.titles(spec.SpecConfig(gate="original", reg="importance")) == (
        "digits: vanilla MoE with L_importance",
        "",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "table", "--rows", "0,2"], "--rows='0,2' is not allowed"),
        (["--mode", "table", "--rows", "2,2"], "--rows='2,2' is not allowed"),
        (["--mode", "table", "--rows", "a"], "argument --rows: 'a' is not a comma-separated list"),
        (["--rows", "2"], "--rows is not allowed with --mode run"),
    ],
)
def test_bad_rows_exit_2_with_one_line(argv, message, capsys, tmp_path):
    code, err = main([*argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_table_rows_over_seeds_report_summaries_welch_tests_and_teacher_tables(tmp_path, capsys, monkeypatch):
    plots = {}
    monkeypatch.setattr(
        spec, "plot_selection_table", lambda t, path, names, title: plots.update({path.name: title})
    )
    out = tmp_path / "t"
    code, _ = main(["--mode", "table", "--rows", "2,8", "--runs", "2", *TINY, "--out", str(out)], capsys)
    assert code == 0
    m = json.loads((out / "metrics.json").read_text())
    vanilla, distilled = (
        m["rows"]["vanilla MoE"],
        m["rows"]["distilled from attentive gate MoE with L_importance"],
    )
    assert sorted(m["rows"]) == ["distilled from attentive gate MoE with L_importance", "vanilla MoE"]
    for key in spec.SUMMARY_METRICS:
        s = vanilla["over_seeds"][key]
        assert s["n"] == 2 and s["ci_low"] <= s["mean"] <= s["ci_high"]
        assert s["mean"] == pytest.approx(np.mean(vanilla["seeds"][key]))
    assert {(t["metric"]) for t in m["welch"]} == set(spec.SUMMARY_METRICS)
    assert "I_EY_pred" in distilled and "teacher_I_EY" in distilled
    assert len((out / "table.md").read_text().splitlines()) == 2 + 2
    assert len((out / "welch.md").read_text().splitlines()) == 2 + len(spec.SUMMARY_METRICS)
    assert plots == {
        "row2_selection.png": "vanilla MoE",
        "row8_selection.png": "distilled from attentive gate MoE with L_importance",
        "row8_teacher_selection.png": "digits: attentive gate MoE with L_importance (teacher)",
    }
    teacher = ["attentive-importance-w0.2-e5-s0", "attentive-importance-w0.2-e5-s1"]
    vanilla = ["original-none-e5-s0", "original-none-e5-s1"]
    fits = sorted(p.name for p in (out / "fits").iterdir())  # each trained model is a run of its own
    assert fits == sorted([*teacher, *(f"{t}-distilled" for t in teacher), *vanilla])
    runs = (out / "runs.csv").read_text().splitlines()
    assert runs[0].split(",")[:2] == ["row", "gate"] and len(runs) == 1 + 2 + 2
    config = (out / "config.yaml").read_text()
    assert "experts: 5" in config and "rows:\n- 2\n- 8" in config


def test_no_progress_hides_the_bars_and_a_resume_may_change_it(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["specialize", "--epochs", "1", "--train-samples", "64", "--test-samples", "32", "--out", str(out)]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert "it/s" not in capsys.readouterr().err
    assert cli.main([*argv, "--resume"]) == 0  # how a run shows itself is not one of its inputs


@pytest.mark.parametrize("flag", ["--w-importance", "--beta-s", "--beta-d"])
def test_a_loss_weight_float32_cannot_hold_is_refused_up_front(flag, tmp_path, capsys):
    from moelab.cli import main

    out = tmp_path / "run"
    assert main(["specialize", "--reg", "ls" if "beta" in flag else "importance", flag, "1e308",
                 "--out", str(out)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert (
        err
        == f"moelab specialize: error: {flag}=1e+308 is not allowed; expected a number in [0, 3.40282e+38]\n"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, flag, value",
    [(["--experts", "4096000000"], "--experts", "4096000000"),
     (["--mode", "scaling", "--counts", "2,4096000000"], "--counts", "(2, 4096000000)")],
)  # fmt: skip
def test_more_experts_than_memory_holds_are_refused_naming_the_flag(extra, flag, value, tmp_path, capsys):
    from moelab.cli import main

    out = tmp_path / "run"
    assert main(["specialize", *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"moelab specialize: error: {flag}={value} is not allowed here: the model and its training"
    )
    assert err.endswith(f"expected a smaller {flag}\n") and not out.exists()
