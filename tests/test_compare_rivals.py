"""The routers recent papers compare against, end to end through the CLI: ``compare`` trains each,
``diagnose`` reads their runs (no swap for a variable number of experts), ``report`` tabulates them."""

from __future__ import annotations

import csv
import json
import warnings

import pytest

from moelab.cli import main

RIVALS = ["remoe", "top-p", "densemixer", "expert-choice", "moepp", "aoe", "erc"]
#: the rivals that route a variable number of experts per token (no swap diagnostic)
VARIABLE = {"remoe", "top-p", "expert-choice", "moepp"}


@pytest.mark.slow
def test_compare_diagnose_and_report_run_every_rival(corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--data", str(corpus), "--block-size", "16", "--batch-size", "4", "--num-experts", "4",
            "--steps", "2", "--eval-every", "2", "--eval-tokens", "64", "--test-tokens", "64", "--seeds", "1",
            "--no-progress", "--jobs", "1", "--out", str(out), "--methods", ",".join(RIVALS)]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # expert-choice in a causal LM warns (pinned elsewhere)
        assert main(args) == 0
    with open(out / "results.csv", newline="") as f:
        assert [r["method"] for r in csv.DictReader(f)] == RIVALS
    assert main(["diagnose", *(str(out / m / "seed0") for m in RIVALS), "--tokens", "128"]) == 0
    for method in RIVALS:
        d = json.loads((out / method / "seed0" / "diagnostics.json").read_text())
        assert d["method"] == method and len(d["load"]) == 2
        for load in d["load"]:
            assert sum(load) == pytest.approx(1.0)
        variable = method in VARIABLE
        assert ("swap_top1_delta" in d) == (not variable), method
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    for method in RIVALS:
        assert any(line.startswith(method + " ") for line in text.splitlines())
