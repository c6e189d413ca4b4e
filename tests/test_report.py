"""`moelab report`: grouping, mean ± std, best mark, sweep tables, files, errors."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from moelab.cli import main
from moelab.experiments.report import collect_runs, group_runs, render


def fake_run(path, method, seed, test, opts=None, arch="switch", curve=((10, 2.0), (20, 1.5))):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        yaml.safe_dump({"task": "lm", "method": method, "arch": arch, "opts": opts or {}, "metric": "bpc"})
    )
    (path / "metrics.json").write_text(
        json.dumps(
            {
                "method": method,
                "seed": seed,
                "test_bpc": test,
                "val_bpc": test + 0.01,
                "params": 1000,
                "active_params": 400,
                "tokens_per_s": 50.0,
            }
        )
    )
    with open(path / "log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "val_loss", "val_bpc"])
        for step, v in curve:
            w.writerow([step, 1.0, "", v])
        w.writerow([step + 1, 1.0, "", ""])


def test_groups_by_method_with_mean_std_and_best(tmp_path):
    for i, v in enumerate([1.30, 1.32, 1.31]):
        fake_run(tmp_path / "smoe" / f"s{i}", "smoe", i, v)
    for i, v in enumerate([1.20, 1.22, 1.24]):
        fake_run(tmp_path / "competesmoe" / f"s{i}", "competesmoe", i, v)
    groups = group_runs(collect_runs([tmp_path]))
    assert [g.label for g in groups] == ["competesmoe", "smoe"]
    g = groups[1]
    assert g.mean == pytest.approx(1.31) and g.std == pytest.approx(0.01)
    text, rows = render(groups, "competesmoe")
    assert rows[0]["best"] and not rows[1]["best"]
    assert rows[0]["p_value"] is None and 0 < rows[1]["p_value"] < 0.05
    assert "1.2200 ± 0.0200 *" in text and "p vs competesmoe" in text


def test_one_run_and_no_spread_print_a_dash_never_nan(tmp_path, capsys):
    for i, v in enumerate([1.30, 1.32]):
        fake_run(tmp_path / "runs" / f"c{i}", "competesmoe", i, v)
        (tmp_path / "runs" / f"c{i}" / "diagnostics.json").write_text(json.dumps({"load_cv_mean": 0.5}))
    fake_run(tmp_path / "runs" / "s0", "smoe", 0, 1.25)
    (tmp_path / "runs" / "s0" / "diagnostics.json").write_text(json.dumps({"load_cv_mean": 0.4}))
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out
    smoe = next(line for line in out.splitlines() if line.startswith("smoe "))
    assert "1.2500 ± — *" in smoe and smoe.split()[-3] == "—"  # no sd of one run, no p-value
    assert "0.4000 ± — (n=1)  p=—" in out and "0.5000 ± 0.0000 (n=2)  reference" in out
    # a diagnostic no run has gets no empty heading: it is named once, with why
    assert "\n  expert_change_rate\n" not in out
    assert "not in any run: " in out
    assert "expert_change_rate (not in diagnostics.json: run moelab diagnose again)" in out
    assert "max_vio_mean, jain_mean," in out  # the missing keys named once, together
    with open(tmp_path / "rep" / "results.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["group"] == "smoe")
    assert row["test_bpc_std"] == "" and row["p_value"] == ""


def test_sweep_gives_the_sensitivity_table(tmp_path):
    for arch in ("switch", "glam"):
        for omega, v in [(0.01, 1.7), (0.05, 1.3), (0.09, 1.31)]:
            bump = 0.1 if arch == "switch" else 0.0
            fake_run(tmp_path / f"{arch}-{omega}", "competesmoe", 0, v + bump, {"omega": omega}, arch)
    groups = group_runs(collect_runs([tmp_path]))
    assert len(groups) == 6 and {g.settings["omega"] for g in groups} == {0.01, 0.05, 0.09}
    text, _ = render(groups, None)
    table = text.split("test bpc by omega")[1].splitlines()
    assert table[1].split()[-3:] == ["0.01", "0.05", "0.09"]
    assert table[2].split() == ["glam", "1.7000", "1.3000", "1.3100"]
    assert table[3].split() == ["switch", "1.8000", "1.4000", "1.4100"]


def test_a_top_k_sweep_of_several_methods_gives_a_row_per_method_and_the_plot(tmp_path):
    # CompeteSMoE (2024) Fig. 3: test BPC against the number of activated experts K, per method
    numbers = {("smoe", 1): 1.5, ("smoe", 2): 1.4, ("smoe", 4): 1.45, ("competesmoe", 1): 1.45}
    for (method, k), v in numbers.items():
        for seed, noise in enumerate((0.0, 0.02)):
            fake_run(tmp_path / "runs" / f"{method}-{k}-{seed}", method, seed, v + noise, {"top_k": k})
    groups = group_runs(collect_runs([tmp_path / "runs"]))
    text, _ = render(groups, None)
    table = text.split("test bpc by top_k")[1].splitlines()
    assert table[1].split()[-3:] == ["1", "2", "4"]  # numeric order
    rows = {line.split()[0]: line.split()[1:] for line in table[2:]}
    assert rows == {"smoe": ["1.5100", "1.4100", "1.4600"], "competesmoe": ["1.4600", "—", "—"]}
    from moelab.experiments.report import plot_sensitivity

    assert plot_sensitivity(groups, tmp_path / "k.png") == tmp_path / "k.png"
    assert (tmp_path / "k.png").stat().st_size > 0
    text_groups = group_runs(collect_runs([tmp_path / "runs"]))
    for g in text_groups:
        g.settings["top_k"] = "a" if g.settings["top_k"] == 1 else "b"
    assert plot_sensitivity(text_groups, tmp_path / "none.png") is None  # nothing numeric to draw


def test_report_cli_writes_files_and_rejects_bad_paths(tmp_path, capsys):
    for i, v in enumerate([1.30, 1.32]):
        fake_run(tmp_path / "runs" / f"s{i}", "smoe", i, v)
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "reference 'competesmoe' has no runs here" in out and "1.3100 ± 0.0141 *" in out
    for name in ("results.csv", "runs.csv", "val_curves.png", "table.txt"):
        assert (tmp_path / "rep" / name).exists()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_per_step_validation_table_is_mean_and_sd_over_seeds(tmp_path):
    curves = [((10, 2.0), (20, 1.5)), ((10, 2.2), (20, 1.7)), ((10, 2.4), (20, 1.6))]
    for i, curve in enumerate(curves):
        fake_run(tmp_path / "runs" / f"s{i}", "smoe", i, 1.3, curve=curve)
    fake_run(tmp_path / "runs" / "c0", "competesmoe", 0, 1.2, curve=((10, 1.9), (20, 1.4)))
    from moelab.experiments.report import curve_stats, curve_table

    groups = group_runs(collect_runs([tmp_path / "runs"]))
    smoe = next(g for g in groups if g.method == "smoe")
    steps, mean, sd, n = curve_stats(smoe)
    assert steps == [10, 20] and n == 3
    assert mean == pytest.approx([2.2, 1.6]) and sd == pytest.approx([0.2, 0.1])
    text, rows = curve_table(groups)
    assert "2.2000 ± 0.2000" in text and "1.9000" in text and "± nan" not in text
    assert {(r["group"], r["step"]) for r in rows} == {
        (g, s) for g in ("smoe", "competesmoe") for s in (10, 20)
    }
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    with open(tmp_path / "rep" / "val_curves.csv", newline="") as f:
        written = list(csv.DictReader(f))
    assert float(next(r for r in written if r["group"] == "smoe" and r["step"] == "20")["val_bpc_sd"]) == (
        pytest.approx(0.1)
    )
    assert "validation bpc by step" in (tmp_path / "rep" / "table.txt").read_text()


def diagnosed(path, method, seed, test, jain, saturation, change, tokens=16384):
    fake_run(path, method, seed, test)
    d = {
        "tokens_used": tokens,
        "jain_mean": jain,
        "expert_change_rate": change[-1],
        "curve_steps": [2, 4, 6],
        "saturation_mean": saturation,
        "change_rate_mean": [None, *change],
        "jain_curve_mean": [jain - 0.1, jain - 0.05, jain],
        "jain": [jain - 0.05, jain + 0.05],
        "saturation": [[s - 0.1, s + 0.1] for s in saturation],
    }
    (path / "diagnostics.json").write_text(json.dumps(d))


def test_report_tabulates_the_new_diagnostics_and_draws_their_curves_with_seed_bands(tmp_path, capsys):
    diagnosed(tmp_path / "r" / "a0", "smoe", 0, 1.3, 0.9, [0.5, 0.8, 1.0], [0.2, 0.1])
    diagnosed(tmp_path / "r" / "a1", "smoe", 1, 1.31, 0.8, [0.7, 0.9, 1.0], [0.3, 0.2])
    diagnosed(tmp_path / "r" / "b0", "xmoe", 0, 1.2, 0.6, [0.6, 0.6, 1.0], [0.4, 0.3])
    assert main(["report", str(tmp_path / "r"), "--reference", "smoe", "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "routing diagnostics (moelab diagnose, on the first 16384 test tokens)" in out
    assert "  jain_mean\n" in out and "0.8500 ± 0.0707 (n=2)  reference" in out and "nan" not in out
    assert "routing curves over training (on the first 16384 test tokens): diagnostics_curves.png" in out
    assert "saturation_area (not in diagnostics.json: run moelab diagnose again)" in out
    assert (tmp_path / "rep" / "diagnostics_curves.png").read_bytes().startswith(b"\x89PNG")
    with open(tmp_path / "rep" / "diagnostics_curves.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sat = {
        int(r["step"]): r
        for r in rows
        if r["curve"] == "saturation_mean" and r["layer"] == "mean" and r["group"] == "smoe"
    }
    assert float(sat[2]["mean"]) == pytest.approx(0.6) and float(sat[2]["sd"]) == pytest.approx(
        0.1414, abs=1e-4
    )
    assert sat[2]["n"] == "2"
    change = [r for r in rows if r["curve"] == "change_rate_mean" and r["group"] == "xmoe"]
    assert [int(r["step"]) for r in change] == [4, 6] and change[0]["sd"] == ""  # one run: no sd
    # per layer: Jain against the layer (CompeteSMoE (2025) Figs. 9-10 form) and the curves per layer
    with open(tmp_path / "rep" / "diagnostics_layers.csv", newline="") as f:
        layers = [r for r in csv.DictReader(f) if r["diagnostic"] == "jain" and r["group"] == "smoe"]
    assert [(r["layer"], r["n"]) for r in layers] == [("0", "2"), ("1", "2")]
    assert float(layers[1]["mean"]) == pytest.approx(0.9) and float(layers[1]["sd"]) == pytest.approx(
        0.0707, abs=1e-4
    )
    for name in ("diagnostics_layers.png", "diagnostics_curves_layers.png"):
        assert (tmp_path / "rep" / name).read_bytes().startswith(b"\x89PNG")
    assert "per layer: diagnostics_curves_layers.png" in out and "diagnostics_layers.csv" in out
    layer1 = {
        int(r["step"]): r
        for r in rows
        if r["curve"] == "saturation" and r["layer"] == "1" and r["group"] == "smoe"
    }
    assert float(layer1[4]["mean"]) == pytest.approx(0.95) and float(layer1[4]["sd"]) == pytest.approx(
        0.0707, abs=1e-4
    )


def test_report_names_a_damaged_diagnostics_file(tmp_path, capsys):
    fake_run(tmp_path / "r" / "a0", "smoe", 0, 1.3)
    (tmp_path / "r" / "a0" / "diagnostics.json").write_text("{not json")
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert "diagnostics.json cannot be read (" in err and "run moelab diagnose" in err
    assert len(err.splitlines()) == 1


def test_runs_of_other_budgets_or_data_are_never_pooled_into_one_row(tmp_path):
    from moelab.experiments.report import Run

    def run(seed, **config):
        base = {"command": "train", "method": "smoe", "seed": seed, "steps": 500, "size": "mini", "opts": {},
                "keep_ckpts": "all", "recorded": {"data_sha256": "a" * 64}}  # fmt: skip
        return Run(tmp_path / f"r{seed}", {**base, **config}, {"method": "smoe", "test_bpc": 3.0})

    same = group_runs([run(0), run(1, keep_ckpts=2, threads=2)])  # neither changes what a run measures
    assert [g.label for g in same] == ["smoe"] and len(same[0].runs) == 2
    split = group_runs([run(0), run(1), run(2, steps=30), run(3, recorded={"data_sha256": "b" * 64})])
    assert [(g.label, len(g.runs)) for g in split] == [
        ("smoe data_sha256=aaaaaaaaaaaa steps=500", 2),
        ("smoe data_sha256=aaaaaaaaaaaa steps=30", 1),
        ("smoe data_sha256=bbbbbbbbbbbb steps=500", 1),
    ]


@pytest.mark.parametrize(
    "damage, why",
    [(b"a: [1,\n", "is not valid YAML: while parsing a flow node"),
     (b"\x00\xff\xfe", "is not UTF-8 text (a damaged or binary file)"),
     (b"- 1\n", "must hold a mapping of run settings, got list")],
)  # fmt: skip
def test_report_names_a_damaged_config_yaml_in_one_line(tmp_path, capsys, damage, why):
    run = tmp_path / "r" / "a0"
    fake_run(run, "smoe", 0, 1.3)
    (run / "config.yaml").write_bytes(damage)
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err == f"moelab report: error: run {run} cannot be read: {str(run / 'config.yaml')!r} {why}\n"


def test_steps_to_reach_the_reference_final_validation_is_the_first_step_of_the_mean_curve_at_or_below_it(
    tmp_path,
):
    """Ho (2025)'s measure: the share of the reference's steps a method needs to reach the
    reference's final validation value (mean curves over seeds)."""
    from moelab.experiments.report import steps_to_reach

    for seed, curve in enumerate([((10, 2.0), (20, 1.6), (40, 1.4)), ((10, 2.2), (20, 1.8), (40, 1.2))]):
        fake_run(tmp_path / "smoe" / f"s{seed}", "smoe", seed, 1.3, curve=curve)  # final mean 1.3
    for seed, curve in enumerate([((10, 1.5), (20, 1.25), (40, 1.1)), ((10, 1.7), (20, 1.3), (40, 1.0))]):
        fake_run(tmp_path / "sharede-v3" / f"s{seed}", "sharede-v3", seed, 1.1, curve=curve)
    for seed in range(2):
        fake_run(tmp_path / "xmoe" / f"s{seed}", "xmoe", seed, 1.5, curve=((10, 2.0), (20, 1.8), (40, 1.5)))
    groups = group_runs(collect_runs([tmp_path]))
    by = {g.label: g for g in groups}
    assert steps_to_reach(by["sharede-v3"], by["smoe"]) == pytest.approx(
        20 / 40
    )  # mean 1.275 ≤ 1.3 first at step 20
    assert steps_to_reach(by["xmoe"], by["smoe"]) == float("inf")
    assert steps_to_reach(by["smoe"], by["smoe"]) == 1.0
    text, rows = render(groups, "smoe")
    assert "steps to reach smoe's final validation bpc (1.3000 at step 40)" in text
    assert (
        "sharede-v3                   50% (step 20)" in text
        and "xmoe                         not reached in 40 steps" in text
    )
    assert {r["group"]: r["steps_to_reference"] for r in rows} == {
        "sharede-v3": 0.5,
        "smoe": None,
        "xmoe": float("inf"),
    }


def test_fine_tuning_runs_show_the_share_of_parameters_they_trained(tmp_path):
    """RepLoRA's table puts "#Params (%)" beside the accuracy: the report gives the share of the
    model's parameters each fine-tuning trained (trainable_params over params)."""
    for method, trained in (("lora", 20), ("replora", 35)):
        for seed in range(2):
            path = tmp_path / method / f"s{seed}"
            fake_run(path, method, seed, 0.5)
            config = yaml.safe_load((path / "config.yaml").read_text())
            config["recorded"] = {"trainable_params": trained}
            (path / "config.yaml").write_text(yaml.safe_dump(config))
    fake_run(tmp_path / "plain" / "s0", "smoe", 0, 0.5)  # a run that records none
    text, rows = render(group_runs(collect_runs([tmp_path])), None)
    shares = {r["group"]: r["trained_share"] for r in rows}
    assert shares == {"lora": pytest.approx(0.02), "replora": pytest.approx(0.035), "smoe": None}
    assert "trained %" in text.splitlines()[0]
    assert {line.split()[0]: line.split()[-1] for line in text.splitlines()[2:5]} == {
        "lora": "2",
        "replora": "3.5",
        "smoe": "—",
    }
