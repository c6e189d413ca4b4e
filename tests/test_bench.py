"""``moelab bench``: the CLI on tiny sizes (no timing is asserted), the FLOP accounting, bad
input, and the dispatch it measures: identical to the literal ``Σ_k w_k · expert_{i_k}(x)``."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moelab import MoE
from moelab.bench.harness import expert_flops_per_token
from moelab.cli import main
from moelab.experts import MLP, ExpertBank, grouped_mm_available

TINY = [
    "-T",
    "12",
    "--d-model",
    "8",
    "--d-hidden",
    "4",
    "-N",
    "4",
    "-K",
    "2",
    "--repeats",
    "2",
    "--warmup",
    "0",
]
GROUPED = grouped_mm_available(torch.device("cpu"), torch.float32)
torch.set_num_threads(1)  # the machine is shared (as tests/conftest.py on main)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _bench_json(capsys, *extra: str) -> dict:
    assert main(["bench", "layer", *TINY, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_layer_json_has_every_candidate_in_both_phases(capsys):
    out = _bench_json(capsys, "--no-hf", "--impl", "loop,grouped,auto")
    names = {(r["name"], r["phase"]) for r in out["results"]}
    auto = "grouped" if GROUPED else "loop"
    expected = ["dense", "moelab loop", "moelab auto"] + (["moelab grouped"] if GROUPED else [])
    for phase in ("train", "infer"):
        for name in expected:
            assert (name, phase) in names
    for phase in ("train", "infer"):  # auto's pick beside the fastest kernel measured
        a = out["auto"][phase]
        fastest = min(
            (
                r
                for r in out["results"]
                if r["phase"] == phase and r["name"] in ("moelab loop", "moelab grouped")
            ),
            key=lambda r: r["median_ms"],
        )
        assert a["fastest"] == fastest["name"].split()[1] and a["auto_over_fastest"] > 0
    assert out["auto"]["train"]["auto"] == auto
    assert out["config"]["dense_width"] == 8
    assert out["config"]["clock"] == "wall" and out["config"]["impl"] == ["loop", "grouped", "auto"]
    assert out["machine"]["torch"] == torch.__version__
    assert out["machine"]["cores"] >= 1
    for r in out["results"]:
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"]
        assert r["flops_per_token"] == out["results"][0]["flops_per_token"]
        assert r["note"] == ""
        if r["name"] == "dense":
            assert r["ratio_to_dense"] == 1.0


def test_bench_layer_auto_row_is_the_rule_and_autotune_reports_its_pick_beside_it(capsys):

    rule = "grouped" if GROUPED else "loop"
    out = _bench_json(capsys, "--no-hf", "--impl", "loop,auto", "--autotune")
    for phase in ("train", "infer"):
        tuned = out["autotune"][phase]
        assert tuned["pick"] in tuned["medians_ms"] and "loop" in tuned["medians_ms"]
        assert tuned["rule"] == out["auto"][phase]["auto"] == rule  # the auto row ran the rule
        assert tuned["pick"] == rule or tuned["pick"] not in tuned["other_rounding"]
    assert out["config"]["autotune"] is True
    assert main(["bench", "layer", *TINY, "--no-hf", "--impl", "auto", "--autotune"]) == 0
    text = capsys.readouterr().out
    assert "autotune (train): picks " in text and f"(rule: {rule}); its medians: {rule} " in text
    out = _bench_json(capsys, "--no-hf", "--impl", "loop", "--autotune")
    assert (
        out["autotune"] == {}
        and "--autotune skipped: it measures impl=auto: add auto to --impl" in out["notes"]
    )
    assert _bench_json(capsys, "--no-hf", "--impl", "auto")["autotune"] == {}


def test_bench_layer_includes_mixtral_with_identical_outputs(capsys):
    pytest.importorskip("transformers")
    out = _bench_json(capsys, "--impl", "loop")
    names = {r["name"] for r in out["results"]}
    assert {"mixtral eager", "mixtral grouped_mm"} <= names
    assert out["notes"] == []  # a note would report Mixtral's output differing from moelab's


def test_bench_layer_prints_a_table_with_the_machine(capsys):
    assert (
        main(["bench", "layer", *TINY, "--no-hf", "--impl", "loop", "--threads", "1", "--clock", "cpu"]) == 0
    )
    text = capsys.readouterr().out
    assert "torch threads 1" in text and f"torch {torch.__version__}" in text
    assert "moelab loop" in text and "x dense" in text
    assert "auto (train)" not in text  # no auto row, no comparison


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--top-k", "5", r"top_k=5 is not allowed; expected an integer in \[1, 4\]"),
        (
            "--impl",
            "fast",
            r"impl='fast' is not allowed; expected one of \['auto', 'loop', 'grouped', 'stream', 'triton'\]",
        ),
        ("--repeats", "0", r"repeats=0 is not allowed; expected a positive integer"),
        ("--threads", "0", r"threads=0 is not allowed; expected a positive integer"),
    ],
)
def test_bench_layer_rejects_bad_arguments_in_one_line(capsys, flag, value, match):
    args = [*TINY, flag, value]
    assert main(["bench", "layer", *args, "--no-hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error: ") and err.count("\n") == 1
    assert re.search(match, err)


def test_bench_layer_skips_grouped_with_a_note_where_it_cannot_run(capsys):
    out = _bench_json(capsys, "--no-hf", "--impl", "loop,grouped", "--d-model", "6")
    assert {r["name"] for r in out["results"]} == {"dense", "moelab loop"}
    assert any("moelab grouped skipped" in n and "d_model=6" in n for n in out["notes"])


def test_bench_kinds_come_from_the_registry(monkeypatch, capsys):
    import moelab.bench as bench

    monkeypatch.setitem(bench.BENCHES, "layer-again", ("moelab.bench.layer", "the layer bench again"))
    assert main(["bench", "layer-again", *TINY, "--no-hf", "--impl", "loop", "--json"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nosuch"])
    assert exc.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_bench_requires_a_kind(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    assert exc.value.code == 2


def test_flops_per_token_match_between_moe_dense_and_mixtral():
    d, h, n, k = 8, 6, 4, 2
    moe = MoE(d, n, k, d_hidden=h, activation="swiglu")
    dense = MLP(d, k * h, activation="swiglu")
    literal = k * 2 * (d * 2 * h + h * d)  # K experts: d -> [gate|up] (2h) -> d
    assert expert_flops_per_token(moe, k) == literal == expert_flops_per_token(dense, k)
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(
        hidden_size=d, intermediate_size=h, num_local_experts=n, num_experts_per_tok=k
    )
    assert expert_flops_per_token(MixtralSparseMoeBlock(cfg), k) == literal


# ------------------------------------------------------------------ the dispatch being measured
def _literal(bank: ExpertBank, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``Σ_k w_k · expert_{i_k}(x)``, token by token (the definition, no dispatch)."""
    rows = []
    for t in range(x.shape[0]):
        rows.append(
            sum(w[t, k] * bank.expert_forward(x[t : t + 1], int(idx[t, k]))[0] for k in range(idx.shape[1]))
        )
    return torch.stack(rows)


def _routing(t: int, n: int, k: int, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, never expert ``skip`` (so one expert has no tokens)."""
    choices = [e for e in range(n) if e != skip]
    idx = torch.stack([torch.tensor(choices)[torch.randperm(len(choices))[:k]] for _ in range(t)])
    return idx, torch.rand(t, k).softmax(-1)


IMPL_CASES = ["loop"] + (["grouped"] if GROUPED else [])


@pytest.mark.parametrize("impl", IMPL_CASES)
@pytest.mark.parametrize("act", ["swiglu", "relu", "gelu", "silu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 4, 2), (9, 6, 3), (16, 5, 1)])
def test_dispatch_output_and_gradients_equal_the_literal_sum(impl, act, bias, t, n, k):
    bank = ExpertBank(n, 8, 4, activation=act, bias=bias, impl=impl)
    if bias:
        with torch.no_grad():
            bank.b_in.normal_()
            bank.b_out.normal_()
    idx, w = _routing(t, n, k, skip=n - 1)
    x = torch.randn(t, 8)
    g = torch.randn(t, 8)
    leaves = [x.requires_grad_(), w.requires_grad_(), *bank.parameters()]
    got = bank.mix(x, idx, w)
    grads = torch.autograd.grad(got, leaves, g)
    want = _literal(bank, x, idx, w)
    want_grads = torch.autograd.grad(want, leaves, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert bank.w_in.grad is None  # autograd.grad: nothing accumulated
    assert grads[2][n - 1].abs().sum() == 0  # the expert with no tokens gets a zero gradient


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_loop_dispatch_passes_gradcheck_in_float64(act):
    bank = ExpertBank(4, 3, 2, activation=act, bias=True, impl="loop").double()
    idx, w = _routing(5, 4, 2, skip=3)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = w.double().requires_grad_()
    params = list(bank.parameters())
    assert torch.autograd.gradcheck(lambda x, w, *p: bank.mix(x, idx, w), (x, w, *params))


@pytest.mark.parametrize("impl", IMPL_CASES)
def test_dispatch_is_bitwise_deterministic(impl):
    bank = ExpertBank(8, 16, 8, activation="swiglu", impl=impl)
    idx, w = _routing(64, 8, 2, skip=-1)
    x = torch.randn(64, 16, requires_grad=True)
    runs = []
    for _ in range(2):
        y = bank.mix(x, idx, w)
        runs.append([y, *torch.autograd.grad(y.square().sum(), [x, *bank.parameters()])])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_auto_uses_grouped_only_where_grouped_mm_can_run():
    want = "grouped" if GROUPED else "loop"
    assert ExpertBank(3, 8, 16).resolved_impl(torch.randn(2, 8)) == want
    assert ExpertBank(3, 8, 16).resolved_impl(torch.randn(2, 8, dtype=torch.float64)) == "loop"
    assert ExpertBank(3, 6, 10).resolved_impl(torch.randn(2, 6)) == "loop"  # rows not 16-byte aligned


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["bench", "layer", "--d-model", "4096000000"], "--d-model"),
        (["bench", "layer", "--num-experts", "4096000000"], "--num-experts"),
        (["bench", "layer", "--tokens", "4096000000"], "--tokens"),
        (["bench", "suite", "--tokens", "4096000000"], "--tokens"),
    ],
)
def test_bench_sizes_beyond_the_machines_memory_are_refused_before_allocating(capsys, argv, flag):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag}=4096000000 is not allowed here: the layer, its dense twin and one batch would need" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("policy", [None, "active", "PASSIVE"])
def test_bench_layer_says_which_wait_policy_to_try_when_workers_spin(capsys, monkeypatch, policy):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    out = _bench_json(capsys, "--no-hf", "--impl", "loop", "--threads", "2")
    said = [n for n in out["notes"] if "OMP_WAIT_POLICY=PASSIVE" in n]
    if policy == "PASSIVE":
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(
            f"OMP_WAIT_POLICY is {(policy or 'default').lower()} with 2 torch"
        )
    assert not [
        n
        for n in _bench_json(capsys, "--no-hf", "--impl", "loop", "--threads", "1")["notes"]
        if "PASSIVE" in n
    ]
