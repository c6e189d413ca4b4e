"""Property-based tests (hypothesis) for routers and dispatch over shapes, N, K and dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import moelab
from moelab.experts import ExpertBank, grouped_mm_available
from router_grid import doc_inputs

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layer_case(draw):
    method = draw(st.sampled_from(moelab.methods()))
    # quantile balancing offsets each token by its (K+1)-th score: K < N
    fewer = 1 if method == "quantile-balancing" else 0
    num_experts = draw(st.integers(1 + fewer, 9))
    top_k = draw(st.integers(1, num_experts - fewer))
    tokens = draw(st.integers(1, 40))
    d_model = draw(st.sampled_from([4, 8, 12]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    return num_experts, top_k, tokens, d_model, method, dtype, seed


def reference_output(layer: moelab.MoE, x: torch.Tensor) -> torch.Tensor:
    """``Σ_k w_k expert_{i_k}(x)`` token by token (+ shared experts), from the last routing."""
    r = layer.last_routing
    xin = x if r.inputs is None else r.inputs  # the experts' input, where the router changes it
    rows = []
    for t in range(x.shape[0]):
        acc = sum(
            r.weights[t, k] * layer.experts.expert_forward(xin[t : t + 1], int(r.indices[t, k]))
            for k in range(r.top_k)
            if r.mask is None or r.mask[t, k]  # a variable number of experts per token
        ) + x.new_zeros(1, x.shape[-1])
        if r.direct is not None:  # experts the router ran itself (MoE++'s copy and constant experts)
            acc = acc + r.direct[t : t + 1]
        rows.append(acc)
    y = torch.cat(rows)
    if layer.shared is not None:
        y = y + layer.shared(x)
    return y


@SETTINGS
@given(layer_case())
def test_every_method_satisfies_routing_invariants_and_matches_the_literal_sum(case):
    num_experts, top_k, tokens, d_model, method, dtype, seed = case
    torch.manual_seed(seed)
    layer = (
        moelab.MoE(d_model, num_experts, top_k, d_hidden=6, method=method, record_routing=True)
        .to(dtype)
        .eval()
    )
    x = torch.randn(tokens, d_model, dtype=dtype)
    with torch.no_grad():
        y = layer(x, **doc_inputs(layer, x))
    r = layer.last_routing
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert r.indices.dtype == torch.int64 and r.indices.shape[0] == tokens
    scored = getattr(layer.router, "num_all", num_experts)  # MoE++ scores experts beyond the bank
    assert ((r.indices >= 0) & (r.indices < scored)).all()
    assert (r.indices.sort(dim=-1).values.diff(dim=-1) != 0).all(), "experts repeat within a token"
    assert (r.weights >= 0).all()
    if (
        layer.router.weights_sum_to_one
    ):  # σ-MoE and ReMoE never renormalise; at K = 1 the default is Switch's p_i
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(tokens, dtype=dtype))
    elif layer.router.base_router.gate == "softmax":  # probabilities of the chosen: at most 1 together
        assert (r.weights.sum(-1) <= 1 + 1e-6).all()
    with torch.no_grad():
        ref = reference_output(layer, x)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)


@SETTINGS
@given(
    st.integers(1, 8),
    st.integers(1, 64),
    st.sampled_from(["relu", "gelu", "silu", "swiglu"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_loop_and_grouped_dispatch_agree_in_value_and_gradient(num_experts, tokens, act, bias, seed):
    if not grouped_mm_available(torch.device("cpu"), torch.float32):  # rows below are 16-byte aligned
        pytest.skip("grouped_mm is not available in this torch")
    torch.manual_seed(seed)
    top_k = min(2, num_experts)
    bank = ExpertBank(num_experts, 8, 16, activation=act, bias=bias)
    if bias:
        torch.nn.init.normal_(bank.b_in)
        torch.nn.init.normal_(bank.b_out)
    x = torch.randn(tokens, 8, requires_grad=True)
    logits = torch.randn(tokens, num_experts)
    weights, indices = moelab.functional.topk_softmax(logits, top_k)
    outs, grads = [], []
    for impl in ("loop", "grouped"):
        bank.impl = impl
        y = bank.mix(x, indices, weights)
        g = torch.autograd.grad(y.square().sum(), [x, bank.w_in, bank.w_out])
        outs.append(y.detach())
        grads.append(g)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ CLI and config fuzzing
class _Reached(Exception):
    """Raised in place of training: every check before it passed (a fuzz case never trains)."""


def _stop(*args, **kwargs):
    raise _Reached


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    from moelab.data.text import load_text

    path = tmp_path_factory.mktemp("fuzzdata") / "t.txt"
    path.write_text("".join(f"fuzz line {i}: {i % 7} owls.\n" for i in range(300)))
    return load_text(str(path))


@pytest.fixture
def no_training(monkeypatch, tiny_text):
    """Every subcommand runs its real argument checks but stops where work would start: the text
    corpus is a tiny local one, ``Trainer.fit``, classification data and HF models raise _Reached."""
    import importlib

    import moelab.experiments.compare as compare
    import moelab.experiments.finetune as finetune
    import moelab.experiments.lm as lm
    from moelab.train.trainer import Trainer

    upcycle = importlib.import_module("moelab.experiments.upcycle")

    monkeypatch.setattr(lm, "load_text", lambda *a, **k: tiny_text)
    monkeypatch.setattr(compare, "load_text", lambda *a, **k: tiny_text)
    monkeypatch.setattr(compare, "jobs_of", lambda args: 1)  # in this process, where fit is patched
    monkeypatch.setattr(Trainer, "fit", _stop)
    monkeypatch.setattr(finetune, "load_classification", _stop)
    monkeypatch.setattr(upcycle, "load_hf_model", _stop)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # --threads must not touch the pool


def _exit_code(argv: list[str]) -> int | str:
    """``moelab argv`` in a fresh empty folder: its exit code, or "reached" when it got to training."""
    import contextlib
    import io
    import os
    import tempfile

    from moelab import cli

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                return cli.main(argv)
        except SystemExit as exc:
            return exc.code
        except _Reached:
            return "reached"
        finally:
            os.chdir(cwd)


def _flags(command: str) -> list[str]:
    from moelab import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sorted(s for a in sub._actions for s in a.option_strings)


# no "/" or ".": a random positional must never name a big folder (report globs its RUN_DIRs)
_WORDS = st.text(alphabet="abcxyz019=,-_: ", max_size=8)
_VALUES = st.one_of(
    st.integers(-3, 40).map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e300", "0.5", "-0.0", "", " ", "--", "-1"]),
    st.sampled_from(["smoe", "competesmoe", "xmoe", "cpu", "glam", "dense", "byte", "word", "o"]),
    st.sampled_from(["balance_coef=0", "a=[", "x=!!python/name:os.system", "=1", "omega=2", "k=v"]),
    _WORDS,
)
FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # patches only
)


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize("command", ["train", "compare", "finetune", "report", "upcycle"])
def test_cli_never_crashes_on_random_arguments(no_training, command, data):
    """Random argv for each subcommand: exit 0 (help) or 2 (a one-line error), or reach training;
    never a Python traceback."""
    tokens = data.draw(st.lists(st.one_of(st.sampled_from(_flags(command)), _VALUES), max_size=8))
    base = data.draw(st.sampled_from([[], ["--out", "o"], ["--out", "o", "--steps", "2"]]))
    argv = [command, *(base if command in ("train", "compare") else []), *tokens]
    code = _exit_code(argv)
    event(f"exit {code}")  # --hypothesis-show-statistics: how often the checks past argparse run
    assert code in (0, 2, "reached"), f"moelab {' '.join(argv)} -> {code!r}"


_YAML_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10)
)
_YAML_VALUES = st.recursive(
    _YAML_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def train_config_text(draw):
    """A YAML document: mostly a mapping of real ``moelab train`` flag names (``-`` or ``_``) to
    random values, sometimes arbitrary YAML or text."""
    from dataclasses import fields

    import yaml

    from moelab.experiments.lm import TrainRun

    names = sorted({f.name for f in fields(TrainRun)} | {"opt", "layers", "heads", "no_progress"})
    kind = draw(st.sampled_from(["flags", "flags", "flags", "any", "text"]))
    if kind == "text":
        return draw(st.text(max_size=60))
    if kind == "any":
        return yaml.safe_dump(draw(_YAML_VALUES))
    keys = st.one_of(st.sampled_from(names), st.sampled_from(names).map(lambda n: n.replace("_", "-")))
    mapping = draw(st.dictionaries(keys, _YAML_VALUES, max_size=4))
    return yaml.safe_dump(mapping)


@FUZZ
@given(text=train_config_text())
def test_train_config_file_never_crashes(no_training, tmp_path_factory, text):
    """A random ``--config`` file gives a clean one-line error (exit 2) or a valid run; never a
    traceback."""
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    code = _exit_code(["train", "--config", str(path), "--out", "o", "--steps", "2"])
    event(f"exit {code}")
    assert code in (2, "reached"), f"--config holding {text!r} -> {code!r}"


def test_the_fuzz_harness_reaches_training_with_valid_arguments(no_training):
    assert _exit_code(["train", "--out", "o", "--steps", "2"]) == "reached"
    assert _exit_code(["compare", "--out", "o", "--steps", "2", "--methods", "smoe"]) == "reached"
    assert (
        _exit_code(["upcycle", "--model", "m", "--num-experts", "4", "--top-k", "2", "--out", "o"])
        == "reached"
    )
    assert _exit_code(["train", "--out", "o", "--help"]) == 0
