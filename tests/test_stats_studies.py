"""The convergence-rate studies as a library: their configurations, a study run without a run
directory, and a toolkit that carries no command."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from moelab.stats.studies import StudyResult, run_study, study_config

STATS = pathlib.Path(__file__).resolve().parents[1] / "src" / "moelab" / "stats"


def test_the_default_bound_is_ten_times_the_expected_norm_of_a_true_embedding():
    assert study_config("misspecified").beta1_bound == pytest.approx(10 * 4**0.5)
    assert study_config("softmax-vs-competition", router_std=0.5).beta1_bound == pytest.approx(
        10 * 0.5 * 2**0.5
    )
    assert study_config("misspecified", beta1_bound=3.0).beta1_bound == 3.0
    assert study_config("misspecified").eta_bound == pytest.approx(
        10 * 6**0.5
    )  # q = d + 2 for a·tanh(bᵀx + c)
    assert study_config("softmax-vs-competition").nu_min == pytest.approx(0.05 / 5)
    assert study_config("linear-vs-perturbed").eta_bound == pytest.approx(10 * 5**0.5)  # q = d + 1


def test_unknown_setting_is_rejected():
    with pytest.raises(ValueError, match=r"unknown study settings \['depth'\]"):
        study_config("misspecified", depth=3)


def test_a_study_returns_its_measurements_and_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = study_config("softmax-vs-competition", quick=True, replicates=2, steps=2, sample_sizes=[200, 400])
    result = run_study(cfg, progress=False)
    assert isinstance(result, StudyResult) and list(tmp_path.iterdir()) == []
    series = len(result.metrics["rates"])  # 3 routers × (expert, voronoi) losses
    assert series == 6 and len(result.metrics["table"]) == series * 2
    assert len(result.losses) == series * 2 * 2  # series × sizes × replicates
    assert {"value", "train", "n_iter", "converged", "beta1_max_norm"} <= set(result.losses[0])
    assert result.estimates["sample_sizes"].tolist() == [200, 400]
    assert result.estimates["softmax__over-specified__a"].shape[:2] == (2, 2)
    assert result.metrics["config"]["sample_sizes"] == [200, 400]
    assert all(np.isfinite(r["slope"]) for r in result.metrics["rates"])


def _imports(path: pathlib.Path) -> set[str]:
    """The modules a file of ``moelab.stats`` imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ["moelab", "stats"][: 3 - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


@pytest.mark.parametrize("path", sorted(STATS.glob("*.py")), ids=lambda p: p.name)
def test_the_stats_toolkit_imports_no_command_machinery(path):
    banned = ("argparse", "moelab.cli", "moelab.experiments", "moelab.bench", "moelab.io.rundir")
    used = [m for m in _imports(path) if m.split(".")[0] == "argparse" or m.startswith(banned[1:])]
    assert used == [], f"{path.name} imports {used}"


def test_a_slope_is_not_measured_below_ninety_percent_converged_or_at_the_translation_bound():
    from moelab.stats.studies import not_measured_reason

    assert not_measured_reason(1.0, ["gradient"] * 4) == ""
    assert not_measured_reason(0.75, ["gradient"] * 3 + ["iteration cap"]) == (
        "75% of replicates converged, below 90% (iteration cap 1/4)"
    )
    saturated = np.array([[1.0, 0.0], [1.0, 1.0]])
    assert not_measured_reason(1.0, ["gradient"] * 4, saturated) == (
        "the infimum over translations sits at its bound Σ exp(β*₀) in 75% of replicates "
        "(fits too far from the truth for this loss)"
    )
    assert not_measured_reason(1.0, ["gradient"] * 4, np.zeros((2, 2))) == ""


def test_a_series_measured_against_an_unconverged_reference_fit_is_not_measured():
    """Every loss of a misspecified series is a distance to Ḡ, the fit on one large sample: a Ḡ stopped
    by its iteration cap makes none of them a rate, so the row says so instead of a slope."""
    cfg = study_config(
        "misspecified", quick=True, replicates=2, steps=300, sample_sizes=[200, 400], reference_n=2000,
        reference_steps=1,
    )  # fmt: skip
    rates = {r["router"]: r for r in run_study(cfg, progress=False).metrics["rates"]}
    for router in ("cosine", "perturbed"):
        assert rates[router]["not_measured"] == (
            "the reference fit Ḡ did not converge (iteration cap 1/1); raise --reference-steps"
        )
        assert all(t["verdict"] == "not measured" for t in rates[router]["theory"])
    converged = study_config("misspecified", quick=True, replicates=2, steps=300, sample_sizes=[200, 400],
                             reference_n=2000)  # fmt: skip
    assert "reference" not in run_study(converged, progress=False).metrics["rates"][0]["not_measured"]
