"""`moelab compare`: methods × seeds → table with every method, results.csv, curves, p-values."""

from __future__ import annotations

import csv

import pytest

import moelab
from moelab.cli import main
from moelab.experiments.papers import PAPERS, paper_table


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "c.txt"
    path.write_text("".join(f"a line of text number {i} with {i % 9} words.\n" for i in range(400)))
    return path


def tiny(corpus, out, *extra):
    return ["compare", "--data", str(corpus), "--block-size", "16", "--batch-size", "4", "--num-experts", "4",
            "--steps", "3", "--eval-every", "3", "--eval-tokens", "64", "--test-tokens", "64", "--seeds", "2",
            "--no-progress", "--jobs", "1", "--out", str(out), *extra]  # fmt: skip


def test_compare_produces_the_table_with_every_method(corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe,competesmoe")) == 0
    text = capsys.readouterr().out
    ran = ["smoe", "xmoe"] + (["competesmoe"] if "competesmoe" in moelab.methods() else [])
    if "competesmoe" not in moelab.methods():
        assert "not available in this moelab (skipped): competesmoe" in text
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ran
    assert all(r["n"] == "2" for r in rows) and sum(r["best"] == "True" for r in rows) == 1
    for method in ran:
        assert any(line.startswith(method + " ") for line in text.splitlines())
        for seed in (0, 1):
            assert (out / method / f"seed{seed}" / "metrics.json").exists()
    assert (out / "val_curves.png").stat().st_size > 1000
    with open(out / "count_models.csv", newline="") as f:
        counts = list(csv.DictReader(f))
    assert [r["order"] for r in counts] == ["1", "2", "3"]
    assert float(counts[2]["test_bpc"]) < float(counts[0]["test_bpc"])  # this text has structure
    line = next(x for x in text.splitlines() if x.startswith("count models of the training split"))
    assert f"trigram {float(counts[2]['test_bpc']):.4f}" in line
    with open(out / "runs.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 2 * len(ran)

    # a second call refuses to overwrite; --resume reuses the finished runs
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe")) == 2
    assert "already holds a comparison" in capsys.readouterr().err
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe", "--resume")) == 0
    assert "finished, reused" in capsys.readouterr().out


def test_compare_gives_every_method_the_same_aux_losses_and_says_so(corpus, tmp_path, capsys):
    import yaml

    out = tmp_path / "cmp"
    assert main(tiny(corpus, out, "--methods", "smoe-fixed,competesmoe-v1", "--seeds", "1")) == 0
    text = capsys.readouterr().out
    assert "aux losses: balance 0.01, z 0.001 for every method" in text
    assert (out / "table.txt").read_text().startswith("aux losses: balance 0.01, z 0.001 for every method")
    for method in ("smoe-fixed", "competesmoe-v1"):  # neither preset has a balance loss of its own
        opts = yaml.safe_load((out / method / "seed0" / "config.yaml").read_text())["opts"]
        assert opts == {"balance_coef": 0.01, "z_coef": 0.001}
    preset = tmp_path / "preset"
    assert main(tiny(corpus, preset, "--methods", "smoe-fixed", "--seeds", "1", "--losses", "preset")) == 0
    assert yaml.safe_load((preset / "smoe-fixed" / "seed0" / "config.yaml").read_text())["opts"] == {}
    assert "each method's preset coefficients" in capsys.readouterr().out


def test_compare_paper_2024_runs_its_methods_without_balance_and_prints_its_table(corpus, tmp_path, capsys):
    import yaml

    out = tmp_path / "paper"
    assert (
        main(tiny(corpus, out, "--paper", "2024", "--seeds", "1", "--steps", "2", "--eval-every", "2")) == 0
    )
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(
        ["smoe", "smoe-fixed", "xmoe", "stablemoe", "competesmoe-v1"]
    )
    opts = yaml.safe_load((out / "xmoe" / "seed0" / "config.yaml").read_text())["opts"]
    assert opts == {"balance_coef": 0.0, "z_coef": 0.0}
    assert "as CompeteSMoE (2024)" in text and "CompeteSMoE (2024) Table 2" in text
    side = (out / "paper.txt").read_text()
    assert "competesmoe-v1" in side and "1.177" in side  # the paper's number beside ours


def test_compare_sweep_gives_the_sensitivity_table(corpus, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = [*tiny(corpus, out, "--methods", "smoe", "--sweep", "balance_coef=0,0.1")]
    args[args.index("--seeds") + 1] = "1"
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "test bpc by balance_coef" in text and "smoe balance_coef=0.1" in text
    assert (out / "smoe-balance_coef0.1" / "seed0" / "config.yaml").read_text().count(
        "balance_coef: 0.1"
    ) == 1


def test_compare_sweeps_the_number_of_activated_experts(corpus, tmp_path, capsys):
    out = tmp_path / "k"
    args = [*tiny(corpus, out, "--methods", "smoe", "--sweep", "top_k=1,2")]
    args[args.index("--seeds") + 1] = "1"
    assert main(args) == 0
    assert "test bpc by top_k" in capsys.readouterr().out
    for k in (1, 2):
        model = moelab.load(out / f"smoe-top_k{k}" / "seed0" / "best")
        assert {layer.top_k for layer in moelab.layer.moe_layers(model)} == {k}
    assert (out / "sensitivity.png").exists()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--sweep", "omega="], "--sweep 'omega=' is not allowed"),
        (["--methods", "smoe,bogus"], "--methods: ['bogus'] are not moelab methods"),
        (["--methods", ","], "names no method"),
        (["--seeds", "0"], "--seeds=0 is not allowed"),
        (["--size", "giant"], "--size='giant' is not allowed"),
        (["--opt", "top_k=1"], "--opt top_k=1 is not allowed; the layer's top_k is set by --top-k"),
        (
            ["--top-k", "2", "--sweep", "top_k=1,2"],
            "--sweep 'top_k=1,2' is not allowed with --top-k; give one",
        ),
        (["--sweep", "seed=1,2"], "--sweep 'seed=1,2' is not allowed; a comparison sets seed itself"),
        (["--sweep", "top_k=0,1"], "--top-k=0 is not allowed; expected a positive integer"),
    ],
)
def test_compare_errors_exit_2_with_one_line(corpus, tmp_path, capsys, extra, message):
    assert main([*tiny(corpus, tmp_path / "x"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_compare_jobs_train_in_worker_processes_with_the_same_results(corpus, tmp_path, capsys):
    import json

    one, two = tmp_path / "one", tmp_path / "two"
    assert main(tiny(corpus, one, "--methods", "smoe,xmoe", "--seeds", "1")) == 0
    assert main([*tiny(corpus, two, "--methods", "smoe,xmoe", "--seeds", "1"), "--jobs", "2"]) == 0
    assert "2 jobs" in capsys.readouterr().out
    for method in ("smoe", "xmoe"):
        a, b = (json.loads((d / method / "seed0" / "metrics.json").read_text()) for d in (one, two))
        assert a["test_bpc"] == b["test_bpc"]  # one thread each: the same numbers as in this process


def test_compare_refuses_a_bad_jobs_count(corpus, tmp_path, capsys):
    assert main([*tiny(corpus, tmp_path / "o"), "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        "--jobs=0 is not allowed; expected a positive integer" in err and len(err.strip().splitlines()) == 1
    )


def test_paper_table_prints_a_dash_for_the_sd_of_one_seed():
    table = paper_table(PAPERS["2024"], {"smoe": (1.30, None, 1), "xmoe": (1.31, 0.01, 3)}, "BPC")
    assert "1.3000 ± — (1)" in table and "1.3100 ± 0.0100 (3)" in table and "nan" not in table


def test_report_prints_a_comparisons_count_models_and_refuses_a_damaged_table(corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(tiny(corpus, out, "--methods", "smoe", "--seeds", "1")) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("count models of"))
    assert main(["report", str(out)]) == 0
    assert line in capsys.readouterr().out.splitlines()  # the same line as compare printed
    (out / "count_models.csv").write_text("order,k\n1,0.1\n")
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "count_models.csv is not a count-model table of moelab compare; delete it or re-run compare"
    )
    assert len(err.splitlines()) == 1


def test_compare_resume_reuses_a_finished_run_only_if_made_with_these_flags_and_data(
    corpus, tmp_path, capsys
):
    import shutil

    data = tmp_path / "a.txt"
    shutil.copy(corpus, data)
    out = tmp_path / "cmp"
    assert main(tiny(data, out, "--methods", "smoe", "--seeds", "1")) == 0
    results = (out / "results.csv").read_bytes()
    capsys.readouterr()
    assert main(tiny(data, out, "--methods", "smoe", "--seeds", "1", "--resume", "--lr", "0.01")) == 2
    err = capsys.readouterr().err
    assert "--resume: --lr=0.01 differs from 0.002 recorded in" in err and len(err.strip().splitlines()) == 1
    data.write_text(data.read_text().replace("line", "LINE"))  # the same file name, other data
    assert main(tiny(data, out, "--methods", "smoe", "--seeds", "1", "--resume")) == 2
    err = capsys.readouterr().err
    assert f"--resume: --data {str(data)!r} has sha256" in err and "cannot continue on other data" in err
    assert (out / "results.csv").read_bytes() == results  # the comparison still reports the run it made


def test_compare_force_over_another_commands_run_leaves_nothing_of_it(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
                 "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
                 "--test-tokens", "64", "--no-progress", "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(tiny(corpus, out, "--methods", "smoe", "--seeds", "1")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a moelab run of another command (config.yaml), not a comparison" in err
    assert main(tiny(corpus, out, "--methods", "smoe", "--seeds", "1", "--force")) == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "count_models.csv", "results.csv", "runs.csv", "smoe", "table.txt", "val_curves.csv", "val_curves.png",
    ]  # fmt: skip


def test_compare_paper_ho2025_runs_each_method_in_its_layout_and_a_flag_wins(corpus, tmp_path, capsys):
    import yaml

    out = tmp_path / "ho"
    args = tiny(corpus, out, "--paper", "ho2025", "--seeds", "1", "--steps", "2", "--eval-every", "2")
    assert main(args) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "sharede-v2",
        "sharede-v3",
        "smoe",
        "smoe-sg",
    ]

    def config(method):
        return yaml.safe_load((out / method / "seed0" / "config.yaml").read_text())

    # --num-experts 4 was given: it wins over the layout's 18 / 16; the rest is the paper's layout
    assert [config(m)["num_experts"] for m in ("smoe", "sharede-v3")] == [4, 4]
    assert (config("smoe-sg")["top_k"], config("smoe-sg")["d_hidden"]) == (4, 16)
    assert (config("sharede-v2")["top_k"], config("sharede-v2")["opts"]) == (2, {"num_shared": 2})
    assert moelab.load(out / "sharede-v3" / "seed0").blocks[0].ffn.num_shared == 2
    assert config("smoe")["opts"] == {}  # each method's own losses
    side = (out / "paper.txt").read_text()
    assert "Ho (2025)" in side and "13.420" in side and "Ho (2025)" in text


def test_compare_paper_2025_table11_runs_each_ablation_row_as_its_method_and_options(
    corpus, tmp_path, capsys
):
    import yaml

    out = tmp_path / "t11"
    args = tiny(corpus, out, "--paper", "2025-table11", "--seeds", "1", "--steps", "2", "--eval-every", "2")
    assert main(args) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["competesmoe", "policy-only", "smoe"]
    config = yaml.safe_load((out / "policy-only" / "seed0" / "config.yaml").read_text())
    assert config["method"] == "competesmoe" and config["opts"]["task_gradient"] is False
    assert config["opts"]["balance_coef"] == 0.01  # the paper's losses for every row
    router = moelab.load(out / "policy-only" / "seed0").blocks[0].ffn.router
    assert router.task_gradient is False
    side = (out / "paper.txt").read_text()
    assert "Table 11" in side and "policy-only" in side and "52.840" in side


def test_compare_keep_ckpts_all_reaches_every_run(corpus, tmp_path):
    out = tmp_path / "cmp"
    argv = tiny(corpus, out, "--methods", "smoe", "--seeds", "1", "--ckpt-every", "1", "--keep-ckpts", "all")
    assert main(argv) == 0
    assert sorted(p.name for p in (out / "smoe" / "seed0" / "ckpt").iterdir()) == [
        "step-00000001", "step-00000002", "step-00000003",
    ]  # fmt: skip


def test_compare_refuses_more_seeds_than_the_machine_can_list(corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe", "--seeds", "999000000")) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "moelab compare: error: --seeds=999000000 is not allowed here: 2 methods × --seeds runs would need at least"
    )
    assert err.endswith("expected a smaller --seeds\n") and not out.exists()


def test_compare_resume_allow_changes_of_runs_not_yet_started_starts_them(corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    (out / "smoe" / "seed0").mkdir(parents=True)  # a comparison killed before its first run began
    assert main(tiny(corpus, out, "--methods", "smoe", "--seeds", "1", "--resume", "--allow-changes")) == 0
    assert (out / "smoe" / "seed0" / "metrics.json").is_file()
    assert main(tiny(corpus, tmp_path / "new", "--methods", "smoe", "--seeds", "1", "--allow-changes")) == 2
    assert capsys.readouterr().err.endswith(
        "--allow-changes is not allowed without --resume; it lets --resume continue a run with changed "
        "settings (a new run takes any settings: drop --allow-changes)\n"
    )


def test_compare_force_keeps_the_users_csv_and_folders_in_out(corpus, tmp_path):
    out = tmp_path / "cmp"
    assert main(tiny(corpus, out, "--methods", "smoe", "--seeds", "1")) == 0
    (out / "my_notes.csv").write_text("mine\n")
    (out / "earlier").mkdir()
    (out / "earlier" / "config.yaml").write_text("command: train\n")  # an earlier run of the user's
    assert main(tiny(corpus, out, "--methods", "smoe", "--seeds", "1", "--force")) == 0
    assert (out / "my_notes.csv").read_text() == "mine\n" and (out / "earlier" / "config.yaml").is_file()
