"""``moelab bench suite``: the grid CLI on tiny sizes (no timing is asserted), its documented JSON,
the FLOP and capacity accounting, the Zipf routing, bad input and
``--out`` / ``--resume``."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re

import pytest
import torch

import moelab
import moelab.bench.suite as suite
import moelab.bench.workload as workload
from moelab import MoE
from moelab.cli import main
from moelab.experiments import runner
from moelab.experts import MLP

TINY = ["--shapes", "4x2x16", "--d-model", "16", "--repeats", "2", "--warmup", "0", "--threads", "1"]
CASE_KEYS = {
    "key",
    "tokens",
    "num_experts",
    "top_k",
    "d_hidden",
    "d_model",
    "routing",
    "threads",
    "load",
    "rounds",
    "seconds",
    "loadavg_1min",
    "notes",
    "rows",
}
ROW_KEYS = {
    "name",
    "group",
    "phase",
    "median_ms",
    "p25_ms",
    "p75_ms",
    "min_ms",
    "ratio_to_dense",
    "ratio_p25",
    "ratio_p75",
    "ratio_to_bound",
    "ratio_to_experts",
    "flops_per_token",
    "computed_flops_per_token",
    "drops_tokens",
    "dropped_fraction",
    "peak_mib",
    "note",
}
LOAD_KEYS = {"top_share", "max_over_mean", "favourite_hit", "experts_touched", "touched_weights_mib"}
SUMMARY_KEYS = {
    "key",
    "top_share",
    "moelab_dense_train",
    "moelab_dense_infer",
    "best_peer_train",
    "best_peer_dense_train",
    "best_peer_drops_train",
    "best_peer_infer",
    "best_peer_dense_infer",
    "best_peer_drops_infer",
    "moelab_bound",
    "moelab_experts_train",
    "moelab_experts_infer",
    "experts_dense_train",
    "experts_dense_infer",
}
HAVE_PEERS = all(
    importlib.util.find_spec(m) is not None for m in ("transformers", "st_moe_pytorch", "mixture_of_experts")
)


def _suite(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "suite", *args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def tiny_json() -> dict:
    """One case with every peer: T=16 tokens, N=4, K=2, h=16, d=16."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    code, text = _suite("--tokens", "16", "--routing", "zipf", *TINY, "--json")
    assert code == 0
    return json.loads(text)


def _balanced_to(out, tokens: str) -> list[str]:
    """argv of a tiny balanced grid without peers or memory probes, written to ``out``."""
    return [
        "--tokens",
        tokens,
        "--routing",
        "balanced",
        *TINY,
        "--peers",
        "none",
        "--no-memory",
        "--out",
        str(out),
    ]


def _rows(case: dict, **match) -> list[dict]:
    return [r for r in case["rows"] if all(r[k] == v for k, v in match.items())]


def test_suite_json_has_the_documented_keys(tiny_json):
    doc = tiny_json
    assert set(doc) == {"bench", "schema", "settings", "config", "machine", "cases", "summary"}
    assert doc["bench"] == "suite" and doc["schema"] == 2
    assert doc["settings"]["command"] == "bench suite" and doc["settings"]["tokens"] == "16"
    assert doc["config"]["tokens"] == [16] and doc["config"]["shapes"] == ["4x2x16"]
    assert doc["config"]["zipf_exponent"] == 1.0 and doc["config"]["bound_max_tokens"] == 16
    assert doc["machine"]["torch"] == torch.__version__
    (case,) = doc["cases"]
    assert set(case) == CASE_KEYS and set(case["load"]) == LOAD_KEYS
    assert (case["tokens"], case["num_experts"], case["top_k"], case["d_hidden"], case["d_model"]) == (
        16,
        4,
        2,
        16,
        16,
    )
    assert case["routing"] == "zipf" and case["threads"] == 1 and case["rounds"] == 2
    for row in case["rows"]:
        assert set(row) == ROW_KEYS
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"]
        assert row["peak_mib"] is not None and row["peak_mib"] >= 0
    assert [set(s) for s in doc["summary"]] == [SUMMARY_KEYS]
    assert doc["summary"][0]["key"] == case["key"]


def test_suite_ratios_of_dense_are_one_and_moelab_flops_match_dense(tiny_json):
    (case,) = tiny_json["cases"]
    groups = {r["group"] for r in case["rows"]}
    assert "swiglu" in groups
    for group in groups:
        for phase in ("train", "infer"):
            (dense,) = _rows(case, group=group, phase=phase, name="dense")
            (moelab,) = _rows(case, group=group, phase=phase, name="moelab")
            assert dense["ratio_to_dense"] == 1.0
            literal = 2 * 2 * (16 * 2 * 16 + 16 * 16) if group.startswith("swiglu") else 2 * 2 * (2 * 16 * 16)
            assert dense["flops_per_token"] == moelab["flops_per_token"] == literal
            assert "FLOPs/token" not in moelab["note"]


def test_suite_bound_is_timed_at_small_T_and_is_its_own_unit(tiny_json):
    (case,) = tiny_json["cases"]
    (bound,) = _rows(case, name="bound")
    assert bound["group"] == "swiglu" and bound["phase"] == "infer" and bound["ratio_to_bound"] == 1.0
    (moelab,) = _rows(case, group="swiglu", phase="infer", name="moelab")
    assert (
        moelab["ratio_to_bound"] > 0 and tiny_json["summary"][0]["moelab_bound"] == moelab["ratio_to_bound"]
    )
    assert bound["flops_per_token"] == moelab["flops_per_token"]
    assert case["load"]["touched_weights_mib"] > 0


def test_suite_experts_row_splits_the_gap_into_dispatch_and_expert_gemms(tiny_json):
    (case,) = tiny_json["cases"]
    summary = tiny_json["summary"][0]
    for phase in ("train", "infer"):
        (experts,) = _rows(case, name="experts", phase=phase)
        (moelab,) = _rows(case, group="swiglu", phase=phase, name="moelab")
        assert experts["group"] == "swiglu" and experts["ratio_to_experts"] == 1.0
        assert experts["flops_per_token"] == moelab["flops_per_token"]
        assert summary[f"moelab_experts_{phase}"] == moelab["ratio_to_experts"] > 0
        assert summary[f"experts_dense_{phase}"] == experts["ratio_to_dense"] > 0
        assert summary[f"best_peer_{phase}"] != "experts"


def test_experts_only_runs_the_banks_experts_on_sorted_slots():
    from moelab.bench.suite import experts_only
    from moelab.experts import ExpertBank

    bank = ExpertBank(4, 8, 8, activation="swiglu")
    x, grad = torch.randn(6, 8), torch.randn(6, 8)
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    steps = dict((phase, (fn, reset)) for phase, fn, reset in experts_only(bank, x, indices, grad))
    steps["train"][0]()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in bank.parameters())
    steps["train"][1]()
    assert all(p.grad is None for p in bank.parameters())
    steps["infer"][0]()


@pytest.mark.skipif(not HAVE_PEERS, reason="needs transformers, st-moe-pytorch and mixture-of-experts")
def test_suite_flags_capacity_peers_and_their_drops_match_the_capacity(tiny_json):
    (case,) = tiny_json["cases"]
    names = {r["name"] for r in case["rows"]}
    assert {"mixtral eager", "mixtral grouped_mm", "st-moe", "lucidrains"} <= names
    assert not [n for n in case["notes"] if "differs" in n]  # outputs agree with moelab / the literal sum
    T, N, K = 16, 4, 2
    for name in ("st-moe", "lucidrains"):
        for phase, cf in (("train", 1.25), ("infer", 2.0)):
            (row,) = _rows(case, name=name, phase=phase)
            capacity = max(4, min(T, int(T * cf / N)))
            assert row["drops_tokens"] and row["note"].startswith("drops tokens (capacity)")
            assert 0.0 <= row["dropped_fraction"] <= 1.0
            # at most N·C of the T·K slots fit: the rest is dropped whatever the routing
            assert row["dropped_fraction"] >= 1 - N * capacity / (T * K) - 1e-9
            d = 16
            per_row = row["flops_per_token"] // K
            assert row["computed_flops_per_token"] == (N * capacity * per_row + 4 * T * N * capacity * d) // T
    for row in _rows(case, name="mixtral grouped_mm"):
        assert not row["drops_tokens"] and row["dropped_fraction"] is None
        assert row["computed_flops_per_token"] == row["flops_per_token"]


def test_suite_flags_a_dense_of_a_different_width(monkeypatch):
    monkeypatch.setattr(
        suite, "MLP", lambda d, width, activation, bias: MLP(d, width + 1, activation=activation, bias=bias)
    )
    code, text = _suite("--tokens", "4", "--routing", "balanced", *TINY, "--peers", "none", "--json")
    assert code == 0
    (case,) = json.loads(text)["cases"]
    for row in _rows(case, name="moelab"):
        assert re.search(r"FLOPs/token \d+ != dense \d+", row["note"])
    (bound,) = _rows(case, name="bound")
    assert "!= dense" in bound["note"]


@pytest.mark.parametrize("top_k", [1, 2])
def test_zipf_routing_is_skewed_and_balanced_is_not(top_k):
    T, N, d = 512, 8, 32
    layer = MoE(d, N, top_k, d_hidden=8)
    shares = {}
    for routing in workload.ROUTINGS:
        gen = torch.Generator().manual_seed(0)
        fav = workload.favourite_experts(T, N, routing, gen)
        x = workload.routed_inputs(layer.router.weight, fav, gen)
        with torch.no_grad(), moelab.recording_routing(layer):
            layer(x)
        load = workload.load_stats(layer.last_routing.indices, N, fav)
        assert load["favourite_hit"] == 1.0  # every token's top-1 is its favourite
        shares[routing] = load
    balanced, zipf = shares["balanced"], shares["zipf"]
    if top_k == 1:
        assert balanced["max_over_mean"] == 1.0  # T/N tokens each
    assert balanced["max_over_mean"] < 1.5
    # Zipf(1) over 8 experts: P(expert 0) = 1/H_8 = 0.37 of the top-1 choices
    h8 = sum(1 / i for i in range(1, N + 1))
    assert zipf["top_share"] >= (1 / h8 - 0.06) / top_k
    assert balanced["top_share"] < 1 / N + 0.03 < 1 / N + 0.08 < zipf["top_share"]


def test_routed_inputs_move_tokens_no_more_than_needed():
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(6, 24) / 24**0.5
    fav = torch.arange(6).repeat(10)
    x = workload.routed_inputs(W, fav, gen)
    logits = x @ W.t()
    top2 = logits.topk(2, dim=-1).values
    assert torch.equal(logits.argmax(-1), fav)
    # the smallest shift: a token that had to move ends exactly `margin` above its best rival
    moved = top2[:, 0] - top2[:, 1] < workload.ZIPF_MARGIN + 1e-4
    assert moved.any() and (top2[:, 0] - top2[:, 1] >= workload.ZIPF_MARGIN - 1e-4).all()


def test_weights_read_bound_touches_exactly_the_routed_experts():
    layer = MoE(8, 6, 2, d_hidden=4, activation="swiglu")
    indices = torch.tensor([[0, 3], [3, 5]])
    step, touched, nbytes = suite.weights_read_bound(layer.experts, torch.randn(2, 8), indices)
    step()
    assert touched == 3 and nbytes == 3 * (8 * 8 + 8 * 4) * 4


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--shapes", "4x5x16", r"--shapes='4x5x16' is not allowed; expected NxKxH .* K <= N"),
        ("--tokens", "0", r"--tokens=0 is not allowed; expected a positive integer"),
        (
            "--tokens",
            "8,a",
            r"--tokens='8,a' is not allowed; expected a comma-separated list of positive integers",
        ),
        ("--routing", "foo", r"--routing='foo' is not allowed; expected one of \['balanced', 'zipf'\]"),
        ("--threads", "0", r"--threads=0 is not allowed; expected a positive integer"),
        (
            "--peers",
            "moe",
            r"--peers='moe' is not allowed; expected one of \['mixtral', 'stmoe', 'lucidrains'\]",
        ),
        ("--repeats", "0", r"--repeats=0 is not allowed; expected an integer in \[1, 1000000000\]"),
        ("--budget", "0", r"--budget=0.0 is not allowed; expected a number > 0"),
    ],
)
def test_suite_rejects_bad_grid_values_in_one_line(capsys, flag, value, match):
    assert main(["bench", "suite", *TINY, "--tokens", "4", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error: ") and err.count("\n") == 1
    assert re.search(match, err)


def test_suite_out_keeps_completed_cases_when_a_later_case_fails_and_resume_runs_the_rest(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "suite.json"
    args = _balanced_to(out, "4,8")
    real = suite.run_case
    calls = []

    def failing(case, a):
        calls.append(case.key)
        if len(calls) == 2:
            raise RuntimeError("simulated failure in the second case")
        return real(case, a)

    monkeypatch.setattr(suite, "run_case", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        main(["bench", "suite", *args])
    first = json.loads(out.read_text())
    assert [c["tokens"] for c in first["cases"]] == [4]
    assert first["summary"][0]["key"] == first["cases"][0]["key"]

    # without --resume an existing file is not overwritten
    assert main(["bench", "suite", *args]) == 2
    assert "exists; pass --resume" in capsys.readouterr().err

    monkeypatch.setattr(suite, "run_case", real)
    assert main(["bench", "suite", *args, "--resume"]) == 0
    second = json.loads(out.read_text())
    assert [c["tokens"] for c in second["cases"]] == [4, 8]
    assert second["cases"][0] == first["cases"][0]  # the finished case was kept, not re-run
    assert "summary" in capsys.readouterr().out


def test_suite_resume_refuses_other_settings(tmp_path, capsys):
    out = tmp_path / "suite.json"
    args = _balanced_to(out, "4")
    assert main(["bench", "suite", *args]) == 0
    capsys.readouterr()
    assert main(["bench", "suite", *args, "--resume", "--seed", "3"]) == 2
    sentence = runner.refuse_change("--seed", 3, 0, out).args[0]
    assert capsys.readouterr().err == f"moelab bench: error: {sentence}\n"


def test_suite_resume_continues_with_the_recorded_settings_and_a_larger_grid(tmp_path, capsys):
    """The grid is not an input: a resumed document gains the cases of a larger grid, and the
    settings not given take their recorded values."""
    out = tmp_path / "suite.json"
    assert main(["bench", "suite", *_balanced_to(out, "4"), "--seed", "2"]) == 0
    assert main(["bench", "suite", "--out", str(out), "--resume", "--tokens", "4,8"]) == 0
    doc = json.loads(out.read_text())
    assert [c["tokens"] for c in doc["cases"]] == [4, 8]
    assert doc["settings"]["seed"] == 2 and doc["settings"]["shapes"] == "4x2x16"
    assert doc["settings"]["tokens"] == "4,8"


def test_suite_resume_with_allow_changes_continues_with_the_new_settings(tmp_path):
    out = tmp_path / "suite.json"
    args = _balanced_to(out, "4")
    assert main(["bench", "suite", *args]) == 0
    assert main(["bench", "suite", *args, "--resume", "--allow-changes", "--seed", "3"]) == 0
    assert json.loads(out.read_text())["settings"]["seed"] == 3


def test_suite_resume_refuses_a_file_timed_on_another_processor(tmp_path, capsys):
    out = tmp_path / "suite.json"
    args = _balanced_to(out, "4")
    assert main(["bench", "suite", *args]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    other = "AVX512" if doc["machine"]["cpu_capability"] != "AVX512" else "AVX2"
    doc["machine"]["cpu_capability"] = other
    out.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["bench", "suite", *args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert (
        f"this machine's cpu_capability {torch.backends.cpu.get_cpu_capability()!r} differs from {other!r}"
        in err
    )
    assert "timings of two machines would mix" in err and "Traceback" not in err
    assert json.loads(out.read_text()) == doc  # the file is left as it was


def test_suite_resume_without_out_or_of_a_document_without_settings_is_refused(tmp_path, capsys):
    argv = _balanced_to(tmp_path / "unused.json", "4")[:-2]  # the grid, without --out
    assert main(["bench", "suite", *argv, "--resume"]) == 2
    assert (
        capsys.readouterr().err
        == "moelab bench: error: --resume needs --out FILE (the file whose cases to keep)\n"
    )
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"bench": "suite", "schema": 1, "cases": []}))  # written before settings were
    assert main(["bench", "suite", *argv, "--out", str(old), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"moelab bench: error: --out={str(old)!r} is not a suite JSON document with its settings ("
    )
    assert err.endswith("use --force to overwrite it\n")
