"""`moelab benchmark`: every method × seeds under one protocol → one row per method with its
interval, paired test, equivalence test, bootstrap rank, diagnostics and cost columns, from files
that a resumed benchmark reuses without changing a number."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from scipy import stats

from moelab import config as vocab
from moelab.bench.routers import _saturation_mid, _scheduled_fraction, _verdict
from moelab.cli import main
from moelab.experiments.summary import holm


def tiny(corpus, out, *extra):
    return ["benchmark", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "4", "--eval-every", "2", "--ckpt-every", "2", "--eval-tokens",
            "64", "--test-tokens", "64", "--seeds", "3", "--no-progress", "--jobs", "1", "--diagnose-tokens",
            "64", "--repeat-steps", "2", "--timing-rounds", "3", "--no-ranks", "--out", str(out),
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bm") / "bm"
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe,competesmoe")) == 0
    return out


def _rows(out):
    with open(out / "benchmark.csv", newline="") as f:
        return {r["method"]: r for r in csv.DictReader(f)}


def test_benchmark_writes_one_row_per_method_from_its_runs(finished):
    rows = _rows(finished)
    assert set(rows) == {"smoe", "xmoe", "competesmoe"}
    tests = {}
    for method, r in rows.items():
        values = [
            json.loads((finished / method / f"seed{s}" / "metrics.json").read_text())["test_bpc"]
            for s in range(3)
        ]
        tests[method] = values
        assert [float(v) for v in r["per_seed"].split(";")] == values
        assert float(r["mean"]) == pytest.approx(np.mean(values), abs=1e-12)
        half = stats.t.ppf(0.975, 2) * np.std(values, ddof=1) / np.sqrt(3)
        assert float(r["ci_low"]) == pytest.approx(np.mean(values) - half, rel=1e-9)
        diag = [
            json.loads((finished / method / f"seed{s}" / "diagnostics.json").read_text()) for s in range(3)
        ]
        assert float(r["jain"]) == pytest.approx(np.mean([d["jain_mean"] for d in diag]), rel=1e-12)
        assert float(r["active_experts"]) == pytest.approx(2.0)  # top-2 at inference, every method here
        assert r["bit_repeat"] == "True" and r["rank_gap"] == ""  # --no-ranks: not measured
        assert float(r["layer_ratio"]) > 0 and float(r["peak_mib"]) > 0
    # the paired differences, p-values Holm-adjusted over the two comparisons
    ps = {m: stats.ttest_rel(tests[m], tests["smoe"]).pvalue for m in ("xmoe", "competesmoe")}
    adjusted = dict(zip(ps, holm(list(ps.values()))))
    for m in ps:
        assert float(rows[m]["delta"]) == pytest.approx(
            np.mean(np.subtract(tests[m], tests["smoe"])), abs=1e-12
        )
        assert float(rows[m]["p_holm"]) == pytest.approx(adjusted[m], rel=1e-9)
    assert rows["smoe"]["verdict"] == "reference" and rows["smoe"]["p"] == ""
    # competesmoe's layer time weighs its competing steps by the share the schedule gives them
    assert (
        0 < float(rows["competesmoe"]["competing_fraction"]) < 1 and rows["xmoe"]["competing_fraction"] == ""
    )
    table = (finished / "benchmark.md").read_text()
    assert table.count("\n| ") == 4 and "TOST p (raw / Holm), ±0.02" in table and "(sched.)" in table
    # compare's report, rewritten after the diagnostics: their tables are in the folder
    assert (finished / "diagnostics.csv").is_file() and (finished / "diagnostics_curves.csv").is_file()
    for png in ("benchmark_bpc.png", "benchmark_cost.png"):
        assert (finished / png).stat().st_size > 1000


def test_benchmark_resume_reuses_every_file_and_changes_no_number(corpus, finished, capsys):
    before = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file() and p.suffix in (".json", ".csv")}
    assert main(tiny(corpus, finished, "--methods", "smoe,xmoe,competesmoe")) == 2
    assert "already holds a benchmark or a comparison; pass --resume" in capsys.readouterr().err
    assert main(tiny(corpus, finished, "--methods", "smoe,xmoe,competesmoe", "--resume")) == 0
    out = capsys.readouterr().out
    assert (
        out.count("finished, reused") == 9 and "diagnosing 0 of 9 runs" in out and "cost measured" not in out
    )
    after = {p: p.read_bytes() for p in before}
    assert after == before


def test_benchmark_resume_refuses_cost_measured_with_other_settings(corpus, finished, capsys):
    assert (
        main(tiny(corpus, finished, "--methods", "smoe,xmoe,competesmoe", "--resume", "--timing-rounds", "4"))
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.endswith(
        "--resume: --timing-rounds=4 differs from 3 recorded in "
        f"{finished / 'smoe' / 'cost.json'}; the run cannot continue with other settings (pass "
        "--allow-changes to continue it with the new ones, or --force to start afresh)"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "smoe,nope"], "--methods: ['nope'] are not moelab methods; allowed: all or"),
        (["--methods", "xmoe,pcosine"], "--reference 'smoe' is not among --methods ['xmoe', 'pcosine']"),
        (["--methods", "smoe,smoe"], "--methods 'smoe,smoe' names a method twice"),
        (["--methods", "smoe"], "--methods 'smoe': a benchmark compares at least two methods"),
        (["--methods", "smoe,xmoe", "--seeds", "1"], "--seeds=1 is not allowed"),
        (["--methods", "smoe,xmoe", "--margin", "0"], "--margin=0"),
        (["--methods", "smoe,xmoe", "--protocol", "slow"], "--protocol"),
    ],
)
def test_benchmark_errors_exit_2_with_one_line(corpus, tmp_path, capsys, extra, message):
    assert main(tiny(corpus, tmp_path / "bad", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_protocol_fills_only_the_settings_the_flags_do_not_give():
    from moelab.bench.routers import DECISIVE_METHODS, benchmark_config
    from moelab.cli import build_parser

    parser = build_parser()
    decisive = benchmark_config(
        parser.parse_args(
            ["benchmark", "--protocol", "decisive", "--steps", "10", "--seeds", "3", "--out", "x"]
        )
    )
    assert (decisive.run.size, decisive.run.schedule, decisive.run.lr, decisive.run.warmup) == (
        "cpu",
        "cosine",
        3e-3,
        400,
    )
    assert (decisive.margin, decisive.methods, decisive.run.ckpt_every) == (0.03, DECISIVE_METHODS, 250)
    assert (decisive.run.steps, decisive.seeds) == (10, 3)  # given: the flags win
    quick = benchmark_config(parser.parse_args(["benchmark", "--out", "x"]))
    assert (quick.protocol, quick.run.size, quick.run.steps, quick.seeds, quick.margin, quick.methods) == (
        "quick",
        "mini",
        500,
        5,
        0.02,
        "all",
    )


def test_verdicts_follow_the_adjusted_tests():
    assert _verdict(-0.01, 0.5, 0.01) == "equivalent"
    assert _verdict(-0.05, 0.001, 0.9) == "better" and _verdict(0.05, 0.001, 0.9) == "worse"
    assert _verdict(0.005, 0.01, 0.01) == "equivalent (higher within the margin)"
    assert _verdict(0.03, 0.2, 0.3) == "inconclusive" and _verdict(0.0, None, None) == "inconclusive"


def test_saturation_is_read_at_the_checkpoint_nearest_half_the_run():
    d = {"curve_steps": [100, 200, 300, 400, 500], "saturation_mean": [0.5, 0.6, 0.7, 0.9, 1.0]}
    assert _saturation_mid(d) == (0.6, 200)  # 250: 200 and 300 are as near; the earlier one
    assert _saturation_mid({"curve_steps": [4], "saturation_mean": [1.0]}) == (None, None)


def test_scheduled_fraction_counts_the_competing_layer_steps():
    class Every3:
        def active(self, layer, step):
            return layer == 0 and step % 3 == 0

    assert _scheduled_fraction(Every3(), 2, 9) == 3 / 18


def test_a_method_that_cannot_train_on_two_ranks_is_named_not_measured(corpus, tmp_path, monkeypatch):
    import subprocess

    from moelab.bench import routers
    from moelab.experiments import lm

    def fail(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "Traceback ...\nRuntimeError: no second rank here\n")

    monkeypatch.setattr(routers.subprocess, "run", fail)
    one = lm.TrainRun(
        data=str(corpus), size="cpu", block_size=16, batch_size=4, num_experts=4, progress=False
    )
    out = routers.repeat_checks(lm.resolve(vocab.validate(one)), steps=2, two_ranks=True)
    assert out["bit_repeat"] is True and out["rank_gap"] is None
    assert out["rank_note"] == "the 2-rank run failed (exit 1): RuntimeError: no second rank here"


def test_benchmark_keeps_no_run_of_its_checks_where_report_would_pool_them(finished):
    runs = sorted(p.parent.relative_to(finished) for p in finished.rglob("metrics.json"))
    assert [str(r) for r in runs] == [
        f"{m}/seed{s}" for m in ("competesmoe", "smoe", "xmoe") for s in range(3)
    ]


def test_benchmark_refuses_an_edited_cost_json_in_one_line(corpus, finished, tmp_path, capsys):
    import shutil

    out = tmp_path / "bm"
    shutil.copytree(finished, out)
    cost = out / "xmoe" / "cost.json"
    cost.write_text(json.dumps({**json.loads(cost.read_text()), "layer_ratio": 0.5}, indent=2) + "\n")
    capsys.readouterr()
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe,competesmoe", "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        f"{str(cost)!r} was changed after moelab wrote it (its sha256 is not the one recorded in "
        ".moelab-digests.json); run the command that wrote it again rather than edit it"
    )


@pytest.mark.slow
def test_benchmark_force_measures_the_cost_again_and_keeps_the_users_files(
    corpus, finished, tmp_path, capsys
):
    import shutil

    out = tmp_path / "bm"
    shutil.copytree(finished, out)
    (out / "notes.csv").write_text("mine\n")
    capsys.readouterr()
    assert main(tiny(corpus, out, "--methods", "smoe,xmoe", "--force")) == 0
    printed = capsys.readouterr().out
    assert printed.count("cost measured") == 2
    assert (out / "notes.csv").read_text() == "mine\n" and not (out / "competesmoe").exists()


def test_the_plan_reads_the_pilot_in_out_and_the_table_gives_each_row_its_mdd(finished, capsys):
    """`--plan` trains nothing: from the finished runs it prints, per comparison, Δ, its spread, the
    minimum detectable difference and the seeds the verdict needs; the benchmark table carries the
    same MDD per row."""
    from moelab.experiments.summary import plan_paired

    rows = _rows(finished)
    tests = {
        m: [
            json.loads((finished / m / f"seed{s}" / "metrics.json").read_text())["test_bpc"] for s in range(3)
        ]
        for m in rows
    }
    for m in ("xmoe", "competesmoe"):
        d = np.subtract(tests[m], tests["smoe"])
        mdd = (stats.t.ppf(1 - 0.025 / 2, 2) + stats.t.ppf(0.8, 2)) * np.std(d, ddof=1) / np.sqrt(3)
        assert float(rows[m]["mdd"]) == pytest.approx(mdd, rel=1e-9)
        assert plan_paired(list(d), 0.02, alpha=0.025).mdd == pytest.approx(mdd, rel=1e-12)
    assert "MDD (80% power)" in (finished / "benchmark.md").read_text()
    before = sorted(p.name for p in finished.rglob("*"))
    assert main(["benchmark", "--plan", "--methods", "smoe,xmoe,competesmoe", "--out", str(finished)]) == 0
    text = capsys.readouterr().out
    assert "| xmoe | 3 |" in text and "| competesmoe | 3 |" in text and "seeds needed (±0.02)" in text
    assert sorted(p.name for p in finished.rglob("*")) == before  # nothing written


def test_the_plan_refuses_a_folder_without_a_pilot(tmp_path, capsys):
    assert main(["benchmark", "--plan", "--methods", "smoe,xmoe", "--out", str(tmp_path)]) == 2
    assert "--plan needs a pilot: finished runs of 'smoe' and another method" in capsys.readouterr().err


def test_the_layer_cost_gives_a_router_by_document_each_block_as_a_document():
    import torch

    import moelab
    from moelab.bench.routers import _with_documents

    layer = moelab.MoE(8, 8, 2, method="emo").eval()
    x = torch.randn(12, 8)
    wrapped = _with_documents(layer, 4)
    assert list(wrapped.parameters()) == list(layer.parameters())
    torch.testing.assert_close(wrapped(x), layer(x, doc_ids=torch.arange(12) // 4), rtol=0, atol=0)
